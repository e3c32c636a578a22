"""Adasum: what the tree combination costs against a plain sum, per dtype.

One ``mpiexec`` run per rank count (a power of two) times, on tensors of one element count,
interleaved round by round (the order rotates every round):

* ``Adasum <dtype>``: ``hvd.allreduce_(t, op=hvd.Adasum)`` on a float32, float16 or bfloat16
  tensor;
* ``Sum <dtype>``: ``hvd.allreduce_(t, op=hvd.Sum)`` on the same tensor (the ring);
* ``MPI float32``: mpi4py's in-place ``Allreduce`` (sum) on as many float32 values, the peer
  every fusionring row is compared with.

Adasum is fusionring's and Horovod's; MPI and torch.distributed have no such operation, so the
peer is MPI's sum of the same element count. Each sample is the slowest rank's mean time over a
few back-to-back operations after one untimed one; tables give the median over the rounds.

    python scripts/bench_adasum.py --ranks 2,4     # writes docs/benchmarks/adasum.md + .png
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

from fusionring.bench.util import (add_run_options, bar_plot, finish_run, start_run, DOCS_DIR,
                                   BenchDoc, format_ratio, format_seconds, interleaved,
                                   launch_under_mpiexec, load_average, print_table, ratio,
                                   summarize, write_result)  # noqa: E402

MPI_NAME = "MPI float32"
DTYPES = ("float32", "float16", "bfloat16")


def contender_names(dtypes: List[str]) -> List[str]:
    return [f"{op} {d}" for d in dtypes for op in ("Adasum", "Sum")] + [MPI_NAME]


# --------------------------------------------------------------------------------------------
# Worker (one process per rank, under mpiexec)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    import fusionring.torch as hvd

    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.elements
    rng = np.random.default_rng(rank)
    tensors = {d: torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(getattr(torch, d))
               for d in args.dtypes.split(",")}
    mpi_buf = rng.standard_normal(n).astype(np.float32)

    def fusionring_op(op, dtype: str) -> Callable[[], None]:
        tensor = tensors[dtype]
        return lambda: hvd.allreduce_(tensor, op=op, name=f"bench.{dtype}")

    ops: Dict[str, Callable[[], None]] = {}
    for dtype in tensors:
        ops[f"Adasum {dtype}"] = fusionring_op(hvd.Adasum, dtype)
        ops[f"Sum {dtype}"] = fusionring_op(hvd.Sum, dtype)
    ops[MPI_NAME] = lambda: comm.Allreduce(MPI.IN_PLACE, mpi_buf, op=MPI.SUM)

    def timed(op: Callable[[], None]) -> Callable[[], float]:
        def sample() -> float:
            op()  # untimed
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.iterations):
                op()
            return comm.allreduce((time.perf_counter() - start) / args.iterations, op=MPI.MAX)
        return sample

    # The operations overwrite their inputs: keep the values bounded between samples.
    def rescale() -> None:
        for t in tensors.values():
            t.copy_(t / max(float(t.float().abs().max()), 1e-30))
        mpi_buf[:] = mpi_buf / max(float(np.abs(mpi_buf).max()), 1e-30)

    started = time.perf_counter()
    samples = interleaved({name: timed(op) for name, op in ops.items()}, args.repeats,
                          between=rescale)
    if rank == 0:
        print(f"[{size} ranks] {args.repeats} rounds in {time.perf_counter() - started:.0f} s",
              flush=True)
        write_result({"ranks": size, "elements": n, "samples": samples, "load": load_average()})
    hvd.shutdown()


# --------------------------------------------------------------------------------------------
# Launcher and report


def medians(result: dict) -> Dict[str, float]:
    return {name: summarize(values).median for name, values in result["samples"].items()}


def rows(result: dict) -> List[List[str]]:
    med = medians(result)
    out = []
    for name, values in result["samples"].items():
        s = summarize(values)
        dtype = name.split()[-1]
        out.append([name, format_seconds(s.median),
                    f"{format_seconds(s.p25)}-{format_seconds(s.p75)}",
                    format_ratio(ratio(s.median, med[MPI_NAME])),
                    format_ratio(ratio(s.median, med.get(f"Sum {dtype}")))
                    if name.startswith("Adasum") else "",
                    format_ratio(ratio(s.median, med.get("Adasum float32")))
                    if name.startswith("Adasum") else ""])
    return out


HEADERS = ["contender", "time (median)", "IQR", "time / MPI float32 sum", "time / Sum, same dtype",
           "time / Adasum float32"]


def findings(results: List[dict]) -> List[str]:
    lines = []
    for result in results:
        med = medians(result)
        for dtype in DTYPES[1:]:
            if f"Adasum {dtype}" in med:
                lines.append(f"{result['ranks']} ranks: Adasum {dtype} takes "
                             f"{format_ratio(ratio(med[f'Adasum {dtype}'], med['Adasum float32']))}"
                             f" the time of Adasum float32")
    return lines


def plot(results: List[dict], path: str) -> None:
    panels = []
    for result in results:
        med = medians(result)
        names = list(med)
        panels.append({
            "title": f"{result['elements']:,} elements, {result['ranks']} ranks",
            "ylabel": "time per allreduce (ms)", "groups": names,
            "series": {"median": [med[n] * 1e3 for n in names]},
        })
    bar_plot(path, panels)


def write_doc(run, path: str, png: str) -> None:
    doc = BenchDoc("Adasum against a plain sum, per dtype", command=run.command)
    # The module's description, without its title line and usage, in markdown's backticks.
    doc.paragraph(__doc__.split("\n\n    python")[0].split("\n\n", 1)[1].replace("``", "`"))
    doc.bullets(findings(run.results))
    for result in run.results:
        doc.heading(f"{result['ranks']} ranks, {result['elements']:,} elements")
        doc.table(HEADERS, rows(result))
    doc.image(png, "median time per allreduce")
    doc.keep_section(path, "Findings")
    doc.heading("Conditions")
    doc.conditions(run.machine, run.loads)
    doc.write(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4", help="comma-separated powers of two")
    parser.add_argument("--elements", type=int, default=11_000_000)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--iterations", type=int, default=3, help="operations per sample")
    add_run_options(parser, os.path.join(DOCS_DIR, "adasum.md"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    run = start_run(args)
    if not args.from_results:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            run.results.append(launch_under_mpiexec(
                os.path.abspath(__file__), ranks,
                ["--worker", "--elements", str(args.elements), "--dtypes", args.dtypes,
                 "--repeats", str(args.repeats), "--iterations", str(args.iterations)],
                timeout_s=args.timeout_s))
        run.loads.append(("after", load_average()))
    for result in run.results:
        print(f"\n== {result['ranks']} ranks, {result['elements']:,} elements")
        print_table(HEADERS, rows(result))
    finish_run(run, args, findings, plot,
               lambda png: write_doc(run, args.doc, png))


if __name__ == "__main__":
    main()
