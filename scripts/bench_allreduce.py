"""Allreduce bandwidth and latency: fusionring against MPI and torch.distributed (gloo).

One ``mpiexec`` run per rank count measures, on the same float32 buffer, interleaved round by
round (the order rotates every round):

* ``MPI``: mpi4py's in-place ``Allreduce`` on a numpy array (MPICH's own algorithm choice);
* ``core``: fusionring's C++ core, ``_C.Communicator.allreduce`` on the same buffer (same footing
  as MPI: no Python loop, no negotiation);
* ``core shm``: the core's shared-memory allreduce, ``_C.SharedMemoryAllreduce.allreduce``
  (every rank on one host: each copies its buffer into a shared window once, reduces its
  1/N there and copies the result out; the runtime uses it when ranks have a core each);
* ``hvd``: the user API, ``hvd.allreduce_(tensor, op=hvd.Sum)``, which goes through the
  background loop (negotiation every cycle, scheduling, then the core);
* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend (env:// rendezvous on
  127.0.0.1).

The fusionring runtime is started only for the ``hvd`` samples and shut down afterwards: its
background loop negotiates every cycle even when idle, which would otherwise take CPU from the
other contenders on a small machine. Each sample is the slowest rank's median time over a few
back-to-back operations (more for small messages; the median of their durations), after one
untimed operation; the table shows the median over the rounds. algbw = bytes / time;
busbw = algbw * 2(N-1)/N (the bytes each rank sends and receives in a bandwidth-optimal allreduce).

    python scripts/bench_allreduce.py --ranks 2,4     # writes docs/benchmarks/allreduce.md + .png
    python scripts/bench_allreduce.py --ranks 4 --sizes 64MiB --skip-hvd --skip-gloo \
        --core-segment-bytes 256KiB,1MiB,4MiB --no-doc          # ring segment size sweep
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

from fusionring.bench.util import (add_run_options, finish_run, start_run, DOCS_DIR, KIB, MIB,
                                   BenchDoc, format_bytes, format_ratio, format_seconds, free_port,
                                   launch_under_mpiexec, line_plot, load_average, parse_sizes,
                                   print_table, ratio, Run, summarize, write_result)  # noqa: E402

MPI_NAME, CORE_NAME, HVD_NAME, GLOO_NAME = "MPI", "core", "hvd", "gloo"
SHM_NAME = CORE_NAME + " shm"

# Targets (4 ranks): bandwidth ratios at 64 MiB and the latency ratio at 4 KiB.
TARGET_RANKS = 4
TARGET_LARGE_BYTES = 64 * MIB
TARGET_SMALL_BYTES = 4 * KIB


# --------------------------------------------------------------------------------------------
# Worker (one process per rank, under mpiexec)


def inner_iterations(nbytes: int) -> int:
    """Back-to-back operations per sample: enough that a sample is not one timer tick."""
    return int(min(32, max(1, (1 * MIB) // max(nbytes, 1))))


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import fusionring.torch as hvd
    from fusionring import _C
    from fusionring import config as fr_config

    torch.set_num_threads(1)  # ranks share the cores; no contender gets intra-op threads
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(size)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size)

    sizes = parse_sizes(args.sizes)
    config = fr_config.settings()
    segments = (parse_sizes(args.core_segment_bytes) if args.core_segment_bytes
                else [config.ring_segment_bytes])
    buf = np.ones(max(sizes) // 4, dtype=np.float32)  # one buffer for every contender
    tensor = torch.from_numpy(buf)
    core = _C.Communicator(MPI._handleof(comm.Dup()))

    def timed(op: Callable[[int], None], nbytes: int) -> float:
        """Slowest rank's median seconds per op over inner_iterations back-to-back ops.

        One untimed op first. The median (not the mean) of the back-to-back ops keeps a single
        descheduled rank from colouring the whole sample on an oversubscribed machine."""
        n = nbytes // 4
        buf[:n] = 1.0
        op(n)
        iterations = inner_iterations(nbytes)
        durations = []
        comm.Barrier()
        last = time.perf_counter()
        for _ in range(iterations):
            op(n)
            now = time.perf_counter()
            durations.append(now - last)
            last = now
        return comm.allreduce(float(np.median(durations)), op=MPI.MAX)

    def mpi_op(n: int) -> None:
        comm.Allreduce(MPI.IN_PLACE, buf[:n], op=MPI.SUM)

    def core_op(segment: int) -> Callable[[int], None]:
        def op(n: int) -> None:
            core.allreduce(buf.ctypes.data, n, 0, 0, 1.0, 1.0, segment,
                           config.small_message_bytes, "auto")
        return op

    def hvd_op(n: int) -> None:
        hvd.allreduce_(tensor[:n], op=hvd.Sum, name=f"bench.{n}")

    def gloo_op(n: int) -> None:
        dist.all_reduce(tensor[:n])

    contenders: Dict[str, Callable[[int], None]] = {MPI_NAME: mpi_op}
    for seg in segments:
        name = CORE_NAME if len(segments) == 1 else f"{CORE_NAME} seg {format_bytes(seg)}"
        contenders[name] = core_op(seg)
    if not args.skip_shm and size > 1:
        shm = _C.SharedMemoryAllreduce(MPI._handleof(comm.Dup()), config.shm_slot_bytes)
        contenders[SHM_NAME] = lambda n: shm.allreduce([buf.ctypes.data], [4 * n], 0, 0)
    hvd_cycles: Dict[str, Optional[float]] = {}
    if not args.skip_hvd:
        cycles = [float(c) for c in args.hvd_cycle_ms.split(",")] if args.hvd_cycle_ms else [None]
        for i, cycle in enumerate(cycles):
            name = HVD_NAME if i == 0 else f"{HVD_NAME} cycle {cycle:g} ms"
            contenders[name] = hvd_op
            hvd_cycles[name] = cycle

    def start_runtime(name: str) -> None:
        """Start the fusionring runtime with this contender's cycle time."""
        if hvd_cycles[name] is not None:
            os.environ["FUSIONRING_CYCLE_TIME_MS"] = repr(hvd_cycles[name])
        else:
            os.environ.pop("FUSIONRING_CYCLE_TIME_MS", None)
            if base_cycle is not None:
                os.environ["FUSIONRING_CYCLE_TIME_MS"] = base_cycle
        fr_config.settings(reload=True)
        hvd.init()

    base_cycle = os.environ.get("FUSIONRING_CYCLE_TIME_MS")
    if not args.skip_gloo:
        contenders[GLOO_NAME] = gloo_op

    # Correctness first: every contender must produce the sum on every rank.
    for name, op in contenders.items():
        if name in hvd_cycles:
            start_runtime(name)
        n = min(sizes[0], 4 * MIB) // 4
        buf[:n] = rank + 1
        op(n)
        expected = size * (size + 1) / 2
        if not np.allclose(buf[:n], expected):
            raise SystemExit(f"{name} gave a wrong sum on rank {rank}: {buf[:4]} != {expected}")
        if name in hvd_cycles:
            hvd.shutdown()

    samples: Dict[str, Dict[int, List[float]]] = {c: {s: [] for s in sizes} for c in contenders}
    names = list(contenders)
    started = time.perf_counter()
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if name in hvd_cycles:
                start_runtime(name)
            for nbytes in sizes:
                samples[name][nbytes].append(timed(contenders[name], nbytes))
            if name in hvd_cycles:
                hvd.shutdown()
        if rank == 0:
            print(f"[{size} ranks] round {r + 1}/{args.repeats} done after "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        write_result({"ranks": size, "sizes": sizes, "samples": samples,
                      "segment_bytes": segments, "load": load_average(),
                      "small_message_bytes": config.small_message_bytes,
                      "cycle_time_ms": config.cycle_time_ms})


# --------------------------------------------------------------------------------------------
# Launcher and report


def bus_factor(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks


def medians(result: dict) -> Dict[str, Dict[int, float]]:
    """contender -> size -> median seconds (JSON keys back to ints)."""
    return {c: {int(s): summarize(v).median for s, v in per.items()}
            for c, per in result["samples"].items()}


def noise(result: dict) -> Dict[str, Dict[int, float]]:
    return {c: {int(s): summarize(v).iqr_fraction for s, v in per.items()}
            for c, per in result["samples"].items()}


def fusionring_contenders(names) -> List[str]:
    return [c for c in names if c.startswith(CORE_NAME) or c.startswith(HVD_NAME)]


def time_table(result: dict):
    """Rows: size, then each contender's median time and bus bandwidth."""
    med = medians(result)
    n = result["ranks"]
    headers = ["size"] + [f"{c}: time (busbw GB/s)" for c in med]
    rows = []
    for s in result["sizes"]:
        rows.append([format_bytes(s)] + [
            f"{format_seconds(med[c][s])} ({s / med[c][s] * bus_factor(n) / 1e9:.2f})"
            for c in med])
    return headers, rows


def ratio_table(result: dict):
    """Rows: size, then speed ratios (other's time / fusionring's time; > 1: fusionring faster)."""
    med = medians(result)
    fr = fusionring_contenders(med)
    others = [c for c in (MPI_NAME, GLOO_NAME) if c in med]
    headers = ["size"] + [f"{c} vs {o}" for o in others for c in fr]
    rows = []
    for s in result["sizes"]:
        rows.append([format_bytes(s)] + [format_ratio(ratio(med[o][s], med[c][s]))
                                         for o in others for c in fr])
    return headers, rows


def targets(results: List[dict]) -> List[str]:
    """Whether the targets hold, one line each (only with a TARGET_RANKS run)."""
    result = next((r for r in results if r["ranks"] == TARGET_RANKS), None)
    if result is None:
        return []
    med = medians(result)
    lines = []
    fr = fusionring_contenders(med)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    for c in fr:
        if TARGET_LARGE_BYTES in med[c]:
            vs_mpi = ratio(med[MPI_NAME][TARGET_LARGE_BYTES], med[c][TARGET_LARGE_BYTES])
            lines.append(f"{c}, 64 MiB, 4 ranks: {format_ratio(vs_mpi)} MPI's bandwidth "
                         f"(target >= 1.0x): {verdict(vs_mpi >= 1.0)}")
            if GLOO_NAME in med:
                vs_gloo = ratio(med[GLOO_NAME][TARGET_LARGE_BYTES], med[c][TARGET_LARGE_BYTES])
                lines.append(f"{c}, 64 MiB, 4 ranks: {format_ratio(vs_gloo)} gloo's bandwidth "
                             f"(target >= 2.0x): {verdict(vs_gloo >= 2.0)}")
        # The runtime sends messages at or below the small-message size through recursive
        # doubling, never through the shared window: no latency target for it.
        if TARGET_SMALL_BYTES in med[c] and c != SHM_NAME:
            lat = ratio(med[c][TARGET_SMALL_BYTES], med[MPI_NAME][TARGET_SMALL_BYTES])
            lines.append(f"{c}, 4 KiB, 4 ranks: latency "
                         f"{format_seconds(med[c][TARGET_SMALL_BYTES])} = {format_ratio(lat)} MPI's "
                         f"{format_seconds(med[MPI_NAME][TARGET_SMALL_BYTES])} (target <= 1.5x): "
                         f"{verdict(lat <= 1.5)}")
    return lines


def plot(results: List[dict], path: str) -> None:
    panels = []
    for result in results:
        med = medians(result)
        n = result["ranks"]
        sizes = result["sizes"]
        panels.append({
            "title": f"bus bandwidth, {n} ranks (median of {args_repeats(result)})",
            "xlabel": "message size", "ylabel": "busbw (GB/s)", "logx": True,
            "xticks": sizes, "xticklabels": [format_bytes(s) for s in sizes],
            "series": {c: (sizes, [s / med[c][s] * bus_factor(n) / 1e9 for s in sizes])
                       for c in med},
        })
    for result in results:
        med = medians(result)
        sizes = [s for s in result["sizes"] if s <= 1 * MIB]
        if not sizes:
            continue
        panels.append({
            "title": f"latency, {result['ranks']} ranks", "xlabel": "message size",
            "ylabel": "time per allreduce (us)", "logx": True, "logy": True,
            "xticks": sizes, "xticklabels": [format_bytes(s) for s in sizes],
            "series": {c: (sizes, [med[c][s] * 1e6 for s in sizes]) for c in med},
        })
    line_plot(path, panels, ncols=len(results))


def args_repeats(result: dict) -> int:
    first = next(iter(result["samples"].values()))
    return len(next(iter(first.values())))


def write_doc(run: Run, doc_path: str, png_name: str) -> None:
    results, command = run.results, run.command
    doc = BenchDoc("Allreduce: fusionring vs MPI vs torch.distributed (gloo)", command=command)
    doc.paragraph(
        "float32 sum, in place. Contenders: **MPI** = mpi4py `Allreduce(MPI.IN_PLACE, ...)` on a "
        "numpy array; **core** = fusionring's C++ ring (recursive doubling at or below "
        f"{format_bytes(results[0]['small_message_bytes'])}) called directly through "
        "`_C.Communicator.allreduce` on the same array; **core shm** = the core's shared-memory "
        "allreduce (`_C.SharedMemoryAllreduce`: one copy into a shared window, each rank "
        "reduces 1/N in place, one copy out; waits sleep on a futex); **hvd** = the user API "
        "`hvd.allreduce_(tensor, op=hvd.Sum)`, which also pays the background loop "
        f"(negotiation, cycle time {results[0]['cycle_time_ms']:g} ms); **gloo** = "
        "`torch.distributed.all_reduce` with the gloo backend. All share one buffer and "
        "run in one `mpiexec` launch per rank count, interleaved round by round with the order "
        "rotated each round. Each sample is the slowest rank's median over 1-32 back-to-back "
        "operations (after one untimed one); tables give the median of the samples over rounds. "
        "busbw = bytes/time * 2(N-1)/N. Ratios are speed ratios: > 1 means fusionring is faster.")
    doc.paragraph(
        "The fusionring runtime is started only around the hvd samples: its background loop "
        "keeps negotiating (and waiting in MPI) while idle, which would otherwise take CPU from "
        "the other contenders on this 2-core machine.")
    lines = []
    for result in results:
        lines += targets([result])
    if lines:
        doc.heading("Targets (4 ranks)")
        doc.bullets(lines)
    for result in results:
        doc.heading(f"{result['ranks']} ranks")
        doc.table(*time_table(result))
        doc.paragraph("Speed ratios (> 1: fusionring faster):")
        doc.table(*ratio_table(result))
        spread = sorted(v for per in noise(result).values() for v in per.values())
        doc.paragraph(f"Median of {args_repeats(result)} rounds. Interquartile range over median, "
                      f"across all cells: median {spread[len(spread) // 2] * 100:.0f} %, "
                      f"largest {spread[-1] * 100:.0f} %.")
    doc.image(png_name, "bus bandwidth and latency against message size")
    doc.keep_section(doc_path, "Findings")
    doc.heading("Conditions")
    doc.conditions(run.machine, run.loads)
    doc.paragraph(
        "2 cores shared by all ranks (4 ranks oversubscribe them), and other jobs ran on the "
        "machine at the same time, so absolute numbers are noisy; the interleaving makes the "
        "ratios the robust part.")
    doc.write(doc_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="rank counts, e.g. 2,4")
    parser.add_argument("--sizes", default="4KiB:256MiB:4",
                        help="bytes: LO:HI:FACTOR or a comma list (units B, KiB, MiB)")
    parser.add_argument("--repeats", type=int, default=8, help="rounds (median over them)")
    parser.add_argument("--core-segment-bytes", default="",
                        help="comma list: one core contender per ring segment size "
                             "(default: FUSIONRING_RING_SEGMENT_BYTES)")
    parser.add_argument("--skip-hvd", action="store_true", help="leave out the user API")
    parser.add_argument("--hvd-cycle-ms", default="",
                        help="comma list: one user-API contender per cycle time; the first is "
                             "'hvd' (default: FUSIONRING_CYCLE_TIME_MS)")
    parser.add_argument("--skip-gloo", action="store_true", help="leave out torch.distributed")
    parser.add_argument("--skip-shm", action="store_true",
                        help="leave out the core's shared-memory allreduce")
    add_run_options(parser, os.path.join(DOCS_DIR, "allreduce.md"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    run = start_run(args)
    if not args.from_results:
        loads = run.loads
        forwarded = ["--worker", "--sizes", args.sizes, "--repeats", str(args.repeats)]
        if args.core_segment_bytes:
            forwarded += ["--core-segment-bytes", args.core_segment_bytes]
        forwarded += ["--skip-hvd"] if args.skip_hvd else []
        forwarded += ["--hvd-cycle-ms", args.hvd_cycle_ms] if args.hvd_cycle_ms else []
        forwarded += ["--skip-gloo"] if args.skip_gloo else []
        forwarded += ["--skip-shm"] if args.skip_shm else []
        results = run.results
        for n in [int(x) for x in args.ranks.split(",")]:
            result = launch_under_mpiexec(os.path.abspath(__file__), n, forwarded,
                                          env={"MASTER_ADDR": "127.0.0.1",
                                               "MASTER_PORT": str(free_port())},
                                          timeout_s=args.timeout_s)
            loads.append((f"after the {n}-rank run", result["load"]))
            results.append(result)
            print(f"\n== {n} ranks (median of {args.repeats})")
            print_table(*time_table(result))
            print_table(*ratio_table(result))
    finish_run(run, args, targets, plot, lambda png: write_doc(run, args.doc, png))


if __name__ == "__main__":
    main()
