"""Shared building blocks for benchmarks: ``fusionring bench`` and the scripts in ``scripts/``.

Everything a benchmark needs besides the thing it measures:

* launching: :func:`launch_under_mpiexec` re-runs a script under ``mpiexec -n N`` with a
  timeout and returns rank 0's JSON result; :func:`free_port` for torch.distributed rendezvous.
* measuring: :func:`interleaved` runs contenders A B C, B C A, ... so slow drift of a shared,
  noisy machine hits all of them alike; :func:`summarize` turns samples into median and quartiles.
* conditions: :func:`load_average`, :func:`wait_for_quiet_machine` and :func:`machine_summary`,
  so every document says how busy the machine was.
* writing: :func:`markdown_table`, :func:`line_plot`, :func:`bar_plot`, :func:`preserved_section`
  and :class:`BenchDoc` (a markdown page with tables, a plot and the exact command that made it).

Scripts import it as ``from fusionring.bench.util import ...``.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..units import KIB, MIB, format_bytes  # noqa: F401 - part of this toolkit

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS_DIR = os.path.join(REPO_ROOT, "docs", "benchmarks")

# Name of the environment variable through which a launched worker learns where to write
# its result (rank 0 writes JSON there).
RESULT_PATH_ENV = "BENCH_RESULT_PATH"


# --------------------------------------------------------------------------------------------
# Formatting


def format_seconds(seconds: float) -> str:
    """A duration in the unit that keeps 3 significant digits readable (us, ms, s)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def format_ratio(value: Optional[float]) -> str:
    """1.234 -> '1.23x'; None -> 'n/a'."""
    return "n/a" if value is None else f"{value:.2f}x"


def parse_sizes(text: str) -> List[int]:
    """'4KiB:256MiB:4' -> powers of 4 from 4 KiB to 256 MiB; '4096,65536' -> that list.

    Units: B, KiB/K, MiB/M, GiB/G (binary)."""
    def one(token: str) -> int:
        token = token.strip()
        for suffix, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10),
                              ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10), ("B", 1)):
            if token.endswith(suffix):
                return int(float(token[:-len(suffix)]) * scale)
        return int(token)

    if ":" in text:
        lo, hi, factor = text.split(":")
        sizes, size = [], one(lo)
        while size <= one(hi):
            sizes.append(size)
            size *= int(factor)
        return sizes
    return [one(t) for t in text.split(",") if t.strip()]


# --------------------------------------------------------------------------------------------
# Statistics


@dataclasses.dataclass(frozen=True)
class Summary:
    """Median and spread of repeated samples (seconds, or whatever unit was sampled)."""

    median: float
    p25: float
    p75: float
    minimum: float
    n: int

    @property
    def iqr_fraction(self) -> float:
        """Interquartile range over the median: a quick noise figure (0.1 = 10 %)."""
        return (self.p75 - self.p25) / self.median if self.median else 0.0


def summarize(samples: Sequence[float]) -> Summary:
    """Median, quartiles and minimum of ``samples`` (at least one)."""
    if not samples:
        raise ValueError("no samples to summarize")
    values = sorted(float(s) for s in samples)
    if len(values) >= 2:
        q = statistics.quantiles(values, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = values[0]
    return Summary(statistics.median(values), p25, p75, values[0], len(values))


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation over mean (0 for fewer than two values or a zero mean)."""
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else 0.0


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def rotations(names: Sequence[str], rounds: int) -> Iterable[Tuple[int, List[str]]]:
    """(round, order) with the order rotated each round: A B C, B C A, C A B, A B C, ..."""
    names = list(names)
    for r in range(rounds):
        k = r % len(names) if names else 0
        yield r, names[k:] + names[:k]


def interleaved(contenders: Mapping[str, Callable[[], float]], repeats: int, *,
                warmup: int = 1, rotate: bool = True,
                between: Optional[Callable[[], None]] = None) -> Dict[str, List[float]]:
    """Run every contender once per round, ``repeats`` rounds after ``warmup`` unrecorded ones.

    Each contender is a callable returning one sample (e.g. seconds). With ``rotate`` the order
    shifts every round so no contender always runs right after the same neighbour. ``between``
    (e.g. a barrier) runs before every sample. Every rank of a multi-rank benchmark must call
    this with the same contenders and repeats, as the order is derived from them alone."""
    samples: Dict[str, List[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r, order in rotations(names, warmup + repeats):
        for name in (order if rotate else names):
            if between is not None:
                between()
            value = contenders[name]()
            if r >= warmup:
                samples[name].append(value)
    return samples


# --------------------------------------------------------------------------------------------
# Machine conditions


def load_average() -> Tuple[float, float, float]:
    """1, 5 and 15 minute load averages (zeros where the OS does not report them)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def wait_for_quiet_machine(max_load: Optional[float] = None, max_wait_s: float = 300.0,
                           poll_s: float = 30.0, log: Callable[[str], None] = print) -> float:
    """Wait until the 1-minute load is at most ``max_load`` (default: the core count).

    Gives up after ``max_wait_s`` and returns the load it last saw, so a benchmark can still run
    and report the conditions honestly."""
    limit = float(os.cpu_count() or 1) if max_load is None else max_load
    deadline = time.monotonic() + max_wait_s
    while True:
        load = load_average()[0]
        if load <= limit or time.monotonic() >= deadline:
            return load
        log(f"load average {load:.2f} > {limit:.2f}; waiting {poll_s:.0f} s for a quieter machine")
        time.sleep(poll_s)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_summary() -> Dict[str, Any]:
    """Facts about the machine and software that a reader needs to judge the numbers."""
    info: Dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        from mpi4py import MPI

        info["mpi"] = " ".join(MPI.Get_library_version().splitlines()[0].split())
    except Exception:  # noqa: BLE001 - MPI is optional for the summary
        pass
    return info


# --------------------------------------------------------------------------------------------
# Launching


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torch.distributed env://)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the MPI wheel's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else "mpiexec"


def launch_under_mpiexec(script: str, ranks: int, args: Sequence[str] = (), *,
                         env: Optional[Mapping[str, str]] = None, timeout_s: float = 600.0,
                         echo: bool = True) -> Any:
    """Run ``python script args`` on ``ranks`` ranks and return rank 0's JSON result.

    The worker finds the result path in ``$BENCH_RESULT_PATH`` and should write it with
    :func:`write_result` on rank 0. Output streams through (``echo``); a non-zero exit or a
    timeout raises RuntimeError."""
    fd, result_path = tempfile.mkstemp(prefix="bench-", suffix=".json")
    os.close(fd)
    os.unlink(result_path)
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env[RESULT_PATH_ENV] = result_path
    command = [mpiexec_path(), "-n", str(ranks), sys.executable, script, *args]
    try:
        proc = subprocess.run(command, env=child_env, timeout=timeout_s,
                              stdout=None if echo else subprocess.PIPE,
                              stderr=None if echo else subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(command)} ran past {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = "" if echo else f":\n{proc.stdout[-4000:]}"
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}{tail}")
    try:
        with open(result_path, encoding="utf-8") as f:
            return json.load(f)
    finally:
        os.unlink(result_path)


def write_result(result: Any) -> None:
    """Called by a launched worker on rank 0: hand ``result`` (JSON-able) back to the launcher."""
    path = os.environ.get(RESULT_PATH_ENV)
    if not path:
        print(json.dumps(result, indent=1))
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f)


@dataclasses.dataclass
class Run:
    """One benchmark run as a document needs it: command, conditions, raw results, options."""

    command: str
    machine: Dict[str, Any]
    loads: List[Tuple[str, List[float]]]
    results: Any
    options: Dict[str, Any]

    def save(self, path: str) -> None:
        """Keep the run to rewrite its document later without measuring again."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f)

    @classmethod
    def load(cls, path: str) -> "Run":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data["command"] = clean_command(data["command"])
        data["loads"] = [(w, list(l)) for w, l in data["loads"]]
        return cls(**data)


# Options that only say where outputs go; left out of the command a document shows.
OUTPUT_OPTIONS = ("--doc", "--save-results", "--from-results")
OUTPUT_FLAGS = ("--no-doc",)


def clean_command(command: str, drop: Sequence[str] = OUTPUT_OPTIONS,
                  drop_flags: Sequence[str] = OUTPUT_FLAGS) -> str:
    """``command`` without the options in ``drop`` (each with its value, or as --opt=value)
    and the flags in ``drop_flags``."""
    words = shlex.split(command)
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in drop:
            skip = "=" not in word
            continue
        if word in drop_flags:
            continue
        kept.append(word)
    return " ".join(shlex.quote(w) for w in kept)


def command_line() -> str:
    """The command that started this process, relative to the repository root when possible,
    without output-location options (:data:`OUTPUT_OPTIONS`)."""
    argv = list(sys.argv)
    script = os.path.abspath(argv[0])
    if script.startswith(REPO_ROOT + os.sep):
        argv[0] = os.path.relpath(script, REPO_ROOT)
    return clean_command("python " + " ".join(shlex.quote(a) for a in argv))


# --------------------------------------------------------------------------------------------
# Writing


def add_run_options(parser, default_doc: str) -> None:
    """The options every benchmark script shares: load gate, output document, raw results."""
    import argparse

    parser.add_argument("--max-load", type=float, default=None,
                        help="wait (up to 5 min) for the 1-minute load to drop to this first")
    parser.add_argument("--doc", default=default_doc)
    parser.add_argument("--no-doc", action="store_true", help="print only, write no files")
    parser.add_argument("--timeout-s", type=float, default=480.0, help="per mpiexec launch")
    parser.add_argument("--save-results", default="",
                        help="also write the raw results (JSON) here")
    parser.add_argument("--from-results", default="",
                        help="measure nothing: rewrite the document from saved raw results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def start_run(args) -> "Run":
    """A Run to fill (after waiting for a quiet machine), or the saved one --from-results names.

    A saved run also restores the options it was measured with into `args`.
    """
    if args.from_results:
        run = Run.load(args.from_results)
        for key, value in run.options.items():
            if key not in ("doc", "no_doc", "from_results", "save_results"):
                setattr(args, key, value)
        return run
    run = Run(command_line(), machine_summary(), [], [], {})
    if args.max_load is not None:
        wait_for_quiet_machine(args.max_load)
    run.loads.append(("before", load_average()))
    return run


def finish_run(run: "Run", args, targets: Callable[[list], List[str]],
               plot: Callable[[list, str], None], write_doc: Callable[[str], None]) -> None:
    """After measuring (or loading): save if asked, print the verdicts, plot, write the report.

    ``write_doc`` gets the plot's file name, relative to the report.
    """
    if not args.from_results:
        run.options = vars(args)
        if args.save_results:
            run.save(args.save_results)
    for line in targets(run.results):
        print(line)
    if not args.no_doc:
        os.makedirs(os.path.dirname(os.path.abspath(args.doc)), exist_ok=True)
        png = os.path.splitext(args.doc)[0] + ".png"
        plot(run.results, png)
        write_doc(os.path.basename(png))
        print(f"wrote {args.doc} and {png}")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: Optional[str] = None) -> str:
    """A GitHub markdown table. ``align`` has one letter per column: l, r, c, or - for none
    (default: first column left, the rest right)."""
    headers = [str(h) for h in headers]
    align = align or ("l" + "r" * (len(headers) - 1))
    marks = {"l": ":---", "r": "---:", "c": ":---:", "-": " --- "}
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """The same table, aligned for a terminal."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    print("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(plt, fig, axes, used: int, suptitle: Optional[str], path: str) -> None:
    """Blank the unused axes, title the figure and write it."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def line_plot(path: str, panels: Sequence[Mapping[str, Any]], *, ncols: Optional[int] = None,
              suptitle: Optional[str] = None) -> None:
    """One or more line charts side by side, saved as PNG.

    Each panel: {"title", "xlabel", "ylabel", "series": {label: (xs, ys)}, optional "logx",
    "logy", "xticks" (values), "xticklabels", "hline" (y, label)}."""
    plt = _pyplot()
    ncols = ncols or len(panels)
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for label, (xs, ys) in panel["series"].items():
            ax.plot(xs, ys, marker="o", markersize=3.5, label=label)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        if panel.get("logy"):
            ax.set_yscale("log")
        if "xticks" in panel:
            ax.set_xticks(panel["xticks"])
            ax.set_xticklabels(panel.get("xticklabels", panel["xticks"]), rotation=45,
                               fontsize=8)
        if "hline" in panel:
            y, label = panel["hline"]
            ax.axhline(y, color="grey", linestyle="--", linewidth=1, label=label)
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    _save_figure(plt, fig, axes, len(panels), suptitle, path)


def bar_plot(path: str, panels: Sequence[Mapping[str, Any]], *, ncols: Optional[int] = None,
             suptitle: Optional[str] = None) -> None:
    """Grouped bar charts side by side, saved as PNG.

    Each panel: {"title", "ylabel", "groups": [group labels], "series": {label: [one value per
    group]}, optional "errors": {label: [(low, high) per group]}, "hline" (y, label)}."""
    import numpy as np

    plt = _pyplot()
    ncols = ncols or len(panels)
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols, 4.0 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        groups = list(panel["groups"])
        series = panel["series"]
        width = 0.8 / max(1, len(series))
        x = np.arange(len(groups))
        for i, (label, values) in enumerate(series.items()):
            err = None
            if panel.get("errors") and label in panel["errors"]:
                lows, highs = zip(*panel["errors"][label])
                err = [np.subtract(values, lows), np.subtract(highs, values)]
            bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label,
                          yerr=err, capsize=2)
            if panel.get("annotate", True):
                ax.bar_label(bars, fmt=panel.get("value_format", "%.0f"), fontsize=7,
                             padding=2)
        if "hline" in panel:
            y, label = panel["hline"]
            ax.axhline(y, color="grey", linestyle="--", linewidth=1, label=label)
        ax.set_xticks(x)
        ax.set_xticklabels(groups, fontsize=9)
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    _save_figure(plt, fig, axes, len(panels), suptitle, path)


def preserved_section(path: str, heading: Optional[str] = None, *,
                      markers: Optional[Tuple[str, str]] = None) -> Optional[str]:
    """Hand-written text of an existing markdown file, or None, so that a benchmark can render
    its page again and keep the analysis: the body of ``## heading`` (up to the next
    ``## ``), or with ``markers=(start, end)`` the block between them, markers included."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    if markers is not None:
        start, end = text.find(markers[0]), text.find(markers[1])
        return text[start:end + len(markers[1])] if 0 <= start < end else None
    lines = text.splitlines()
    body, inside = [], False
    for line in lines:
        if line.startswith("## "):
            if inside:
                break
            inside = line[3:].strip() == heading
            continue
        if inside:
            body.append(line)
    text = "\n".join(body).strip()
    return text or None


class BenchDoc:
    """A benchmark's markdown page, built in order and written once.

    >>> doc = BenchDoc("Allreduce bandwidth", command="python scripts/bench_allreduce.py")
    >>> doc.paragraph("What was measured ...")
    >>> doc.table(["size", "MPI"], rows)
    >>> doc.image("allreduce.png", "bus bandwidth")
    >>> doc.write("docs/benchmarks/allreduce.md")
    """

    def __init__(self, title: str, command: Optional[str] = None):
        self._parts: List[str] = [f"# {title}"]
        self._command = command

    def heading(self, text: str, level: int = 2) -> None:
        self._parts.append("#" * level + " " + text)

    def paragraph(self, text: str) -> None:
        self._parts.append(text.strip())

    def bullets(self, items: Iterable[str]) -> None:
        self._parts.append("\n".join(f"- {item}" for item in items))

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[Any]],
              align: Optional[str] = None) -> None:
        self._parts.append(markdown_table(headers, rows, align))

    def image(self, filename: str, alt: str) -> None:
        self._parts.append(f"![{alt}]({filename})")

    def keep_section(self, path: str, heading: str) -> None:
        """Carry ``## heading`` over from the file at ``path`` (hand-written notes), if present."""
        body = preserved_section(path, heading)
        if body:
            self.heading(heading)
            self._parts.append(body)

    def code(self, text: str, language: str = "") -> None:
        self._parts.append(f"```{language}\n{text.rstrip()}\n```")

    def conditions(self, info: Mapping[str, Any], loads: Sequence[Tuple[str, Sequence[float]]]
                   ) -> None:
        """The machine and the load averages seen at named moments (e.g. before/after)."""
        lines = [f"{k}: {v}" for k, v in info.items()]
        lines += [f"load average {when}: " + ", ".join(f"{x:.2f}" for x in load) + " (1, 5, 15 min)"
                  for when, load in loads]
        self.bullets(lines)
        self.paragraph("The 1-minute load before a run is the telling figure; the figures after a "
                       "run include the run's own ranks.")

    def text(self) -> str:
        parts = list(self._parts)
        if self._command:
            parts.insert(1, "Reproduce (from the repository root, inside the virtual environment):")
            parts.insert(2, f"```sh\n{self._command}\n```")
        return "\n\n".join(parts) + "\n"

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.text())


DEFAULT_DOC_DIR = Path(DOCS_DIR)


def ring_bytes(payload_bytes: float, size: int) -> float:
    """Bytes each rank sends in a ring allreduce of ``payload_bytes``: 2(N-1)/N of it."""
    return payload_bytes * 2 * (size - 1) / size if size > 1 else 0.0
