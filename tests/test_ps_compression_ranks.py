"""Compressed pushes decoded on arrival, one server or two, against a single-process reference of the same
compressed gradients; the byte counters match the payloads."""
import pytest

from conftest import run_ranks

SCRIPT = r'''
import atexit, numpy as np, torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import ps
S = {servers}
if MPI.COMM_WORLD.Get_rank() < S:
    atexit.register(report, {{"server": True}})
ps.init(num_servers=S)
W, k = ps.num_workers(), ps.worker_rank()
KIND = "{kind}"

def compressor():
    return {{"fp16": lambda: hvd.Compression.fp16,
             "nm": lambda: hvd.Compression.nm(2, 4, shared_mask=False),
             "cluster": lambda: hvd.Compression.cluster(k=4, sample=64, seed=3)}}[KIND]()

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))

def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)

residual = {{}}

def nm_reference(j, name, g):
    # numpy: add the residual, keep the 2 largest magnitudes of every 4, keep the rest as the residual
    x = g.numpy().reshape(-1) + residual.get((j, name), np.zeros(g.numel(), np.float32))
    groups = x.reshape(-1, 4)
    top = np.argsort(-np.abs(groups), axis=1, kind="stable")[:, :2]
    kept = np.zeros_like(groups)
    np.put_along_axis(kept, top, np.take_along_axis(groups, top, axis=1), axis=1)
    residual[(j, name)] = x - kept.reshape(-1)
    return torch.from_numpy(kept.reshape(g.shape).copy())

ref_codecs = [compressor() for _ in range(W)]  # cluster: each worker's own codec, in its push order

def reference(j, name, g):
    if KIND == "fp16":
        return torch.from_numpy(g.numpy().astype(np.float16).astype(np.float32))
    if KIND == "nm":
        return nm_reference(j, name, g)
    payload, ctx = ref_codecs[j].compress(g, name=name)
    return ref_codecs[j].decompress(payload, ctx)

def payload_bytes(codec, name, g):
    payload, _ = codec.compress(g, name=name) if KIND != "fp16" else codec.compress(g)
    parts = payload if isinstance(payload, (tuple, list)) else [payload]
    return sum(p.numel() * p.element_size() for p in parts)

model, ref = build(), build()
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="bsp", compression=compressor())
shards = opt._shards
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
size_codec = compressor()
sent = sum(p.numel() * 4 for p in model.parameters()) if k == 0 else 0  # worker 0's initial parameters
steps = 5
for step in range(steps):
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    grads = []
    named = dict(ref.named_parameters())
    for j in range(W):
        ref.zero_grad(); xj, yj = batch(j, step)
        torch.nn.functional.mse_loss(ref(xj), yj).backward()
        # the order each worker compresses in: server by server, each server's names in order
        grads.append({{n: reference(j, n, named[n].grad.clone()) for shard in shards for n in shard}})
        if j == k:
            sent += sum(payload_bytes(size_codec, n, named[n].grad.clone()) for shard in shards for n in shard)
    for n, p in named.items():
        p.grad = sum(g[n] for g in grads) / W
    ref_opt.step()
s = ps.stats()
ps.shutdown()
dense = sum(p.numel() * 4 for p in model.parameters())
report({{"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
        "bytes_sent": s["bytes_sent"], "expected_sent": sent, "bytes_received": s["bytes_received"],
        "expected_received": dense * (steps + 1), "dense": dense}})
'''


@pytest.mark.parametrize("kind,servers", [("fp16", 1), ("nm", 1), ("cluster", 1), ("nm", 2), ("fp16", 2)])
def test_compressed_pushes_are_decoded_on_arrival(tmp_path, kind, servers):
    results = run_ranks(servers + 2, SCRIPT.format(kind=kind, servers=servers), tmp_path, timeout=150)
    for r in results[servers:]:
        assert r["diff"] < 1e-6, r
        assert r["bytes_sent"] == r["expected_sent"], r
        assert r["bytes_received"] == r["expected_received"], r  # parameters come back dense
    if kind != "fp16":
        assert results[servers + 1]["bytes_sent"] < 5 * results[servers + 1]["dense"]  # fewer bytes than dense
