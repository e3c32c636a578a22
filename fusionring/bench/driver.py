"""The driver: launches the benchmark job per link rate, collects its results and sums them
up (medians, spreads, time to accuracy)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .util import REPO_ROOT, ring_bytes


# ================================================================================ the driver

@dataclasses.dataclass
class LinkRun:
    """One launch: a link (a rate in the lab, or localhost) and what its ranks reported."""

    label: str
    rate_bits_per_s: Optional[int]
    launch: str
    result: Dict[str, Any]
    uptime_before: str
    uptime_after: str
    command: str = ""  # the harness command that made this run

    @property
    def heading(self) -> str:
        parts = [part for part, key in (("raw allreduce", "collectives"), ("training", "training"))
                 if key in self.result]
        return self.label if len(parts) == 2 else f"{self.label}: {' and '.join(parts)}"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "load average: %.2f, %.2f, %.2f" % os.getloadavg()


def _worker_argv(args: argparse.Namespace, out: Path, contenders: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "fusionring.bench", "--worker", "--out", str(out),
            "--mode", args.mode, "--contenders", ",".join(contenders),
            "--steps", str(args.steps), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
            "--hidden", str(args.hidden), "--depth", str(args.depth), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--momentum", str(args.momentum), "--seed", str(args.seed),
            "--collective-mib", str(args.collective_mib),
            "--collective-repeats", str(args.collective_repeats)] + [
            word for module in args.imports for word in ("--import", module)]


def _wait_for_free_lab(wait_s: float) -> None:
    from fusionring import cluster

    deadline = time.monotonic() + wait_s
    while True:
        busy = cluster.existing_namespaces()
        if not busy:
            return
        if time.monotonic() >= deadline:
            raise SystemExit(f"fusionring bench: the lab is up ({', '.join(busy)}), so another run is using "
                             f"it; wait for it (--wait-for-lab-s) or remove it with `scripts/cluster.sh down`")
        time.sleep(5)


def _launch(args: argparse.Namespace, rate: Optional[str], contenders: Sequence[str], command: str) -> LinkRun:
    from fusionring import cluster

    with tempfile.TemporaryDirectory(prefix="fusionring-bench-") as scratch:
        out = Path(scratch) / "result.json"
        argv = [sys.executable, "-m", "fusionring.launcher", "-np", str(args.np)]
        if rate is not None:
            argv += ["--cluster", str(args.np), "--rate", rate]
        if args.mpiexec:
            argv += ["--mpiexec", args.mpiexec]
        argv += _worker_argv(args, out, contenders)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                  else []))
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that namespaces have no hostnames
        if rate is not None:
            _wait_for_free_lab(args.wait_for_lab_s)
        label = rate or "localhost"
        print(f"fusionring bench: {label}: {args.np} ranks ...", flush=True)
        uptime_before = _uptime()
        child = subprocess.Popen(argv, env=env, cwd=str(REPO_ROOT))
        try:
            returncode = child.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            # fusionrun passes SIGTERM on to mpiexec and removes the lab; kill only if it does not
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise SystemExit(f"fusionring bench: the {label} run took longer than {args.timeout_s} s "
                             f"(--timeout-s); stopped it")
        if returncode != 0 or not out.exists():
            raise SystemExit(f"fusionring bench: the {label} run failed (exit {returncode})")
        result = json.loads(out.read_text())
    shown = ["fusionrun", "-np", str(args.np)] + (["--cluster", str(args.np), "--rate", rate] if rate else [])
    shown += ["python", "-m", "fusionring.bench", "--worker", "--out", "RESULT.json"]
    shown += _worker_argv(args, out, contenders)[6:]
    return LinkRun(label, cluster.parse_rate(rate) if rate else None, shlex.join(shown), result,
                   uptime_before, _uptime(), command)


# ----------------------------------------------------------------------------- summaries

def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def time_to_accuracy(history: Sequence[Dict[str, float]], target: float) -> Optional[Dict[str, float]]:
    """The first evaluation at or above ``target``: its step count and cumulative training seconds."""
    for point in history:
        if point["accuracy"] is not None and point["accuracy"] >= target:
            return {"steps": point["step"], "seconds": point["seconds"]}
    return None


def summarize_training(run: LinkRun, target: float) -> List[Dict[str, Any]]:
    """Per contender: medians over turns, samples/s, bytes, final accuracy, time to ``target``."""
    training = run.result["training"]
    size = run.result["ranks"]
    global_batch = run.result["model"]["batch_size"] * size
    rows = []
    for name, data in training["contenders"].items():
        turns = data["turns"]
        step_s = _median([t["step_seconds"] for t in turns])
        sent = _median([t["bytes_per_step"] for t in turns])
        wire = _median([t["wire_bytes_per_step"] for t in turns])
        on_link = wire if wire is not None else sent  # what the link carried, where it was measured
        rows.append({
            "name": name, "description": data["description"], "step_seconds": step_s,
            "step_seconds_min": min((t["step_seconds"] for t in turns), default=None),
            "step_seconds_max": max((t["step_seconds"] for t in turns), default=None),
            "samples_per_s": global_batch / step_s if step_s else None,
            "bytes_per_step": sent, "wire_bytes_per_step": wire,
            "link_seconds": on_link * 8 / run.rate_bits_per_s if run.rate_bits_per_s and on_link is not None
            else None,
            "final_accuracy": data["history"][-1]["accuracy"] if data["history"] else None,
            "steps": data["history"][-1]["step"] if data["history"] else 0,
            "tta": time_to_accuracy(data["history"], target),
        })
    return rows


def summarize_collectives(run: LinkRun) -> List[Dict[str, Any]]:
    """Per method: median and best time, algorithm and bus bandwidth, share of the link rate."""
    coll = run.result["collectives"]
    size, nbytes = run.result["ranks"], coll["bytes"]
    rows = []
    for name, data in coll["methods"].items():
        median = _median(data["seconds"])
        busbw = ring_bytes(nbytes, size) * 8 / median if median else None
        rows.append({
            "name": name, "description": data["description"], "seconds": median,
            "seconds_min": min(data["seconds"]) if data["seconds"] else None,
            "busbw_bits_per_s": busbw,
            "link_fraction": busbw / run.rate_bits_per_s if busbw and run.rate_bits_per_s else None,
            "wire_bytes": _median(data["wire_bytes"]),
        })
    return rows
