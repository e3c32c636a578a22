"""Run Horovod's own PyTorch test suite against fusionring, one test per job.

    python scripts/horovod_compat.py PATH/TO/horovod/test/parallel/test_torch.py -np 2,3,4

The suite is the user's copy (fusionring ships none of Horovod's code). It is copied with
its helper module (``common.py``, found beside it or in ``../utils/``, or given with
``--helper``) into a temporary directory, where ``import horovod.torch as hvd`` becomes
``import fusionring.torch as hvd`` (and ``from horovod.torch.mpi_ops import ...`` or
``from horovod.common.util import ...`` imports fusionring's module of that name), and the helper's imports that need Horovod's launcher
(``horovod.runner.util.threads``) or the ``mock`` package become optional. Every test then
runs alone in its own ``mpiexec -n N`` (so a failure cannot cascade into the next test),
under a time limit (a hang counts as a failure, "timeout"). Each rank writes its own
JUnit XML; a test passes when every rank passed it, is skipped when every rank skipped it,
and fails otherwise (the first failing rank's first error line is kept).

Prints a table per rank count and writes ``docs/benchmarks/horovod-compat.md`` with the
exact command, the counts at each rank count and every test that failed or was skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REPORT = ROOT / "docs" / "benchmarks" / "horovod-compat.md"

# Runs one pytest session on one rank, writing that rank's JUnit XML.
_RANK_RUNNER = '''
import os, sys
import pytest

rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
             if v in os.environ), "0")
out = os.environ["HOROVOD_COMPAT_OUT"]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                      "--junitxml=" + os.path.join(out, "rank%s.xml" % rank),
                      "-o", "junit_family=xunit1", sys.argv[1]]))
'''

_OPTIONAL_THREADS = '''try:
    from horovod.runner.util.threads import in_thread
except ImportError:  # horovod_compat.py: Horovod's launcher is not installed
    def in_thread(target, args=(), name=None, daemon=True, silent=False):
        import threading
        thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
        thread.start()
        return thread
'''

_OPTIONAL_MOCK = '''try:
    import mock
except ImportError:  # horovod_compat.py: the standard library's copy
    from unittest import mock
'''


@dataclass
class Outcome:
    status: str  # passed, failed, skipped
    message: str = ""
    ranks: Dict[int, str] = field(default_factory=dict)


def find_helper(test_file: Path, given: Optional[Path]) -> Path:
    if given is not None:
        return given
    for candidate in (test_file.parent / "common.py",
                      test_file.parent.parent / "utils" / "common.py"):
        if candidate.exists():
            return candidate
    raise SystemExit(f"no helper module common.py beside {test_file} or in ../utils/; "
                     f"pass --helper PATH")


def prepare(test_file: Path, helper: Path, workdir: Path) -> Path:
    """Copy the suite and its helper into `workdir`, rewritten to use fusionring."""
    source = test_file.read_text()
    rewritten, count = re.subn(r"^import horovod\.torch as hvd\s*$",
                               "import fusionring.torch as hvd", source, flags=re.M)
    if count == 0:
        raise SystemExit(f"{test_file}: no line 'import horovod.torch as hvd' to rewrite")
    # Other imports of Horovod's torch and common modules by name (`from
    # horovod.torch.mpi_ops import synchronize`, `from horovod.common.util import env`) get
    # fusionring's module of the same name.
    rewritten = re.sub(r"^(\s*from\s+)horovod\.(torch|common)\b", r"\1fusionring.\2",
                       rewritten, flags=re.M)
    target = workdir / test_file.name
    target.write_text(rewritten)
    common = helper.read_text()
    common = re.sub(r"^from horovod\.runner\.util\.threads import in_thread\s*$",
                    _OPTIONAL_THREADS, common, flags=re.M)
    common = re.sub(r"^import mock\s*$", _OPTIONAL_MOCK, common, flags=re.M)
    (workdir / "common.py").write_text(common)
    (workdir / "_rank_runner.py").write_text(_RANK_RUNNER)
    return target


def environment(workdir: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(workdir), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def collect(target: Path, env: Dict[str, str], pattern: Optional[str]) -> List[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           target.name]
    if pattern:
        cmd += ["-k", pattern]
    done = subprocess.run(cmd, cwd=target.parent, env=env, capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"collected no tests:\n{done.stdout}\n{done.stderr}")
    return ids


def mpiexec() -> str:
    candidate = Path(sys.executable).parent / "mpiexec"
    found = str(candidate) if candidate.exists() else shutil.which("mpiexec")
    if not found:
        raise SystemExit("no mpiexec found")
    return found


def first_line(text: str) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:200]
    return ""


def read_rank(path: Path) -> Optional[Outcome]:
    try:
        case = ET.parse(path).getroot().find(".//testcase")
    except (ET.ParseError, OSError):
        return None
    if case is None:
        return None
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            text = node.get("message") or node.text or tag
            return Outcome("failed", first_line(text))
    node = case.find("skipped")
    if node is not None:
        return Outcome("skipped", first_line(node.get("message") or node.text or "skipped"))
    return Outcome("passed")


def run_test(test_id: str, np: int, workdir: Path, env: Dict[str, str],
             timeout: float) -> Outcome:
    out = Path(tempfile.mkdtemp(prefix="result-", dir=workdir))
    env = dict(env, HOROVOD_COMPAT_OUT=str(out))
    cmd = [mpiexec(), "-n", str(np), sys.executable, "_rank_runner.py", test_id]
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and the ranks it started
        output, _ = proc.communicate()
        timed_out = True
    ranks: Dict[int, Outcome] = {r: read_rank(out / f"rank{r}.xml") for r in range(np)}
    shutil.rmtree(out, ignore_errors=True)
    statuses = {r: (o.status if o else ("timeout" if timed_out else "no result"))
                for r, o in ranks.items()}
    failing = [r for r, o in ranks.items() if o is None or o.status == "failed"]
    if timed_out and not failing:
        failing = list(ranks)
    if failing:
        # The rank that failed first, where one can tell: a rank whose peer left reports
        # that as its error, which says less than the peer's own.
        r = next((r for r in failing if ranks[r] is not None
                  and "shut down because" not in ranks[r].message),
                 next((r for r in failing if ranks[r] is not None), failing[0]))
        if ranks[r] is not None:
            message = f"rank {r}: {ranks[r].message}"
        elif timed_out:
            message = f"timeout after {timeout:.0f} s (no result from rank {r})"
        else:
            tail = first_line("\n".join(output.splitlines()[-3:]))
            message = f"rank {r} wrote no result (exit code {proc.returncode}): {tail}"
        if timed_out and "timeout" not in message:
            message = f"timeout after {timeout:.0f} s; {message}"
        return Outcome("failed", message, statuses)
    if all(o.status == "skipped" for o in ranks.values()):
        return Outcome("skipped", ranks[0].message, statuses)
    return Outcome("passed", "", statuses)


def short(test_id: str) -> str:
    return test_id.rsplit("::", 1)[-1]


def counts(results: Dict[str, Outcome]) -> Dict[str, int]:
    out = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome in results.values():
        out[outcome.status] += 1
    return out


def save_results(path: Path, commands: List[str], suite: str, timeout: float,
                 all_results: Dict[int, Dict[str, Outcome]], seconds: Dict[int, float]) -> None:
    """Keep a run's outcomes, so runs at different rank counts can make one report."""
    path.write_text(json.dumps({
        "commands": commands, "suite": suite, "timeout": timeout,
        "seconds": {str(np): t for np, t in seconds.items()},
        "results": {str(np): {t: [o.status, o.message, {str(r): v for r, v in o.ranks.items()}]
                              for t, o in results.items()}
                    for np, results in all_results.items()}}, indent=1))


def load_results(paths: List[Path]):
    commands, all_results, seconds, suite, timeout = [], {}, {}, "", 0.0
    for path in paths:
        data = json.loads(path.read_text())
        commands += [c for c in data["commands"] if c not in commands]
        suite, timeout = data["suite"], max(timeout, data["timeout"])
        for np, results in data["results"].items():
            # A later run's outcome of a test replaces an earlier one's.
            all_results.setdefault(int(np), {}).update(
                {t: Outcome(v[0], v[1], {int(r): s for r, s in v[2].items()})
                 for t, v in results.items()})
            seconds[int(np)] = seconds.get(int(np), 0.0) + data["seconds"][np]
    return commands, suite, timeout, dict(sorted(all_results.items())), seconds


def write_report(path: Path, commands: List[str], suite: str,
                 all_results: Dict[int, Dict[str, Outcome]],
                 seconds: Dict[int, float], timeout: float, notes: str = "") -> None:
    lines = ["# Horovod's PyTorch test suite against fusionring", "",
             "Each test of the suite runs alone in its own `mpiexec -n N` (a failure cannot cascade "
             "into the next test), with `import horovod.torch as hvd` changed to "
             "`import fusionring.torch as hvd`; a test passes when every rank passes it, and a "
             f"test still running after {timeout:.0f} s counts as failed (timeout).", "",
             "Command" + ("s" if len(commands) > 1 else "") + ":", "", "```bash", *commands,
             "```", "",
             f"Suite: `{suite}`.", "",
             "| ranks | tests run | passed | failed | skipped | minutes |",
             "| --- | --- | --- | --- | --- | --- |"]
    for np, results in all_results.items():
        c = counts(results)
        lines.append(f"| {np} | {len(results)} | {c['passed']} | {c['failed']} | {c['skipped']} | "
                     f"{seconds[np] / 60:.1f} |")
    for status in ("failed", "skipped"):
        rows = {}
        for np, results in all_results.items():
            for test_id, outcome in results.items():
                if outcome.status == status:
                    rows.setdefault(short(test_id), []).append((np, outcome.message))
        lines += ["", f"## {status.capitalize()} ({len(rows)})", ""]
        if not rows:
            lines.append("None.")
            continue
        lines += ["| test | ranks | first error line |" if status == "failed" else
                  "| test | ranks | reason |", "| --- | --- | --- |"]
        for name, seen in sorted(rows.items()):
            nps = ", ".join(str(np) for np, _ in seen)
            message = seen[0][1].replace("|", "\\|")
            lines.append(f"| `{name}` | {nps} | {message} |")
    if notes.strip():
        lines += ["", "## Notes", "", notes.strip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, nargs="?",
                        help="Horovod's test/parallel/test_torch.py")
    parser.add_argument("-np", default="2,3,4", help="rank counts, comma separated (2,3,4)")
    parser.add_argument("--helper", type=Path, default=None,
                        help="the suite's helper module (default: common.py beside it or "
                             "in ../utils/)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    parser.add_argument("-k", dest="pattern", default=None,
                        help="only tests matching this pytest -k expression")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_REPORT,
                        help="Markdown report (default docs/benchmarks/horovod-compat.md); "
                             "'-' writes none")
    parser.add_argument("--save", type=Path, default=None,
                        help="also keep the outcomes as JSON (for --combine)")
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                        help="write the report from runs kept with --save (e.g. one per rank "
                             "count, run apart; a later file's outcome of a test wins); runs "
                             "nothing")
    parser.add_argument("--notes", type=Path, default=None,
                        help="a Markdown file appended to the report as its Notes (e.g. why a "
                             "test fails with Horovod too)")
    args = parser.parse_args(argv)
    notes = args.notes.read_text() if args.notes is not None else ""
    if args.combine:
        commands, suite, timeout, all_results, seconds = load_results(args.combine)
        write_report(args.output, commands, suite, all_results, seconds, timeout, notes)
        print(f"wrote {args.output}")
        return 0
    if args.test_file is None:
        parser.error("the test file is required (unless --combine)")
    test_file = args.test_file.resolve()
    if not test_file.exists():
        raise SystemExit(f"{test_file} does not exist")
    helper = find_helper(test_file, args.helper)
    rank_counts = [int(n) for n in args.np.split(",") if n.strip()]
    command = "python scripts/horovod_compat.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    workdir = Path(tempfile.mkdtemp(prefix="horovod-compat-"))
    try:
        target = prepare(test_file, helper, workdir)
        env = environment(workdir)
        test_ids = collect(target, env, args.pattern)
        print(f"{len(test_ids)} tests from {test_file}", flush=True)
        all_results: Dict[int, Dict[str, Outcome]] = {}
        seconds: Dict[int, float] = {}
        for np in rank_counts:
            started = time.perf_counter()
            results = all_results[np] = {}
            for i, test_id in enumerate(test_ids, 1):
                t0 = time.perf_counter()
                outcome = results[test_id] = run_test(test_id, np, workdir, env, args.timeout)
                note = f"  {outcome.message}" if outcome.status != "passed" else ""
                print(f"[np={np} {i}/{len(test_ids)}] {outcome.status:7s} "
                      f"{time.perf_counter() - t0:5.1f}s {short(test_id)}{note}", flush=True)
            seconds[np] = time.perf_counter() - started
        print()
        print(f"{'ranks':>5} {'passed':>7} {'failed':>7} {'skipped':>8}")
        for np, results in all_results.items():
            c = counts(results)
            print(f"{np:>5} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}")
        if args.save is not None:
            save_results(args.save, [command], test_file.name, args.timeout, all_results, seconds)
        if str(args.output) != "-":
            write_report(args.output, [command], test_file.name, all_results, seconds,
                         args.timeout, notes)
            print(f"wrote {args.output}")
        failed = any(o.status == "failed" for r in all_results.values() for o in r.values())
        return 1 if failed else 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
