"""``python -m fusionring ...``: the same as the ``fusionring`` command."""
from fusionring.cli import main

raise SystemExit(main())
