#!/usr/bin/env python
"""Compare fusionring with DDP (gloo) and MPI's allreduce on one model, data set, ranks and link.

    python scripts/bench.py -np 4                                    # localhost, print the tables
    python scripts/bench.py -np 4 --cluster --rates 1gbit,10gbit --name cluster-1gbit
    python scripts/bench.py --list                                   # the contenders

The same as ``fusionring bench``; see docs/bench.md.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusionring.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="python scripts/bench.py"))
