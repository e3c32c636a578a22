"""``fusionring bench`` / ``python -m fusionring.bench`` / ``scripts/bench.py``: the command line."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .contenders import CONTENDERS, default_contenders
from .driver import LinkRun, _launch
from .probes import run_worker
from .report import kept_findings, plot_runs, print_summary, render_markdown
from .util import DEFAULT_DOC_DIR


# ================================================================================ running

def _runs_to_json(runs: Sequence[LinkRun]) -> List[Dict[str, Any]]:
    return [dataclasses.asdict(run) for run in runs]


def load_runs(paths: Sequence[str]) -> List[LinkRun]:
    """The runs saved with ``--json`` in each of ``paths``, in order."""
    runs = []
    for path in paths:
        payload = json.loads(Path(path).read_text())
        for item in payload["runs"]:
            item.setdefault("command", payload.get("command", ""))
            runs.append(LinkRun(**item))
    return runs


def run_driver(args: argparse.Namespace, command: str) -> int:
    """Launch one job per link, print the tables, write the page (with --name) and the raw JSON."""
    if args.from_json:
        runs = load_runs(args.from_json)
    else:
        contenders = args.contenders.split(",") if args.contenders else default_contenders()
        if len(set(contenders)) != len(contenders):
            raise SystemExit(f"fusionring bench: --contenders names one twice: {args.contenders}")
        for contender in contenders:
            spec = CONTENDERS.get(contender)
            if spec is None:
                raise SystemExit(f"fusionring bench: unknown contender {contender!r}; known: "
                                 f"{', '.join(CONTENDERS)}")
            reason = spec.missing()
            if reason:
                raise SystemExit(f"fusionring bench: contender {contender!r} cannot run here: {reason}")
        rates = [r.strip() for r in args.rates.split(",") if r.strip()] if args.cluster else [None]
        runs = []
        for rate in rates:
            runs.append(_launch(args, rate, contenders, command))
            if args.json:  # keep what finished even if a later link fails
                Path(args.json).write_text(json.dumps({"command": command, "runs": _runs_to_json(runs)},
                                                      indent=1))
    print_summary(runs, args.target_accuracy)
    if args.name:
        doc_dir = Path(args.doc_dir)
        doc_dir.mkdir(parents=True, exist_ok=True)
        images = plot_runs(runs, args.target_accuracy, doc_dir, args.name)
        page = doc_dir / f"{args.name}.md"
        rendered_by = command if args.from_json else None
        page.write_text(render_markdown(runs, args.target_accuracy, images, args.name, rendered_by,
                                        kept_findings(page)) + "\n")
        print(f"\nwrote {page}" + "".join(f", {doc_dir / i}" for i in images))
    return 0


# ================================================================================ command line

def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fusionring bench`` (and ``scripts/bench.py``)."""
    parser.add_argument("-np", "--np", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--cluster", action="store_true",
                        help="run each rank in its own namespace of the emulated cluster (root), once per rate")
    parser.add_argument("--rates", default="1gbit",
                        help="with --cluster: comma-separated link rates, one launch each (default 1gbit)")
    parser.add_argument("--mode", choices=("both", "train", "collectives"), default="both",
                        help="training comparison, raw allreduce timing, or both (default)")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated contenders (default: every available one; see --list)")
    parser.add_argument("--list", action="store_true", help="list the contenders and exit")
    parser.add_argument("--steps", type=int, default=4, help="steps per contender per turn (default 4)")
    parser.add_argument("--repeats", type=int, default=10, help="rounds of turns (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per contender (default 3)")
    parser.add_argument("--hidden", type=int, default=2048, help="MLP width (default 2048)")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-accuracy", type=float, default=0.9,
                        help="test accuracy for time-to-accuracy (default 0.9)")
    parser.add_argument("--collective-mib", type=int, default=64, help="raw allreduce size (default 64 MiB)")
    parser.add_argument("--collective-repeats", type=int, default=5)
    parser.add_argument("--name", default=None,
                        help="write <doc-dir>/<name>.md and its plots (default: print only)")
    parser.add_argument("--doc-dir", default=str(DEFAULT_DOC_DIR))
    parser.add_argument("--json", default=None, help="also save the raw results here")
    parser.add_argument("--from-json", action="append", default=[], metavar="PATH",
                        help="render from results saved with --json (repeat to merge runs); run nothing")
    parser.add_argument("--timeout-s", type=float, default=480, help="limit per launch (default 480)")
    parser.add_argument("--wait-for-lab-s", type=float, default=0,
                        help="with --cluster: wait this long for a lab already up to go away (default: fail)")
    parser.add_argument("--mpiexec", default=None, help="mpiexec to use (passed to fusionrun)")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first on the driver and every rank (it may register contenders)")
    # the per-rank side, started by the driver through fusionrun
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--interface", default=None, help=argparse.SUPPRESS)


def _list_contenders() -> int:
    for name, spec in CONTENDERS.items():
        reason = spec.missing()
        state = "" if reason is None else f"   [unavailable: {reason}]"
        print(f"{name:18s} {spec.description}{state}")
    return 0


def run_command(args: argparse.Namespace, command: Optional[str] = None) -> int:
    """Run ``fusionring bench`` with parsed ``args``; ``command`` is the line recorded in the page."""
    for module in args.imports:
        importlib.import_module(module)
    if args.list:
        return _list_contenders()
    if args.worker:
        if args.out is None or args.contenders is None:
            raise SystemExit("--worker needs --out and --contenders")
        return run_worker(args)
    if command is None:
        command = shlex.join(["fusionring", "bench"] + sys.argv[2:])
    return run_driver(args, command)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m fusionring.bench") -> int:
    """Entry point for ``python -m fusionring.bench`` and ``scripts/bench.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    configure_parser(parser)
    args = parser.parse_args(argv)
    return run_command(args, shlex.join(shlex.split(prog) + argv))
