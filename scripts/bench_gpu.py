"""fusionring on one GPU: kernel throughput against the device's own copy, and whether a
training step with each compressor stays on the device. Writes ``docs/benchmarks/gpu.md``
and a plot beside it.

- **Kernels** (64 MiB of float32 by default): N:M 2:4 encode (select, pack the kept values,
  write the mask), N:M decode-and-add, and the GPU path's pack and unpack of a fused batch (a
  ResNet-like mix of tensor sizes into one buffer and back). Each is compared with a
  device-to-device copy of its input's bytes (``torch.Tensor.copy_``), so 1.0x means "as fast as
  moving the input once"; the issue's targets are >= 0.5x for the encode and >= 0.8x for the
  pack and unpack.
- **NCCL**: a world-size-1 ``hvd.allreduce`` of a CUDA tensor (the whole GPU path: the
  negotiation, the ready event, the NCCL stream, the finish event), against the same call
  staged through host memory (``FUSIONRING_NCCL=off`` in a second process).
- **Training step** (an MLP, 3 steps profiled after 3 warm-up steps) with each compressor:
  the host-device copies in ``torch.profiler``'s trace during the steps (``--traces DIR``
  keeps the traces). The batch is made on the GPU before the steps, so a step that stays on
  the device shows none.

    python scripts/bench_gpu.py --output docs/benchmarks/gpu.md

Needs a CUDA GPU, CuPy's NCCL binding (``pip install "fusionring[gpu]"``) and fusionring built
with the CUDA kernels (``FUSIONRING_CUDA=on``). Runs as one process: ``hvd.init()`` makes a
world of one.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"nm 2:4 encode": 0.5, "pack": 0.8, "unpack": 0.8}


def _timed(fn: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of `fn` on the current stream, by CUDA events, after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(mib: int, repeats: int) -> List[Dict]:
    """Each kernel's median ms and the copy's, for an input of `mib` MiB of float32."""
    import torch

    from fusionring.compression.nm_codec import NmCodec

    count = mib * (1 << 20) // 4
    x = torch.randn(count, device="cuda")
    copy_out = torch.empty_like(x)
    copy_ms = _timed(lambda: copy_out.copy_(x), repeats)
    rows = [{"kernel": "device copy", "bytes": count * 4, "ms": copy_ms, "copy_ms": copy_ms}]

    codec = NmCodec(2, 4)
    payload = torch.empty(codec.payload_bytes(count), dtype=torch.uint8, device="cuda")
    residual = torch.empty_like(x)
    rows.append({"kernel": "nm 2:4 encode", "bytes": count * 4, "copy_ms": copy_ms,
                 "ms": _timed(lambda: codec.encode(x, 0, payload, None), repeats)})
    rows.append({"kernel": "nm 2:4 encode + residual", "bytes": count * 4, "copy_ms": copy_ms,
                 "ms": _timed(lambda: codec.encode(x, 0, payload, residual), repeats)})
    acc = torch.zeros_like(x)
    rows.append({"kernel": "nm 2:4 decode-add", "bytes": count * 4, "copy_ms": copy_ms,
                 "ms": _timed(lambda: codec.decode_add(payload, acc), repeats)})

    # A fused batch as the GPU path packs it: many tensors of mixed sizes into one buffer.
    sizes, left, k = [], count, 0
    pattern = [1 << 20, 64, 1 << 18, 256, 1 << 16, 2 << 20, 1024]
    while left > 0:
        n = min(pattern[k % len(pattern)], left)
        sizes.append(n)
        left -= n
        k += 1
    parts = [torch.randn(n, device="cuda") for n in sizes]
    fused = torch.empty(count, device="cuda")
    rows.append({"kernel": "pack", "bytes": count * 4, "copy_ms": copy_ms, "tensors": len(parts),
                 "ms": _timed(lambda: torch.cat(parts, out=fused), repeats)})

    def unpack() -> None:
        for part, piece in zip(parts, torch.split(fused, sizes)):
            part.copy_(piece)

    rows.append({"kernel": "unpack", "bytes": count * 4, "copy_ms": copy_ms, "tensors": len(parts),
                 "ms": _timed(unpack, repeats)})
    return rows


def nccl_allreduce(mib: int, repeats: int) -> Dict:
    """World-size-1 hvd.allreduce of a CUDA tensor, median ms (host-timed: the whole call)."""
    import time

    import torch

    import fusionring.torch as hvd

    x = torch.randn(mib * (1 << 20) // 4, device="cuda")
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hvd.allreduce(x, op=hvd.Sum, name="bench.x")
        torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return {"mib": mib, "ms": statistics.median(times)}


def training(compressors: Dict[str, Callable[[], object]], steps: int = 3,
             traces: Optional[Path] = None) -> List[Dict]:
    """Host-device copies in a profiled training step with each compressor (each profile
    written to `traces` as a Chrome trace when given)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import fusionring.torch as hvd

    rows = []
    for label, make in compressors.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                    torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                    torch.nn.Linear(4096, 10)).cuda()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=[(f"{label}.{n}", p) for n, p in
                                                         model.named_parameters()],
                                       compression=make())
        x = torch.randn(64, 1024, device="cuda")
        y = torch.randint(0, 10, (64,), device="cuda")

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        copies = {"HtoD": 0, "DtoH": 0}
        for event in prof.events():
            name = event.name
            for kind in copies:
                if "Memcpy" in name and kind in name:
                    copies[kind] += 1
        row = {"compressor": label, "htod": copies["HtoD"] / steps,
               "dtoh": copies["DtoH"] / steps}
        if traces is not None:
            trace = traces / f"gpu-trace-{label}.json"
            prof.export_chrome_trace(str(trace))
            row["trace"] = trace.name
        rows.append(row)
    return rows


def _staged_allreduce(mib: int, repeats: int) -> Optional[float]:
    """The same allreduce through host memory, in a process of its own (FUSIONRING_NCCL=off)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import json, fusionring.torch as hvd;"
            f"hvd.init(); sys.path.insert(0, {str(ROOT / 'scripts')!r}); import bench_gpu;"
            f"print(json.dumps(bench_gpu.nccl_allreduce({mib}, {repeats})))")
    env = dict(os.environ, FUSIONRING_NCCL="off")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"]


def render(results: Dict, command: str, image: Optional[str]) -> str:
    """The report's markdown, from the measured `results` (see main())."""
    lines = ["# fusionring on one GPU", "",
             f"`{command}` on {results['device']} (torch {results['torch']}, NCCL "
             f"{results['nccl']}), {results['date']}.", ""]
    lines += ["## Kernels against a device copy of the same bytes", "",
              f"{results['mib']} MiB of float32; median of {results['repeats']} runs (CUDA events).",
              "", "| kernel | ms | GB/s of input | x copy | target |", "| --- | --- | --- | --- | --- |"]
    for row in results["kernels"]:
        ratio = row["copy_ms"] / row["ms"] if row["ms"] > 0 else float("nan")
        target = TARGETS.get(row["kernel"])
        verdict = "" if target is None else f">= {target}x: {'met' if ratio >= target else 'missed'}"
        name = row["kernel"] + (f" ({row['tensors']} tensors)" if "tensors" in row else "")
        lines.append(f"| {name} | {row['ms']:.3f} | {row['bytes'] / row['ms'] / 1e6:.0f} | "
                     f"{ratio:.2f} | {verdict} |")
    if image:
        lines += ["", f"![kernels]({image})"]
    nccl = results.get("allreduce")
    if nccl:
        staged = nccl.get("staged_ms")
        lines += ["", "## A world-size-1 allreduce", "",
                  f"`hvd.allreduce` of {nccl['mib']} MiB: {nccl['ms']:.3f} ms on the GPU path"
                  + (f", {staged:.3f} ms staged through host memory (`FUSIONRING_NCCL=off`)."
                     if staged is not None else ".")]
    if results.get("training"):
        lines += ["", "## Host-device copies in a training step", "",
                  "Per step, from torch.profiler's trace (3 profiled steps after 3 warm-ups).",
                  "", "| compressor | HtoD copies | DtoH copies | trace |",
                  "| --- | --- | --- | --- |"]
        for row in results["training"]:
            lines.append(f"| {row['compressor']} | {row['htod']:g} | {row['dtoh']:g} | "
                         f"{row.get('trace', '-')} |")
    return "\n".join(lines) + "\n"


def plot(results: Dict, path: Path) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in results["kernels"] if r["kernel"] != "device copy"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["kernel"] for r in rows], [r["copy_ms"] / r["ms"] for r in rows])
    ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("throughput / device copy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=str(ROOT / "docs" / "benchmarks" / "gpu.md"))
    parser.add_argument("--traces", default=None,
                        help="folder for the training steps' Chrome traces (none by default)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    import fusionring.torch as hvd

    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False here)")
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    results: Dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "nccl": hvd.nccl_built(), "mib": args.mib, "repeats": args.repeats,
                     "date": datetime.date.today().isoformat()}
    results["kernels"] = kernels(args.mib, args.repeats)
    results["allreduce"] = nccl_allreduce(args.mib, args.repeats)
    results["allreduce"]["staged_ms"] = _staged_allreduce(args.mib, args.repeats)
    results["training"] = training({
        "none": lambda: hvd.Compression.none,
        "fp16": lambda: hvd.Compression.fp16,
        "nm-per-rank": lambda: hvd.Compression.nm(n=2, m=4, shared_mask=False),
        "nm-shared-mask": lambda: hvd.Compression.nm(n=2, m=4),
        "cluster": lambda: hvd.Compression.cluster(),
    }, traces=Path(args.traces) if args.traces else None)
    output = Path(args.output)
    image = plot(results, output.with_suffix(".png"))
    command = "python scripts/bench_gpu.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    output.write_text(render(results, command, image))
    output.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(output.read_text())
    hvd.shutdown()


if __name__ == "__main__":
    main()
