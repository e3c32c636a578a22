"""Cluster-and-hash quantization: kernel throughput, bits per element and reconstruction error.

    python scripts/bench_cluster.py                  # writes the throughput and reconstruction
                                                     # sections of docs/benchmarks/cluster-quant.md
    python scripts/bench_cluster.py --only throughput

Throughput: one thread, encode / decode / decode+add of float32 blocks against memcpy of the same
bytes, timed back to back in every round (the ratio is the median of per-round ratios, which
stays steady on a shared machine where absolute rates do not). Reconstruction: gradients
captured from training the digits MLP and a small conv net (plain SGD, one process, several
steps), each quantized as one block, against uniform stochastic quantization with a per-tensor
scale (QSGD-style) at the same bits, plain K-means (one bucket per cluster), the same buckets
shared evenly instead of by score, and fp16 / 2:4.
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
import torch.nn as nn

from fusionring import _C
from fusionring.compression import cluster as clusterlib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_nm import write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks" / "cluster-quant.md"
TITLE = "# Cluster-and-hash quantization: measurements\n\n"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- kernels on arrays
def encode(x: np.ndarray, k: int, buckets: int, sample: int = 4096, stream: int = 1,
           values: int = 0) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    payload = torch.zeros(_C.cluster_payload_bytes(t.numel(), k, sample, buckets, values),
                          dtype=torch.uint8)
    _C.cluster_encode(t.data_ptr(), t.numel(), k, sample, buckets, values, stream,
                      payload.data_ptr(), 0)
    return payload


def decode(payload: torch.Tensor, count: int, k: int, buckets: int, sample: int = 4096,
           values: int = 0) -> np.ndarray:
    out = torch.empty(count)
    _C.cluster_decode(payload.data_ptr(), count, k, sample, buckets, values, out.data_ptr(),
                      False)
    return out.numpy()


def ids_of(payload: torch.Tensor, count: int, k: int, buckets: int) -> np.ndarray:
    """The mapping table of a float32-means payload, unpacked."""
    bits = _C.cluster_id_bits(k)
    start = buckets * 4 + 2 * k
    raw = payload.numpy()[start:start + (count * bits + 7) // 8]
    stream = np.unpackbits(raw, bitorder="little")[:count * bits].reshape(count, bits)
    return (stream.astype(np.int64) << np.arange(bits)).sum(axis=1)


def even_buckets(x: np.ndarray, ids: np.ndarray, k: int, buckets: int) -> np.ndarray:
    """The same clusters and hash, with the buckets shared evenly instead of by score."""
    nb = np.full(k, buckets // k, np.int64)
    nb[:buckets % k] += 1
    off = np.concatenate([[0], np.cumsum(nb)[:-1]])
    h = (np.arange(x.size, dtype=np.uint64) * 0x9E3779B1) & 0xFFFFFFFF
    bucket = off[ids] + (((h >> 16) * nb[ids].astype(np.uint64)) >> 16).astype(np.int64)
    sums = np.bincount(bucket, weights=x.astype(np.float64), minlength=buckets)
    counts = np.bincount(bucket, minlength=buckets)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0).astype(np.float32)
    return means[bucket]


def qsgd(x: np.ndarray, bits: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform stochastic quantization, per-tensor scale max|x|: a sign bit and 2^(bits-1) - 1
    levels of magnitude (so `bits` per value), rounded up or down at random (unbiased)."""
    levels = 2 ** (bits - 1) - 1
    scale = float(np.abs(x).max()) or 1.0
    y = np.abs(x) / scale * levels
    low = np.floor(y)
    q = low + (rng.random(x.size) < (y - low))
    return (np.sign(x) * q / levels * scale).astype(np.float32)


def two_of_four_fp16(x: np.ndarray) -> np.ndarray:
    g = x[: x.size // 4 * 4].reshape(-1, 4)
    order = np.argsort(-np.abs(g), axis=1, kind="stable")[:, :2]
    keep = np.zeros(g.shape, bool)
    np.put_along_axis(keep, order, True, axis=1)
    out = np.where(keep, g.astype(np.float16).astype(np.float32), 0.0).reshape(-1)
    return np.concatenate([out, x[out.size:].astype(np.float16).astype(np.float32)])


# ---------------------------------------------------------------------- throughput
KERNELS = {2: "AVX-512", 1: "AVX2", 0: "portable"}


def throughput(sizes, ks, rounds: int) -> list:
    """Kernel rates over memcpy's, for each vector level the CPU has (widest first: the one
    the module picks by default)."""
    best = _C.cluster_set_vector_level(2)
    rows = []
    try:
        for level in range(best, 0, -1) if best else [0]:
            _C.cluster_set_vector_level(level)
            rows += _throughput(sizes, ks, rounds, KERNELS[level])
    finally:
        _C.cluster_set_vector_level(best)
    return rows


def _throughput(sizes, ks, rounds: int, kernels: str) -> list:
    rows = []
    rng = np.random.default_rng(0)
    for count in sizes:
        x = torch.from_numpy((rng.standard_t(3, count) * 1e-3).astype(np.float32))
        y = torch.empty(count)
        res = torch.empty(count)
        for k in ks:
            b = clusterlib.default_buckets(k)
            payload = torch.zeros(_C.cluster_payload_bytes(count, k, 4096, b, 0), dtype=torch.uint8)
            fns = {
                "memcpy": lambda: _C.pack([x.data_ptr()], [count * 4], y.data_ptr()),
                "encode": lambda: _C.cluster_encode(x.data_ptr(), count, k, 4096, b, 0, 1,
                                                    payload.data_ptr(), 0),
                "encode+residual": lambda: _C.cluster_encode(x.data_ptr(), count, k, 4096, b, 0,
                                                             1, payload.data_ptr(),
                                                             res.data_ptr()),
                "decode": lambda: _C.cluster_decode(payload.data_ptr(), count, k, 4096, b, 0,
                                                    y.data_ptr(), False),
                "decode+add": lambda: _C.cluster_decode(payload.data_ptr(), count, k, 4096, b, 0,
                                                        y.data_ptr(), True),
            }
            for fn in fns.values():
                fn()
            times = {name: [] for name in fns}
            ratios = {name: [] for name in fns if name != "memcpy"}
            for _ in range(rounds):
                t_copy = timed(fns["memcpy"])
                times["memcpy"].append(t_copy)
                for name, fn in fns.items():
                    if name != "memcpy":
                        t = timed(fn)
                        times[name].append(t)
                        ratios[name].append(t_copy / t)
            row = {"kernels": kernels, "count": count, "k": k, "buckets": b,
                   "bits": 8 * payload.numel() / count}
            row.update({f"{n}_gbs": count * 4 / statistics.median(v) / 1e9
                        for n, v in times.items()})
            row.update({f"{n}_ratio": statistics.median(v) for n, v in ratios.items()})
            rows.append(row)
            print(f"{kernels:>8} {count:>9} K={k:<3} {row['bits']:.4f} bits/elem  memcpy "
                  f"{row['memcpy_gbs']:.2f} GB/s  " + "  ".join(
                      f"{n} {row[n + '_gbs']:.2f} ({row[n + '_ratio']:.2f}x)" for n in ratios),
                  flush=True)
    return rows


# ---------------------------------------------------------------------- real gradients
def capture_gradients(steps: int) -> dict:
    """Flattened whole-model gradients of a few SGD steps on the digits MLP and a small conv
    net (one process, scikit-learn's bundled digits)."""
    from fusionring.datasets import load_digits_split

    (x, y), _ = load_digits_split(0)
    torch.manual_seed(0)
    models = {
        "digits MLP 64-256-256-10": (nn.Sequential(nn.Linear(64, 256), nn.ReLU(),
                                                   nn.Linear(256, 256), nn.ReLU(),
                                                   nn.Linear(256, 10)), x),
        "conv net (2 conv + 2 fc)": (nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 128), nn.ReLU(),
            nn.Linear(128, 10)), x.reshape(-1, 1, 8, 8)),
    }
    out = {}
    for name, (model, inputs) in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        grads = []
        for step in range(steps):
            rows = torch.arange(step * 64, (step + 1) * 64) % len(inputs)
            opt.zero_grad()
            nn.functional.cross_entropy(model(inputs[rows]), y[rows]).backward()
            if step % max(1, steps // 5) == 0:
                grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                             .numpy().copy())
            opt.step()
        out[name] = grads
    return out


def errors(x: np.ndarray, xhat: np.ndarray):
    rel = float(np.linalg.norm(x - xhat) / np.linalg.norm(x))
    cos = float(np.dot(x.astype(np.float64), xhat) / (np.linalg.norm(x) * np.linalg.norm(xhat)
                                                    + 1e-300))
    return rel, cos


def reconstruction(steps: int) -> list:
    rng = np.random.default_rng(0)
    rows = []
    for model, grads in capture_gradients(steps).items():
        n = grads[0].size
        methods = {}

        def add(label, bits, fn):
            methods.setdefault(label, (bits, []))[1].append(errors(g, fn(g)))

        for step, g in enumerate(grads):
            for k in (16, 4):
                b = 4 * k
                p = encode(g, k, b, stream=step)
                add(f"cluster K={k}, {b} scored hash buckets", 8 * p.numel() / n,
                    lambda v, p=p, k=k, b=b: decode(p, v.size, k, b))
                ids = ids_of(p, n, k, b)
                add(f"cluster K={k}, {b} buckets shared evenly", 8 * p.numel() / n,
                    lambda v, ids=ids, k=k, b=b: even_buckets(v, ids, k, b))
                p1 = encode(g, k, k, stream=step)
                add(f"cluster K={k}, one bucket per cluster (plain K-means; the default)",
                    8 * p1.numel() / n,
                    lambda v, p1=p1, k=k: decode(p1, v.size, k, k))
                bits = _C.cluster_id_bits(k)
                add(f"QSGD-style uniform stochastic, {bits} bits", bits + 32 / n,
                    lambda v, bits=bits: qsgd(v, bits, rng))
            add("fp16", 16.0, lambda v: v.astype(np.float16).astype(np.float32))
            add("2:4, fp16 values + mask", 9.0, two_of_four_fp16)
        for label, (bits, errs) in methods.items():
            rows.append({"model": model, "method": label, "bits": bits, "elements": n,
                         "rel": statistics.mean(e[0] for e in errs),
                         "cos": statistics.mean(e[1] for e in errs), "samples": len(errs)})
            print(f"{model:<26} {label:<48} {bits:7.4f} bits  rel L2 {rows[-1]['rel']:.4f}  "
                  f"cos {rows[-1]['cos']:.4f}", flush=True)
    return rows


# ---------------------------------------------------------------------- report
def machine() -> str:
    """The CPU's model name (and family/model numbers, which say its generation)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    return (f"{info.get('model name', platform.machine())} (family {info.get('cpu family', '?')}, "
            f"model {info.get('model', '?')}, {info.get('cpu MHz', '?')} MHz)")


def load_average() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def write(path: Path, name: str, text: str) -> None:
    if not path.exists():
        path.write_text(TITLE)
    write_section(path, name, text)


def report_throughput(rows, args, path: Path) -> None:
    plot = path.with_name("cluster-quant-throughput.png")
    _plot_throughput(rows, plot)
    lines = [
        "## Kernel throughput (single thread)", "",
        f"Command: `python scripts/bench_cluster.py --only throughput --rounds {args.rounds}`. "
        f"Machine: {machine()}, {os.cpu_count()} cores shared "
        f"with other work, load average {load_average()} (1/5/15 min) when it finished. "
        "Kernels: each vector family the CPU has, the widest first (the module picks it; "
        "AVX-512 runs the encoder's id search and table adds 16 values a step, decode is the "
        "AVX2 loop for both). Values: Student-t(3) x 1e-3 (gradient-like tails). Rates are dense "
        "float32 input bytes per second; x = the kernel's rate over memcpy of the same bytes, "
        f"timed back to back in each of {args.rounds} rounds (median of the per-round ratios). "
        "Encode = sample + K-means + scores + assign/insert + packed ids (no residual); "
        "encode+residual also writes x - decode(x), as the ring does.", "",
        "| kernels | elements | K | buckets | bits / elem | memcpy GB/s | encode GB/s | encode / memcpy "
        "| encode+residual / memcpy | decode GB/s | decode / memcpy | decode+add / memcpy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kernels']} | {r['count']:,} | {r['k']} | {r['buckets']} | {r['bits']:.4f} | "
                     f"{r['memcpy_gbs']:.2f} | {r['encode_gbs']:.2f} | {r['encode_ratio']:.2f}x | "
                     f"{r['encode+residual_ratio']:.2f}x | {r['decode_gbs']:.2f} | "
                     f"{r['decode_ratio']:.2f}x | {r['decode+add_ratio']:.2f}x |")
    big = [r for r in rows if r["count"] == max(x["count"] for x in rows) and r["k"] == 16]
    if big:
        r = big[0]
        met = "met" if r["encode_ratio"] >= 0.3 else "not met"
        others = "".join(f"; {o['kernels']} {o['encode_ratio']:.2f}x" for o in big[1:])
        lines += ["", f"Target encode >= 0.3x memcpy at {r['count'] * 4 / 2**20:.0f} MiB, K=16, "
                  f"with the kernels the module picks ({r['kernels']}): "
                  f"{r['encode_ratio']:.2f}x, **{met}**{others}."]
    lines += ["", f"![throughput]({plot.name})", ""]
    write(path, "throughput", "\n".join(lines))


def report_reconstruction(rows, args, path: Path) -> None:
    lines = [
        "## Reconstruction error on real gradients", "",
        f"Command: `python scripts/bench_cluster.py --only reconstruction --steps {args.steps}`. "
        f"Whole-model gradients captured every {max(1, args.steps // 5)} steps of "
        f"{args.steps} SGD steps (lr 0.05, momentum 0.9, batch 64) on scikit-learn's digits; "
        "each gradient quantized as one block; mean over the captured gradients of the "
        "relative L2 error |g - q(g)| / |g| and of the cosine between g and q(g). Bits per "
        "element from the actual payload sizes (tables included).", "",
        "| model (elements) | method | bits / elem | relative L2 | cosine |",
        "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['elements']:,}) | {r['method']} | {r['bits']:.3f} | "
                     f"{r['rel']:.4f} | {r['cos']:.4f} |")
    lines.append("")
    write(path, "reconstruction", "\n".join(lines))


def _plot_throughput(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 4.4))
    labels = [f"{r['kernels']}\n{r['count'] * 4 / 2**20:.0f} MiB\nK={r['k']}" for r in rows]
    pos = np.arange(len(rows))
    names = ["encode", "encode+residual", "decode", "decode+add"]
    for i, name in enumerate(names):
        ax.bar(pos + (i - 1.5) * 0.2, [r[name + "_ratio"] for r in rows], 0.2, label=name)
    ax.axhline(0.3, color="k", ls="--", lw=1, label="0.3x target (encode)")
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xticks(pos)
    ax.set_xticklabels(labels)
    ax.set_ylabel("throughput / memcpy of the same bytes")
    ax.set_title("cluster quantizer kernels, one thread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["throughput", "reconstruction"])
    parser.add_argument("--sizes", default="1048576,16777216", help="elements, comma separated")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=str(DOC))
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "throughput"):
        rows = throughput([int(s) for s in args.sizes.split(",")], (16, 4), args.rounds)
        report_throughput(rows, args, out)
    if args.only in (None, "reconstruction"):
        report_reconstruction(reconstruction(args.steps), args, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
