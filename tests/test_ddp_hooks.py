"""fusionring's DDP communication hooks (fusionring.ddp.hooks) under mpiexec + gloo.

The ranks train a model whose gradients are small integers (every layer sees integer inputs
and integer output weights), so float16 values and sums over ranks in any order are exact,
and a numpy simulation of the codec -- N:M selection by ``ref_keep`` of test_nm, the shared
mask's estimate/wait rule of docs/nm.md, error feedback -- must give the same parameters bit
for bit. The simulation follows the bucket layouts DDP reported at each step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_ranks
from test_nm import ref_keep

pytestmark = pytest.mark.timeout(300)

# Shared by the ranks and the reference: the model and every rank's data.
COMMON = r'''
import numpy as np
import torch

SHAPES = [(7, 5), (6, 9), (4, 3), (10, 11), (3, 13)]   # (out, in) of each layer; odd counts
LR = 0.25


class Parallel(torch.nn.Module):
    """Independent bias-free layers; loss = sum_i <layer_i(x_i), t_i>: dL/dW_i = t_i^T x_i."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=False) for o, i in SHAPES)

    def forward(self, xs, ts):
        return sum((layer(x) * t).sum() for layer, x, t in zip(self.layers, xs, ts))


def batch(rank, step):
    rng = np.random.default_rng(100 * rank + step)
    xs = [torch.from_numpy(rng.integers(-3, 4, size=(4, i)).astype(np.float32)) for o, i in SHAPES]
    ts = [torch.from_numpy(rng.integers(-3, 4, size=(4, o)).astype(np.float32)) for o, i in SHAPES]
    return xs, ts


def local_grads(rank, step):
    xs, ts = batch(rank, step)
    return [(t.T @ x).numpy() for x, t in zip(xs, ts)]
'''
exec(COMMON)

RANK_PRELUDE = COMMON + r'''
import os, sys, tempfile
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP
from fusionring.ddp import hooks

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
store_dir = comm.bcast(tempfile.mkdtemp() if rank == 0 else None)
dist.init_process_group("gloo", init_method="file://" + os.path.join(store_dir, "store"),
                        rank=rank, world_size=size)


def make_ddp(cap_mb, view=False, static=False, hook=None):
    """DDP over Parallel whose hook (`hook`, nm_hook by default) records each step's buckets."""
    hook = hook or hooks.nm_hook
    model = Parallel()
    ddp = DDP(model, bucket_cap_mb=cap_mb, gradient_as_bucket_view=view, static_graph=static)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    layouts = []   # per step: [(bucket index, [parameter indices])]

    def record(state, bucket):
        if bucket.index() == 0:
            layouts.append([])
        layouts[-1].append((bucket.index(), [index[id(p)] for p in bucket.parameters()]))
        return hook(state, bucket)

    return model, ddp, layouts, record


def params(model):
    return [p.detach().numpy().tolist() for p in model.parameters()]


def finish():
    """Leave without running interpreter finalization.

    DDP keeps gloo's process group, and so its worker threads, alive until the process exits
    (destroy_process_group then does not join them). A worker still releasing a future's
    callback or a tensor Python owns once finalization has begun cannot take the GIL, and the
    process aborts ("terminate called without an active exception"). On a loaded machine that
    worker may be off the CPU for as long as a rank needs to reach exit, so: every rank meets
    (no one tears gloo down while a peer still uses it), the group is destroyed, MPI is
    finalized, and the process ends at once.
    """
    comm.Barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(0)
'''


# ---------------------------------------------------------------------- the reference
def carry_residuals(stores, owner, key, members, sizes, zeros):
    """The hooks' states when DDP changes its buckets: each parameter's slice of the residual
    moves from the bucket that last held it into `key`'s (one store of residuals per rank)."""
    total, offset = sum(sizes), 0
    for i, count in zip(members, sizes):
        where = owner.get(i)
        if where is not None and where[0] != key:
            for store in stores:
                source = store.get(where[0])
                if source is None:
                    continue
                if store.get(key) is None or len(store[key]) != total:
                    store[key] = zeros(total)
                store[key][offset:offset + count] += source[where[1]:where[1] + count]
                source[where[1]:where[1] + count] = 0
        owner[i] = (key, offset)
        offset += count


class RefNM:
    """numpy simulation of NMState + nm_hook over `size` ranks, per bucket."""

    def __init__(self, size, n, m, shared_mask, error_feedback=True):
        self.size, self.n, self.m = size, n, m
        self.shared, self.ef = shared_mask, error_feedback
        self.buckets = {}   # (index, params) -> dict(est, wait)
        self.res = [{} for _ in range(size)]   # per rank: key -> residual
        self.owner = {}

    def reduce(self, key, inputs, sizes):
        """inputs: one flat float32 array per rank -> the averaged decoded bucket."""
        count = inputs[0].size
        st = self.buckets.setdefault(key, dict(est=None, wait=None))
        if self.ef:
            carry_residuals(self.res, self.owner, key, key[1], sizes,
                            lambda total: np.zeros(total, np.float32))
            res = [store.get(key, np.zeros(count, np.float32)) for store in self.res]
            xs = [(g + r).astype(np.float32) for g, r in zip(inputs, res)]
        else:
            xs = [g.astype(np.float32) for g in inputs]
        half = [torch.from_numpy(x).half().float().numpy() for x in xs]
        if self.shared:
            if st["est"] is None or self.n == self.m:
                keep = np.ones(count, bool)
            else:
                score = np.abs(st["est"]) * (st["wait"] + np.float32(1))
                keep = ref_keep(score.astype(np.float32), self.n, self.m)
            keeps = [keep] * self.size
        else:
            keeps = [ref_keep(x, self.n, self.m) for x in xs]
        sent = [np.where(k, h, 0).astype(np.float32) for k, h in zip(keeps, half)]
        for store, x, s in zip(self.res, xs, sent):
            store[key] = (x - s).astype(np.float32)
        if self.shared:
            # float16 values are divided by the power of two at or above the group's size
            # before their sum (exact here), the rest of the average follows in float32.
            shift = 1 << (self.size - 1).bit_length()
            avg = np.sum([s / np.float32(shift) for s in sent], axis=0, dtype=np.float32)
            if shift != self.size:
                avg = (avg * np.float32(shift / self.size)).astype(np.float32)
        else:
            avg = (np.sum(sent, axis=0, dtype=np.float32) / np.float32(self.size)).astype(np.float32)
        if self.shared:
            if st["est"] is None or self.n == self.m:
                st["est"], st["wait"] = avg.copy(), np.zeros(count, np.float32)
            else:
                w = st["wait"]
                st["est"] = np.where(keep, avg / (w + np.float32(1)), st["est"]).astype(np.float32)
                st["wait"] = np.where(keep, np.float32(0), w + np.float32(1)).astype(np.float32)
        return avg


def reference_params(size, steps, layouts, n, m, shared_mask, joined_after=None):
    """Parameters after `steps` SGD steps on the decoded averaged gradients; `joined_after[r]`:
    rank r has no batch from that step on (it contributes zeros, as DDP's join does)."""
    model = Parallel()
    weights = [p.detach().clone() for p in model.parameters()]
    ref = RefNM(size, n, m, shared_mask)
    for step in range(steps):
        grads = []
        for r in range(size):
            if joined_after is not None and step >= joined_after[r]:
                grads.append([np.zeros((o, i), np.float32) for o, i in SHAPES])
            else:
                grads.append(local_grads(r, step))
        for index, members in layouts[step]:
            inputs = [np.concatenate([grads[r][i].reshape(-1) for i in members])
                      for r in range(size)]
            avg = ref.reduce((index, tuple(members)), inputs,
                             [grads[0][i].size for i in members])
            at = 0
            for i in members:
                numel = weights[i].numel()
                g = torch.from_numpy(avg[at:at + numel].copy()).reshape(weights[i].shape)
                weights[i].add_(g, alpha=-LR)
                at += numel
    return [w.numpy() for w in weights]


def assert_same_params(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), w)


TRAIN = r'''
cfg = {cfg!r}
if "k" in cfg:
    model, ddp, layouts, record = make_ddp(cfg["cap_mb"], cfg["view"], cfg["static"], hooks.cluster_hook)
    state = hooks.ClusterState(k=cfg["k"], sample=cfg["sample"], error_feedback=cfg["ef"])
else:
    model, ddp, layouts, record = make_ddp(cfg["cap_mb"], cfg["view"], cfg["static"])
    state = hooks.NMState(n=cfg["n"], m=cfg["m"], shared_mask=cfg["shared"])
ddp.register_comm_hook(state, record)
opt = torch.optim.SGD(ddp.parameters(), lr=LR)
for step in range(cfg["steps"]):
    opt.zero_grad()
    ddp(*batch(rank, step)).backward()
    opt.step()
report(dict(params=params(model), layouts=layouts))
finish()
'''


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-mask", "per-rank-masks"])
def test_nm_hook_matches_single_process_computation_on_decoded_gradients(tmp_path, np_, shared):
    cfg = dict(cap_mb=0.0001, view=False, static=False, n=2, m=4, shared=shared, steps=5)
    results = run_ranks(np_, RANK_PRELUDE + TRAIN.format(cfg=cfg), tmp_path)
    layouts = results[0]["layouts"]
    assert len(layouts[-1]) >= 3, layouts[-1]   # several buckets
    want = reference_params(np_, cfg["steps"], layouts, 2, 4, shared)
    for r in range(np_):
        assert_same_params(results[r]["params"], want)


@pytest.mark.parametrize("view,static,cap_mb", [(True, False, 0.0001), (False, True, 0.0001),
                                                (True, True, 0.0005), (False, False, 25)],
                         ids=["bucket-view", "static-graph", "view+static", "one-bucket"])
def test_nm_hook_with_bucket_views_static_graph_and_bucket_sizes(tmp_path, view, static, cap_mb):
    cfg = dict(cap_mb=cap_mb, view=view, static=static, n=1, m=4, shared=True, steps=5)
    results = run_ranks(2, RANK_PRELUDE + TRAIN.format(cfg=cfg), tmp_path)
    layouts = results[0]["layouts"]
    if cap_mb == 25:
        assert len(layouts[-1]) == 1
    elif cap_mb == 0.0005:
        assert 1 < len(layouts[-1]) < len(SHAPES), layouts[-1]
    assert_same_params(results[0]["params"], reference_params(2, cfg["steps"], layouts, 1, 4, True))
    assert_same_params(results[1]["params"], results[0]["params"])


@pytest.mark.parametrize("shared", [True, False], ids=["shared-mask", "per-rank-masks"])
def test_nm_hook_with_uneven_inputs_under_join(tmp_path, shared):
    code = RANK_PRELUDE + r'''
shared = {shared!r}
model, ddp, layouts, record = make_ddp(0.0001)
state = hooks.NMState(shared_mask=shared)
ddp.register_comm_hook(state, record)
opt = torch.optim.SGD(ddp.parameters(), lr=LR)
with ddp.join():
    for step in range(3 + 2 * rank):     # rank r has 3 + 2r batches
        opt.zero_grad()
        ddp(*batch(rank, step)).backward()
        opt.step()
report(dict(params=params(model), layouts=layouts))
finish()
'''.format(shared=shared)
    results = run_ranks(3, code, tmp_path)
    last = results[2]   # the rank with the most batches took every step
    layouts = last["layouts"]
    assert len(layouts) == 7
    want = reference_params(3, 7, layouts, 2, 4, shared, joined_after=[3, 5, 7])
    assert_same_params(last["params"], want)


@pytest.mark.parametrize("hook,kwargs", [
    ("nm", dict(n=1, m=4, shared_mask=True, values="float32")),
    ("nm", dict(n=1, m=4, shared_mask=False, values="float32")),
    ("nm", dict(n=1, m=4, shared_mask=True, values="float16")),
    ("cluster", dict(k=4, sample=64)),
], ids=["nm-shared", "nm-per-rank", "nm-shared-float16", "cluster"])
def test_error_feedback_loses_nothing_over_a_run_with_rebuilt_buckets(tmp_path, hook, kwargs):
    """Per parameter, over the whole run: sum over ranks and steps of the gradients = P * the
    delivered averages + the residuals left on every rank. DDP rebuilds its buckets after the
    first step, so this holds only if what a bucket of the old layout held back reaches the
    new ones.

    Exact up to float32 sums with float32 values; float16 values are summed in float16 on the
    wire (as by torch's fp16 hook), which rounds each step's sum once more: within 2^-10 of it."""
    code = RANK_PRELUDE + r'''
hook, kwargs = {hook!r}, {kwargs!r}
torch.manual_seed(1)
net = torch.nn.Sequential(torch.nn.Linear(20, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
names = {{id(p): name for name, p in net.named_parameters()}}
sizes = {{name: p.numel() for name, p in net.named_parameters()}}
sent = {{name: torch.zeros(c, dtype=torch.float64) for name, c in sizes.items()}}
delivered = {{name: torch.zeros(c, dtype=torch.float64) for name, c in sizes.items()}}
layouts = {{}}   # bucket key -> [(parameter name, count)]
ddp = DDP(net, bucket_cap_mb=0.001)
state = hooks.NMState(**kwargs) if hook == "nm" else hooks.ClusterState(**kwargs)
inner = hooks.nm_hook if hook == "nm" else hooks.cluster_hook

def add(sums, flat, members):
    at = 0
    for name, count in members:
        sums[name] += flat[at:at + count].double()
        at += count

def probe(state, bucket):
    members = [(names[id(p)], p.numel()) for p in bucket.parameters()]
    layouts[state.key_of(bucket)] = members
    add(sent, bucket.buffer().detach().reshape(-1), members)

    def after(f):
        out = f.value()
        add(delivered, out.reshape(-1), members)
        return out
    return inner(state, bucket).then(after)

ddp.register_comm_hook(state, probe)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for step in range(5):
    opt.zero_grad()
    ddp(torch.randn(8, 20, generator=g)).square().mean().backward()
    opt.step()
left = {{name: torch.zeros(c, dtype=torch.float64) for name, c in sizes.items()}}
for key, residual in state.compressor.memory.residuals.items():
    add(left, residual.reshape(-1), layouts[key])
as_lists = lambda sums: {{name: v.tolist() for name, v in sums.items()}}
report(dict(sent=as_lists(sent), delivered=as_lists(delivered), left=as_lists(left),
            layouts=len(layouts)))
finish()
'''.format(hook=hook, kwargs=kwargs)
    results = run_ranks(3, code, tmp_path)
    assert results[0]["layouts"] >= 2   # DDP's first bucket and the rebuilt ones
    for name in results[0]["sent"]:
        lhs = sum(np.array(r["sent"][name]) for r in results)
        rhs = 3 * np.array(results[0]["delivered"][name]) + sum(np.array(r["left"][name])
                                                                for r in results)
        atol = 1e-6 if kwargs.get("values") != "float16" else 5 * 2.0 ** -10 * np.abs(lhs).max()
        np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=atol)
        assert np.abs(sum(np.array(r["left"][name]) for r in results)).sum() > 0
        for r in results[1:]:   # every rank decoded the same averages
            np.testing.assert_array_equal(r["delivered"][name], results[0]["delivered"][name])


def test_state_round_trip_continues_bit_identically(tmp_path):
    code = RANK_PRELUDE + r'''
import io

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(40, 30, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(30, 3, bias=False))

def data(step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 12, generator=g)

def train(ddp, opt, steps):
    for step in steps:
        opt.zero_grad()
        ddp(data(step)).square().mean().backward()
        opt.step()

schedule = [[0, [4, 4]], [2, [2, 4]], [5, [1, 4]]]
model = net()
ddp = DDP(model, bucket_cap_mb=0.001)
state = hooks.NMState(n=2, m=4, schedule=schedule)
ddp.register_comm_hook(state, hooks.nm_hook)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
train(ddp, opt, range(4))

pickled, plain, saved_opt = io.BytesIO(), io.BytesIO(), io.BytesIO()
torch.save(state, pickled)
torch.save(state.state_dict(), plain)
torch.save(opt.state_dict(), saved_opt)
saved_model = {k: v.clone() for k, v in model.state_dict().items()}
keys = sorted(state.keys())

def resume(hook_state):
    """A new DDP model from the checkpoint, trained on with `hook_state`."""
    model2 = net()
    model2.load_state_dict(saved_model)
    ddp2 = DDP(model2, bucket_cap_mb=0.001)
    ddp2.register_comm_hook(hook_state, hooks.nm_hook)
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.1, momentum=0.9)
    saved_opt.seek(0)
    opt2.load_state_dict(torch.load(saved_opt))
    train(ddp2, opt2, range(4, 9))
    return params(model2)

results = {}
pickled.seek(0)
loaded = torch.load(pickled, weights_only=False)
plain.seek(0)
from_dict = hooks.NMState.from_state_dict(torch.load(plain))   # weights_only by default
assert sorted(loaded.keys()) == keys and sorted(from_dict.keys()) == keys
results["pickle"] = resume(loaded)
results["state_dict"] = resume(from_dict)
straight = resume(state)                                          # the state that was saved
fresh = resume(hooks.NMState(n=2, m=4, schedule=schedule))        # what losing it would give

# a state of another configuration is refused by name
try:
    hooks.NMState(n=1, m=4).load_state_dict(state.state_dict())
    refused = ""
except ValueError as exc:
    refused = str(exc)
report(dict(straight=straight, resumed=results, fresh=fresh, refused=refused, n_keys=len(keys)))
finish()
'''
    results = run_ranks(2, code, tmp_path)
    for res in results:
        assert res["n_keys"] >= 2   # several buckets
        for how in ("pickle", "state_dict"):
            assert res["resumed"][how] == res["straight"], how
        assert res["fresh"] != res["straight"]
        assert "NMState" in res["refused"] and "'n': 2" in res["refused"]


def test_nm_state_refuses_bad_configuration():
    from fusionring.ddp import hooks

    with pytest.raises(ValueError, match="n=5"):
        hooks.NMState(n=5, m=4)
    with pytest.raises(ValueError, match="values"):
        hooks.NMState(values=torch.int32)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("launcher,hook", [("mpiexec", "nm"), ("torchrun", "nm"),
                                           ("mpiexec", "layers"), ("torchrun", "cluster")])
def test_ddp_hooks_example_trains_under_mpiexec_and_torchrun(launcher, hook):
    import os
    import re
    import subprocess
    import sys

    from conftest import ROOT, mpiexec_path

    script = str(ROOT / "examples/ddp_hooks.py")
    port = str(_free_port())
    if launcher == "mpiexec":
        cmd = [mpiexec_path(), "-n", "2", sys.executable, script, "--port", port, "--hook", hook]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", port, script, "--hook", hook]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)", done.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 0.85, done.stdout
    what = "parameters" if hook == "layers" else "buckets"
    assert re.search(rf"hook state for \d+ {what} restored", done.stdout), done.stdout


@pytest.mark.parametrize("kwargs", [dict(), dict(shared_mask=False, values=torch.bfloat16),
                                    dict(schedule="adaptive"),
                                    dict(n=1, m=8, schedule=[(0, (8, 8)), (3, (1, 8))]),
                                    dict(error_feedback=False, values=torch.float32)])
def test_state_pickles_and_state_dict_loads_weights_only_for_every_configuration(kwargs):
    import io

    from fusionring.ddp import hooks

    state = hooks.NMState(**kwargs)
    x = torch.randn(1000)
    for _ in range(3):  # some per-key state: residuals, estimates, steps
        payload, ctx = state.compressor.compress(x, name="b")
        if not isinstance(payload, tuple):
            state.compressor.decompress(payload.float(), ctx)
    plain, pickled = io.BytesIO(), io.BytesIO()
    torch.save(state.state_dict(), plain)
    torch.save(state, pickled)
    plain.seek(0)
    pickled.seek(0)
    want = state.codec_state()
    loaded_states = [hooks.NMState.from_state_dict(torch.load(plain, weights_only=True)),
                     torch.load(pickled, weights_only=False)]
    nxt, _ = state.compressor.compress(x, name="b")   # the original's next step
    nxt = nxt if isinstance(nxt, tuple) else (nxt,)
    for loaded in loaded_states:
        assert loaded.config() == state.config() and loaded.keys() == ["b"]
        got = loaded.codec_state()
        assert got["tensors"]["b"]["step"] == 3
        assert want["residuals"].keys() == got["residuals"].keys()
        for key in want["residuals"]:
            assert torch.equal(want["residuals"][key], got["residuals"][key])
        step, _ = loaded.compressor.compress(x, name="b")
        step = step if isinstance(step, tuple) else (step,)
        assert all(torch.equal(u, v) for u, v in zip(nxt, step))


# ---------------------------------------------------------------------- cluster quantizer
def cluster_reference_params(size, steps, layouts, k, sample, ef):
    """One process: every rank's quantizer (the same kernels, tested against numpy in
    test_cluster_quant) encodes its bucket in the order the ranks did, and the payloads are
    decoded and added in rank order, then averaged: the parameters after `steps` SGD steps."""
    from fusionring.compression import ClusterCompressor

    model = Parallel()
    weights = [p.detach().clone() for p in model.parameters()]
    coders = [ClusterCompressor(k, sample, error_feedback=ef) for _ in range(size)]
    owner = {}
    for step in range(steps):
        grads = [local_grads(r, step) for r in range(size)]
        for index, members in layouts[step]:
            key = f"{index}:{members}"
            if ef:
                carry_residuals([c.memory.residuals for c in coders], owner, key, members,
                                [grads[0][i].size for i in members], torch.zeros)
            total = torch.zeros(sum(grads[0][i].size for i in members))
            for r in range(size):
                x = torch.from_numpy(np.concatenate([grads[r][i].reshape(-1) for i in members]))
                payload, _ = coders[r].compress(x, name=key)
                coders[r].decode_add(payload, total)
            avg = total.div_(size)
            at = 0
            for i in members:
                numel = weights[i].numel()
                weights[i].add_(avg[at:at + numel].reshape(weights[i].shape), alpha=-LR)
                at += numel
    return [w.numpy() for w in weights]


@pytest.mark.parametrize("np_,view,ef", [(2, False, True), (3, False, True), (2, True, False)],
                         ids=["2-ranks", "3-ranks", "bucket-view-no-ef"])
def test_cluster_hook_matches_single_process_computation(tmp_path, np_, view, ef):
    cfg = dict(cap_mb=0.0001, view=view, static=False, k=4, sample=16, ef=ef, steps=4)
    results = run_ranks(np_, RANK_PRELUDE + TRAIN.format(cfg=cfg), tmp_path)
    layouts = results[0]["layouts"]
    assert len(layouts[-1]) >= 3, layouts[-1]   # several buckets
    want = cluster_reference_params(np_, cfg["steps"], layouts, 4, 16, ef)
    dense = reference_params(np_, cfg["steps"], layouts, 4, 4, False)   # 4:4 keeps everything
    assert any(not np.array_equal(w, d) for w, d in zip(want, dense))  # quantized for real
    for r in range(np_):
        assert_same_params(results[r]["params"], want)


def test_cluster_state_round_trip_and_bad_configuration():
    import io

    from fusionring.ddp import hooks

    state = hooks.ClusterState(k=8, sample=64)
    x = torch.randn(1000)
    for _ in range(3):
        state.compressor.compress(x, name="b")
    plain, pickled = io.BytesIO(), io.BytesIO()
    torch.save(state.state_dict(), plain)
    torch.save(state, pickled)
    plain.seek(0)
    pickled.seek(0)
    nxt, _ = state.compressor.compress(x, name="b")   # the original's next step
    for loaded in (hooks.ClusterState.from_state_dict(torch.load(plain, weights_only=True)),
                   torch.load(pickled, weights_only=False)):
        assert loaded.config() == state.config() and loaded.keys() == ["b"]
        step, _ = loaded.compressor.compress(x, name="b")
        assert torch.equal(step, nxt)
    with pytest.raises(ValueError, match="ClusterState"):
        hooks.ClusterState(k=4).load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="k"):
        hooks.ClusterState(k=1)
    with pytest.raises(ValueError, match="values"):
        hooks.ClusterState(values=torch.int32)


# ---------------------------------------------------------------------- layer selection
LAYERS_TRAIN = r'''
from fusionring.selection import LayerSelection

cfg = {cfg!r}
model = Parallel()
ddp = DDP(model, bucket_cap_mb=cfg["cap_mb"], gradient_as_bucket_view=cfg["view"],
          static_graph=cfg["static"])
selection = getattr(LayerSelection, cfg["selection"])(k=cfg["k"])
state = hooks.LayerSelectionState(process_group=None, selection=selection, model=model)
counts = []   # buckets per step
chosen = []

def record(state, bucket):
    if bucket.index() == 0:
        counts.append(0)
    counts[-1] += 1
    fut = hooks.layer_selection_hook(state, bucket)
    if bucket.is_last():
        chosen.append(list(state.last_chosen))
    return fut

ddp.register_comm_hook(state, record)
opt = torch.optim.SGD(ddp.parameters(), lr=LR)
steps = cfg["steps"] + (2 * rank if cfg["join"] else 0)
with ddp.join(enable=cfg["join"]):
    for step in range(steps):
        opt.zero_grad()
        ddp(*batch(rank, step)).backward()
        opt.step()
report(dict(params=params(model), counts=counts, chosen=chosen))
finish()
'''


def reference_layer_selection(size, steps, selection, k, joined_after=None):
    """numpy simulation of LayerSelectionState + layer_selection_hook (docs/layer-selection.md):
    per rank gradient + residual, scores summed over ranks, the same top k everywhere, the
    chosen layers averaged, the others zero with their sums kept. Returns the parameters and
    the chosen layers of each step."""
    n = len(SHAPES)
    weights = [p.detach().clone() for p in Parallel().parameters()]
    residual = [[np.zeros((o, i), np.float32) for o, i in SHAPES] for _ in range(size)]
    chosen_steps = []
    for step in range(steps):
        summed = []
        for r in range(size):
            if joined_after is not None and step >= joined_after[r]:
                grads = [np.zeros((o, i), np.float32) for o, i in SHAPES]
            else:
                grads = local_grads(r, step)
            summed.append([(g + res).astype(np.float32) for g, res in zip(grads, residual[r])])
        if selection == "norm":
            scores = [sum(float(np.sqrt((summed[r][i].astype(np.float64) ** 2).sum() / summed[r][i].size))
                          for r in range(size)) for i in range(n)]
        else:   # round_robin: k consecutive layers from step * k
            start = (step * k) % n
            scores = [float(n - ((i - start) % n)) for i in range(n)]
        chosen = sorted(sorted(range(n), key=lambda i: (-scores[i], i))[:k])
        chosen_steps.append(chosen)
        for i in range(n):
            if i in chosen:
                avg = np.sum([summed[r][i] for r in range(size)], axis=0, dtype=np.float32)
                avg = (avg / np.float32(size)).astype(np.float32)
                weights[i].add_(torch.from_numpy(avg), alpha=-LR)
                for r in range(size):
                    residual[r][i] = np.zeros_like(residual[r][i])
            else:
                for r in range(size):
                    residual[r][i] = summed[r][i]
    return [w.numpy() for w in weights], chosen_steps


def _layers_cfg(**kw):
    cfg = dict(cap_mb=0.0001, view=False, static=False, selection="norm", k=2, steps=6, join=False)
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("np_,selection", [(2, "norm"), (3, "norm"), (2, "round_robin"),
                                           (3, "round_robin")])
def test_layer_selection_hook_matches_single_process_computation(tmp_path, np_, selection):
    cfg = _layers_cfg(selection=selection)
    results = run_ranks(np_, RANK_PRELUDE + LAYERS_TRAIN.format(cfg=cfg), tmp_path)
    assert results[0]["counts"][-1] >= 3, results[0]["counts"]   # several buckets
    want, chosen = reference_layer_selection(np_, cfg["steps"], selection, cfg["k"])
    assert len({tuple(c) for c in chosen}) > 1   # the choice really moved
    for r in range(np_):
        assert results[r]["chosen"] == chosen   # every rank picked the reference's layers
        assert_same_params(results[r]["params"], want)


@pytest.mark.parametrize("view,static,cap_mb", [(True, False, 0.0001), (False, True, 0.0001),
                                                (True, True, 0.0005), (False, False, 25)],
                         ids=["bucket-view", "static-graph", "view+static", "one-bucket"])
def test_layer_selection_hook_with_bucket_views_static_graph_and_bucket_sizes(tmp_path, view,
                                                                              static, cap_mb):
    cfg = _layers_cfg(view=view, static=static, cap_mb=cap_mb, k=3)
    results = run_ranks(2, RANK_PRELUDE + LAYERS_TRAIN.format(cfg=cfg), tmp_path)
    counts = results[0]["counts"]
    if cap_mb == 25:
        assert counts[-1] == 1
    else:
        assert counts[-1] > 1, counts
    want, chosen = reference_layer_selection(2, cfg["steps"], "norm", 3)
    for r in range(2):
        assert results[r]["chosen"] == chosen
        assert_same_params(results[r]["params"], want)


def test_layer_selection_hook_with_uneven_inputs_under_join(tmp_path):
    cfg = _layers_cfg(join=True, steps=3)    # rank r has 3 + 2r batches
    results = run_ranks(3, RANK_PRELUDE + LAYERS_TRAIN.format(cfg=cfg), tmp_path)
    last = results[2]
    assert len(last["counts"]) == 7
    want, chosen = reference_layer_selection(3, 7, "norm", 2, joined_after=[3, 5, 7])
    assert last["chosen"] == chosen
    for r in range(3):   # joined ranks took the same steps through join's shadow passes
        assert_same_params(results[r]["params"], want)


def test_layer_selection_error_feedback_identity_holds_on_real_gradients(tmp_path):
    """Per parameter: sum over ranks of (gradient + old residual) = P * delivered average + sum
    of new residuals; unchosen layers deliver exactly zero; every rank delivers the same."""
    code = RANK_PRELUDE + r'''
from fusionring.selection import LayerSelection

torch.manual_seed(1)
net = torch.nn.Sequential(torch.nn.Linear(20, 33), torch.nn.Tanh(), torch.nn.Linear(33, 17),
                          torch.nn.Tanh(), torch.nn.Linear(17, 5))
ddp = DDP(net, bucket_cap_mb=0.001)
state = hooks.LayerSelectionState(selection=LayerSelection.hyper(net, k=1), model=net)
steps = []

def probe(state, bucket):
    if bucket.index() == 0:
        steps.append(dict(old={n: v.reshape(-1).tolist() for n, v in
                               state.selection.acc.residual.items()}, grad={}, out={}))
    record = steps[-1]
    names = [state._names[id(p)] for p in bucket.parameters()]
    sizes = [p.numel() for p in bucket.parameters()]
    grad = bucket.buffer().detach().clone()
    for name, piece in zip(names, grad.split(sizes)):
        record["grad"][name] = piece.tolist()
    fut = hooks.layer_selection_hook(state, bucket)

    def after(f):
        out = f.value()
        for name, piece in zip(names, out.reshape(-1).split(sizes)):
            record["out"][name] = piece.tolist()
        if bucket.is_last():
            record["new"] = {n: v.reshape(-1).tolist() for n, v in state.selection.acc.residual.items()}
            record["chosen"] = list(state.last_chosen)
            record["layers"] = state.selection.layers
        return out
    return fut.then(after)

ddp.register_comm_hook(state, probe)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for step in range(5):
    opt.zero_grad()
    x = torch.randn(8, 20, generator=g)
    ddp(x).square().mean().backward()
    opt.step()
report(steps)
finish()
'''
    results = run_ranks(3, code, tmp_path)
    held_back = 0
    for per_rank in zip(*results):
        first = per_rank[0]
        assert all(r["chosen"] == first["chosen"] for r in per_rank)
        chosen = {n for i in first["chosen"] for n in first["layers"][i]}
        assert len(first["grad"]) == 6 and len(first["chosen"]) == 1
        for name in first["grad"]:
            count = len(first["grad"][name])
            zero = np.zeros(count)
            lhs = sum(np.array(r["grad"][name]) + np.array(r["old"].get(name, zero)) for r in per_rank)
            rhs = 3 * np.array(first["out"][name]) + sum(np.array(r["new"].get(name, zero))
                                                         for r in per_rank)
            np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=1e-6)
            for r in per_rank[1:]:
                assert r["out"][name] == first["out"][name]
            if name in chosen:
                assert all(name not in r["new"] for r in per_rank)
            else:
                assert first["out"][name] == [0.0] * count
                held_back += int(np.abs(np.array(first["new"][name])).sum() > 0)
    assert held_back >= 8   # residuals really were held back


def test_layer_selection_state_round_trip_continues_bit_identically(tmp_path):
    code = RANK_PRELUDE + r'''
import io
from fusionring.selection import LayerSelection

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 3))

def data(step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 12, generator=g)

def train(ddp, opt, steps):
    for step in steps:
        opt.zero_grad()
        ddp(data(step)).square().mean().backward()
        opt.step()

def start(kind, model, ddp):
    if kind == "hyper":
        return hooks.LayerSelectionState(selection=LayerSelection.hyper(model, k=1), model=model)
    if kind == "hyper-warm":   # resumed inside the warm-up, literal top k: both must survive loading
        return hooks.LayerSelectionState(
            selection=LayerSelection.hyper(model, k=1, accumulate=False, warmup_steps=6), model=model)
    if kind == "random":
        return hooks.LayerSelectionState(selection=LayerSelection.random(k=1, seed=7),
                                         model=ddp)
    return hooks.LayerSelectionState(selection=LayerSelection.norm(k=1, max_wait=2), model=model)

out = {}
for kind in ("hyper", "hyper-warm", "random", "norm"):
    model = net()
    ddp = DDP(model, bucket_cap_mb=0.001)
    state = start(kind, model, ddp)
    ddp.register_comm_hook(state, hooks.layer_selection_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    train(ddp, opt, range(4))

    pickled, plain, saved_opt = io.BytesIO(), io.BytesIO(), io.BytesIO()
    torch.save(state, pickled)
    torch.save(state.state_dict(), plain)
    torch.save(opt.state_dict(), saved_opt)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    keys = state.keys()

    def resume(make_state):
        model2 = net()
        model2.load_state_dict(saved_model)
        ddp2 = DDP(model2, bucket_cap_mb=0.001)
        hook_state = make_state(model2, ddp2)
        ddp2.register_comm_hook(hook_state, hooks.layer_selection_hook)
        opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.1, momentum=0.9)
        saved_opt.seek(0)
        opt2.load_state_dict(torch.load(saved_opt))
        train(ddp2, opt2, range(4, 9))
        return params(model2)

    def from_pickle(model2, ddp2):
        pickled.seek(0)
        loaded = torch.load(pickled, weights_only=False)
        assert loaded.keys() == keys
        loaded.attach(model2)
        return loaded

    def from_dict(model2, ddp2):
        plain.seek(0)
        return hooks.LayerSelectionState.from_state_dict(torch.load(plain), model=ddp2)  # weights_only

    resumed = {"pickle": resume(from_pickle), "state_dict": resume(from_dict)}
    fresh = resume(lambda model2, ddp2: start(kind, model2, ddp2))
    train(ddp, opt, range(4, 9))   # the run that was saved goes on
    out[kind] = dict(straight=params(model), resumed=resumed, fresh=fresh, n_keys=len(keys))

try:
    hooks.LayerSelectionState(selection=LayerSelection.norm(k=2), model=net()).load_state_dict(
        state.state_dict())
    refused = ""
except ValueError as exc:
    refused = str(exc)
out["refused"] = refused
report(out)
finish()
'''
    results = run_ranks(2, code, tmp_path, timeout=150)
    for res in results:
        for kind in ("hyper", "hyper-warm", "random", "norm"):
            got = res[kind]
            if kind == "hyper-warm":
                assert got["n_keys"] == 0     # inside the warm-up every layer was sent
            else:
                assert got["n_keys"] >= 2, kind   # residuals were saved
            for how in ("pickle", "state_dict"):
                assert got["resumed"][how] == got["straight"], (kind, how)
            assert got["fresh"] != got["straight"], kind
        assert "LayerSelectionState" in res["refused"] and "'k': 1" in res["refused"]
    assert results[0]["norm"]["straight"] == results[1]["norm"]["straight"]


def test_layer_selection_state_refuses_bad_arguments():
    from fusionring.ddp import hooks
    from fusionring.selection import LayerSelection

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="selection='best'"):
        hooks.LayerSelectionState(selection="best", model=model)
    with pytest.raises(ValueError, match="k=3"):
        hooks.LayerSelectionState(selection=LayerSelection.norm(k=3), model=model)
    with pytest.raises(ValueError, match="fraction=1.5"):
        hooks.LayerSelectionState(selection=LayerSelection.norm(fraction=1.5), model=model)
    other = torch.nn.Linear(3, 4)
    with pytest.raises(ValueError, match="other parameters"):
        hooks.LayerSelectionState(selection=LayerSelection.hyper(model, k=1), model=other)
    state = hooks.LayerSelectionState(selection="round_robin", model=model)
    assert repr(state) == "LayerSelectionState(round_robin, fraction=0.25)"
    assert state.selection.k == 1


def test_hooks_reduce_float64_models(tmp_path):
    """A float64 model: N:M and the cluster quantizer encode its buckets (as float32 values),
    and layer selection with every layer chosen sums in float64, as plain DDP does."""
    code = RANK_PRELUDE + r'''
from fusionring.selection import LayerSelection

def train(make_state=None, hook=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 3)).double()
    ddp = DDP(net)
    if make_state is not None:
        ddp.register_comm_hook(make_state(net), hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        opt.zero_grad()
        ddp(torch.randn(6, 10, generator=g, dtype=torch.float64)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

plain = train()
nm = train(lambda net: hooks.NMState(n=4, m=4, values=torch.float32), hooks.nm_hook)
cluster = train(lambda net: hooks.ClusterState(k=4, sample=64), hooks.cluster_hook)
layers = train(lambda net: hooks.LayerSelectionState(selection=LayerSelection.norm(1.0),
                                                     model=net), hooks.layer_selection_hook)
report(dict(nm=(nm - plain).abs().max().item(), layers=(layers - plain).abs().max().item(),
            cluster_finite=bool(torch.isfinite(cluster).all()), cluster=cluster.tolist(),
            dtype=str(nm.dtype)))
finish()
'''
    results = run_ranks(2, code, tmp_path)
    for res in results:
        assert res["dtype"] == "torch.float64"
        assert res["nm"] < 1e-6          # dense N:M with float32 values: float32 rounding only
        assert res["layers"] == 0.0      # every layer chosen, summed in float64
        assert res["cluster_finite"]
    assert results[0]["cluster"] == results[1]["cluster"]


def test_bad_flags_and_selector_arguments_are_refused_when_built_naming_them():
    from fusionring.ddp import hooks
    from fusionring.selection import LayerSelection

    cases = [
        (lambda: hooks.NMState(shared_mask="no"), "shared_mask='no'"),
        (lambda: hooks.NMState(error_feedback="no"), "error_feedback='no'"),
        (lambda: hooks.ClusterState(error_feedback="no"), "error_feedback='no'"),
        (lambda: hooks.NMState(schedule=[(0, (5, 4))]), r"schedule stage \(0, \(5, 4\)\)"),
        (lambda: LayerSelection.hyper(None, lr=-1), "lr=-1"),
        (lambda: LayerSelection.norm(0.5, k=2), "exactly one of fraction= or k="),
        (lambda: LayerSelection.norm(), "exactly one of fraction= or k="),
        (lambda: LayerSelection.round_robin(k=0), "k=0"),
        (lambda: LayerSelection.norm(0.5, max_wait=0), "max_wait=0"),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message):
            build()
    assert hooks.NMState(shared_mask=0, error_feedback=1).config()["shared_mask"] is False


def test_random_selection_keeps_its_seed_in_the_state():
    from fusionring.ddp import hooks
    from fusionring.selection import LayerSelection

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    state = hooks.LayerSelectionState(selection=LayerSelection.random(0.5, seed=7), model=model)
    assert state.config()["selection"]["seed"] == 7
    again = hooks.LayerSelectionState.from_state_dict(state.state_dict(), model=model)
    assert again.selection.seed == 7
