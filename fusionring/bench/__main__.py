"""``python -m fusionring.bench``."""
import sys

from .cli import main

sys.exit(main())
