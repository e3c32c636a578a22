"""The ``fusionring`` command: one subcommand per tool, each defined next to the code it runs.

A subcommand is a module with ``configure_parser(parser)`` and ``run_command(args) -> int``; add
one by adding a line to ``COMMANDS``. ``python -m fusionring`` runs the same entry point.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional, Sequence

# (name, module, one-line help). Modules are imported only when their subcommand runs.
COMMANDS: Sequence[tuple] = (
    ("plan", "fusionring.plan", "profile a model and write a balanced gradient grouping plan"),
    ("bench", "fusionring.bench", "compare fusionring with DDP (gloo) and MPI allreduce on one model and link"),
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; subcommand arguments are added when that subcommand is chosen."""
    parser = argparse.ArgumentParser(prog="fusionring",
                                     description="fusionring: fused, balanced gradient allreduce")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, _module, help_text in COMMANDS:
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]), run the chosen subcommand, return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    known = {name: (module, help_text) for name, module, help_text in COMMANDS}
    if not argv or argv[0] not in known:
        parser.parse_args(argv)  # prints help or a usage error for unknown commands
        parser.print_help()
        return 2
    name = argv[0]
    module_name, help_text = known[name]
    module = importlib.import_module(module_name)
    sub_parser = argparse.ArgumentParser(prog=f"fusionring {name}", description=help_text)
    module.configure_parser(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run_command(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
