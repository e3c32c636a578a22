"""Single-thread throughput of the N:M kernels against memcpy of the same input bytes.

    python scripts/bench_nm.py            # writes docs/benchmarks/nm.md (throughput section)
                                          # and docs/benchmarks/nm.png

Encode = select N of every M + pack values + mask (csrc/nm_sparse.cc, nm_compress); decode =
unpack to a dense float32 buffer (nm_scatter); decode+add = the fused unpack-accumulate of the
compressed reduce-scatter. Every rate is input (dense float32) bytes per second. memcpy and the
kernel are timed back to back in each repetition and the ratio is the median of the per-
repetition ratios, which stays steady on a shared, noisy machine where absolute rates do not.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fusionring import _C

ROOT = Path(__file__).resolve().parents[1]
CODES = {"float32": 0, "float16": 2, "bfloat16": 3}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def numpy_encode(x: np.ndarray, n: int, m: int):
    """A plain vectorised numpy N:M encoder, for scale (the kernels' rule, lower index on ties)."""
    groups = x.reshape(-1, m)
    keys = (groups.view(np.uint32) & 0x7FFFFFFF).astype(np.int64)
    order = np.argsort(-keys, axis=1, kind="stable")[:, :n]
    keep = np.zeros(groups.shape, dtype=bool)
    np.put_along_axis(keep, order, True, axis=1)
    return groups[keep], np.packbits(keep.reshape(-1), bitorder="little")


def measure(count: int, n: int, m: int, values: str, repeats: int) -> dict:
    x = torch.randn(count)
    y = torch.empty(count)
    kept = torch.empty(_C.nm_kept_count(count, n, m), dtype=TORCH[values])
    mask = torch.empty(_C.nm_mask_words(count), dtype=torch.int64)
    code = CODES[values]
    copy = lambda: _C.pack([x.data_ptr()], [count * 4], y.data_ptr())  # noqa: E731 - memcpy
    encode = lambda: _C.nm_compress(x.data_ptr(), 0, count, n, m, kept.data_ptr(), code,  # noqa
                                    mask.data_ptr(), 0)
    decode = lambda: _C.nm_scatter(kept.data_ptr(), code, mask.data_ptr(), count,  # noqa: E731
                                   y.data_ptr(), 0)
    decode_add = lambda: _C.nm_scatter_add(kept.data_ptr(), code, mask.data_ptr(), count,  # noqa
                                           y.data_ptr())
    for fn in (copy, encode, decode, decode_add):  # warm caches and pages
        fn()
    rows = {"memcpy": [], "encode": [], "decode": [], "decode+add": []}
    ratios = {"encode": [], "decode": [], "decode+add": []}
    for _ in range(repeats):
        t_copy = timed(copy)
        rows["memcpy"].append(t_copy)
        for label, fn in (("encode", encode), ("decode", decode), ("decode+add", decode_add)):
            t = timed(fn)
            rows[label].append(t)
            ratios[label].append(t_copy / t)
    nbytes = count * 4
    out = {f"{k}_gbs": nbytes / statistics.median(v) / 1e9 for k, v in rows.items()}
    out.update({f"{k}_ratio": statistics.median(v) for k, v in ratios.items()})
    return out


def write_section(path: Path, name: str, text: str) -> None:
    """Replace (or append) the part of `path` between this section's markers."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else "# N:M sparsification: measurements\n\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip() + "\n\n" + block
    path.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1048576,16777216", help="elements, comma separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "nm.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    configs = [(2, 4, "float32"), (2, 4, "float16"), (2, 4, "bfloat16"), (1, 4, "float32"),
               (1, 2, "float32"), (2, 8, "float32"), (4, 8, "float32"), (1, 8, "float32"),
               (4, 16, "float32"), (8, 32, "float32"), (2, 3, "float32")]
    results = []
    for count in sizes:
        for n, m, values in configs:
            r = measure(count, n, m, values, args.repeats)
            r.update(count=count, n=n, m=m, values=values)
            results.append(r)
            print(f"{count:>9} {n}:{m} {values:<8} memcpy {r['memcpy_gbs']:6.2f} GB/s  "
                  f"encode {r['encode_gbs']:6.2f} ({r['encode_ratio']:.2f}x)  "
                  f"decode {r['decode_gbs']:6.2f} ({r['decode_ratio']:.2f}x)  "
                  f"decode+add {r['decode+add_gbs']:6.2f} ({r['decode+add_ratio']:.2f}x)",
                  flush=True)
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    t_np = statistics.median(timed(lambda: numpy_encode(x, 2, 4)) for _ in range(3))
    numpy_gbs = x.nbytes / t_np / 1e9
    print(f"numpy 2:4 encode of 1M floats: {numpy_gbs:.3f} GB/s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = out.with_suffix(".png")
    _plot(results, sizes, plot)
    command = "python scripts/bench_nm.py" + ("" if args.sizes == parser.get_default("sizes")
                                              else f" --sizes {args.sizes}")
    lines = [
        "## Kernel throughput (single thread)",
        "",
        f"Command: `{command}` (repeats={args.repeats}). Machine: "
        f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, vector kernels "
        f"{['portable loops', 'AVX2', 'AVX-512'][_C.nm_vector_level_available()]}. "
        "Rates are dense float32 input bytes per "
        "second; x = the kernel's rate over memcpy of the same bytes, timed back to back "
        "(median of per-repetition ratios). Encode = select + pack values + mask, no residual.",
        "",
        "| elements | N:M | values | memcpy GB/s | encode GB/s | encode / memcpy | "
        "decode GB/s | decode / memcpy | decode+add GB/s | decode+add / memcpy |",
        "|---:|:-:|:-:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['count']:,} | {r['n']}:{r['m']} | {r['values']} | "
                     f"{r['memcpy_gbs']:.2f} | {r['encode_gbs']:.2f} | {r['encode_ratio']:.2f}x | "
                     f"{r['decode_gbs']:.2f} | {r['decode_ratio']:.2f}x | "
                     f"{r['decode+add_gbs']:.2f} | {r['decode+add_ratio']:.2f}x |")
    for count in sizes:
        r = next(x for x in results if x["count"] == count and (x["n"], x["m"], x["values"])
                 == (2, 4, "float32"))
        lines.append("")
        lines.append(f"{count * 4 / 2**20:.0f} MiB: memcpy {r['memcpy_gbs']:.1f} GB/s; 2:4 float32 "
                     f"encode {r['encode_gbs']:.1f} GB/s = {r['encode_ratio']:.2f}x memcpy "
                     f"(target 0.5x), decode {r['decode_gbs']:.1f} GB/s.")
    lines += ["", "Group sizes that are not a power of two (2:3 here) run the portable loops.",
              "", f"A vectorised numpy encoder (argsort per group) does 2:4 on 1M floats at "
              f"{numpy_gbs:.3f} GB/s.", "", f"![N:M kernel throughput]({plot.name})", ""]
    write_section(out, "throughput", "\n".join(lines))
    print(f"wrote {out} and {plot}")


def _plot(results, sizes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, count in zip(axes[0], sizes):
        rows = [r for r in results if r["count"] == count]
        labels = [f"{r['n']}:{r['m']}\n{r['values'].replace('float', 'f')}" for r in rows]
        pos = np.arange(len(rows))
        for k, (key, label) in enumerate([("encode_ratio", "encode"), ("decode_ratio", "decode"),
                                          ("decode+add_ratio", "decode+add")]):
            ax.bar(pos + (k - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
        ax.axhline(0.5, color="k", ls="--", lw=1, label="0.5x memcpy target (encode)")
        ax.axhline(1.0, color="grey", ls=":", lw=1)
        ax.set_xticks(pos)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("throughput / memcpy of the same bytes")
        ax.set_title(f"{count:,} float32 ({count * 4 / 2**20:.0f} MiB), one thread")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
