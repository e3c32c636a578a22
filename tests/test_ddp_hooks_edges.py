"""DDP hooks where a run leaves the common path: bucket layouts whose parameters look alike,
an adaptive N:M schedule on ranks whose gradients differ, float16 values near their range and
gradients that overflow, and layer selection on a 16-bit model. Each against plain arithmetic
on what the hooks were given (sums recorded per parameter), at 2 or 3 ranks under mpiexec."""
import numpy as np
import pytest

from conftest import run_ranks
from test_ddp_hooks import RANK_PRELUDE

# Three layers of one shape and no bias: DDP's first bucket is [c, b, a], its rebuilt one
# [a, b, c] (gradient order), so only the parameters' identities tell the layouts apart.
ALIKE = r'''
kind, dtypes = {kind!r}, {dtypes!r}


class Alike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False).to(getattr(torch, d))
                                          for d in dtypes)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype))).float()
        return x


model = Alike()
names = {{id(p): n for n, p in model.named_parameters()}}
ddp = DDP(model, bucket_cap_mb={cap_mb})
state, inner = {{
    "nm": (lambda: (hooks.NMState(n=1, m=4, values=torch.float32, shared_mask=False), hooks.nm_hook)),
    "nm_default": (lambda: (hooks.NMState(), hooks.nm_hook)),
    "cluster": (lambda: (hooks.ClusterState(k=4), hooks.cluster_hook)),
}}[kind]()
zeros = lambda: {{n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}}
sent, delivered, layouts = zeros(), zeros(), {{}}

def add(sums, flat, members):
    at = 0
    for name, count in members:
        sums[name] += flat[at:at + count].double()
        at += count

def probe(st, bucket):
    members = [(names[id(p)], p.numel()) for p in bucket.parameters()]
    layouts[st.key_of(bucket)] = members
    add(sent, bucket.buffer().detach().reshape(-1), members)

    def after(f):
        add(delivered, f.value().detach().reshape(-1), members)
        return f.value()
    return inner(st, bucket).then(after)

ddp.register_comm_hook(state, probe)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
for step in range(6):
    g = torch.Generator().manual_seed(1000 * rank + step)
    opt.zero_grad()
    out = ddp(torch.randn(4, 8, generator=g))
    out.float().square().mean().backward()
    opt.step()
left = zeros()
for key, residual in state.compressor.memory.residuals.items():
    add(left, residual.reshape(-1), layouts[key])
as_lists = lambda sums: {{name: v.tolist() for name, v in sums.items()}}
report(dict(sent=as_lists(sent), delivered=as_lists(delivered), left=as_lists(left),
            layouts=len(layouts)))
finish()
'''


@pytest.mark.parametrize("kind,dtypes,cap_mb", [
    ("nm", ["float32"] * 3, 1000),
    ("cluster", ["float32"] * 3, 1000),
    ("nm_default", ["float32", "bfloat16", "float32"], 0.0001),
], ids=["nm-one-bucket", "cluster-one-bucket", "nm-mixed-dtypes-small-buckets"])
def test_error_feedback_keeps_each_parameters_residual_when_layouts_look_alike(tmp_path, kind,
                                                                              dtypes, cap_mb):
    """Per parameter over the run: sum of the ranks' gradients = P * delivered + residuals."""
    results = run_ranks(2, RANK_PRELUDE + ALIKE.format(kind=kind, dtypes=dtypes, cap_mb=cap_mb), tmp_path)
    assert results[0]["layouts"] >= 2
    for name in results[0]["sent"]:
        lhs = sum(np.array(r["sent"][name]) for r in results)
        rhs = 2 * np.array(results[0]["delivered"][name]) + sum(np.array(r["left"][name])
                                                                for r in results)
        # float16 values on the wire (the default state) round each step's sum once more
        atol = 1e-6 if kind != "nm_default" else 6 * 2.0 ** -10 * np.abs(lhs).max()
        np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=atol, err_msg=name)


ADAPTIVE = r'''
from fusionring.compression import AdaptiveSchedule
shared = {shared!r}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
ddp = DDP(model, bucket_cap_mb=1000)
schedule = AdaptiveSchedule([(4, 4), (2, 4), (1, 4)], low=0.3, high=0.6, smoothing=0.5, patience=2)
state = hooks.NMState(shared_mask=shared, schedule=schedule)
levels = []

def probe(st, bucket):
    if rank == 1:   # two of every four values zero here, none on rank 0: the ranks' own
        bucket.buffer().view(-1, 4)[:, :2] = 0   # ratios differ, the summed one is shared
    levels.append(list(st.compressor.level(st.key_of(bucket))))
    return hooks.nm_hook(st, bucket)

ddp.register_comm_hook(state, probe)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
for step in range(14):
    g = torch.Generator().manual_seed(100 * rank + step)
    opt.zero_grad()
    ddp(torch.randn(8, 16, generator=g)).square().mean().backward()
    opt.step()
report(dict(levels=levels, params=[p.detach().tolist() for p in model.parameters()]))
finish()
'''


@pytest.mark.parametrize("shared", [True, False], ids=["shared-mask", "per-rank-masks"])
def test_an_adaptive_schedule_moves_every_rank_in_step(tmp_path, shared):
    """The ratio that moves an adaptive schedule is summed over the group, so ranks with
    different gradients still compress each step at one level (their payloads would not
    match otherwise) and end with the same parameters."""
    results = run_ranks(2, RANK_PRELUDE + ADAPTIVE.format(shared=shared), tmp_path, timeout=120)
    assert results[0]["levels"] == results[1]["levels"]
    assert len({tuple(level) for level in results[0]["levels"]}) >= 2   # it did move
    assert results[0]["params"] == results[1]["params"]


OVERFLOW = r'''
kind = {kind!r}
model = torch.nn.Linear(64, 1, bias=False)
ddp = DDP(model, bucket_cap_mb=1000)
state, inner = {{"nm": (hooks.NMState(), hooks.nm_hook),   # float16 values, shared mask
                 "nm_per_rank": (hooks.NMState(shared_mask=False), hooks.nm_hook),
                 "cluster": (hooks.ClusterState(k=4), hooks.cluster_hook)}}[kind]
given = iter([90000.0, 90000.0, 1e5, float("inf"), 0.5, 0.5, 0.5, 0.5])
outputs = []

def probe(st, bucket):
    bucket.buffer().fill_(next(given) * (1 + rank) / 3)
    return inner(st, bucket).then(lambda f: (outputs.append(f.value().tolist()), f.value())[1])

ddp.register_comm_hook(state, probe)
for step in range(8):
    ddp(torch.ones(1, 64)).sum().backward()
report(dict(outputs=outputs))
finish()
'''


@pytest.mark.parametrize("kind", ["nm", "nm_per_rank", "cluster"])
def test_values_near_float16s_range_and_overflowing_steps_do_not_spoil_later_ones(tmp_path, kind):
    """Gradients of 90000 * (r + 1) / 3 on rank r (each fits float16, their sum does not):
    the shared mask's float16 sum does not overflow, as torch's fp16_compress_hook's does
    not. A step with 1e5 (beyond float16) and one with inf give non-finite values that step,
    as any float16 hook does, and the steps after them are finite again."""
    results = run_ranks(2, RANK_PRELUDE + OVERFLOW.format(kind=kind), tmp_path, timeout=120)
    outs = [np.array(o) for o in results[0]["outputs"]]
    mean = 90000.0 * (1 + 2) / 3 / 2
    if kind == "nm":
        # The first step is sent dense: every value arrives, averaged over the two ranks.
        np.testing.assert_allclose(outs[0], mean, rtol=1e-3)
    assert np.isfinite(outs[0]).all()
    for o in outs[4:]:
        assert np.isfinite(o).all(), outs
    for r in results[1:]:
        assert r["outputs"] == results[0]["outputs"]


def test_a_state_of_another_kind_or_a_group_that_is_not_one_is_refused_naming_it():
    import torch
    from fusionring.ddp import hooks
    from fusionring.selection import LayerSelection

    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        hooks.NMState(process_group="gloo")
    with pytest.raises(TypeError, match="process_group"):
        hooks.ClusterState(process_group=1)

    class Bucket:   # never reached: the state is checked first
        pass

    cluster = hooks.ClusterState(k=4)
    with pytest.raises(TypeError, match="nm_hook needs a NMState, not a ClusterState"):
        hooks.nm_hook(cluster, Bucket())
    with pytest.raises(TypeError, match="cluster_hook needs a ClusterState, not a NMState"):
        hooks.cluster_hook(hooks.NMState(), Bucket())
    layers = hooks.LayerSelectionState(selection=LayerSelection.norm(0.5),
                                       model=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="layer_selection_hook needs a LayerSelectionState"):
        hooks.layer_selection_hook(cluster, Bucket())
    assert layers is not None
    # a rank that new_group() left out holds a marker, not a group
    import torch.distributed as dist
    with pytest.raises(ValueError, match="this rank is not a member of the process group"):
        hooks.NMState(process_group=dist.GroupMember.NON_GROUP_MEMBER)
    # another kind's state_dict is named before its configuration is used
    with pytest.raises(ValueError, match="saved by ClusterState, but this is NMState"):
        hooks.NMState.from_state_dict(cluster.state_dict())
    with pytest.raises(ValueError, match="saved by NMState, but this is LayerSelectionState"):
        hooks.LayerSelectionState.from_state_dict(hooks.NMState().state_dict())
    with pytest.raises(TypeError, match="needs a hook state's state_dict"):
        hooks.ClusterState.from_state_dict([1, 2])
    with pytest.raises(TypeError, match="model= must be a torch.nn.Module"):
        hooks.LayerSelectionState(model="x")


WIDE_VALUES = r'''
model = torch.nn.Linear(64, 4, bias=False)
ddp = DDP(model, bucket_cap_mb=1000)
state = hooks.NMState(n=4, m=4, values=torch.float32)   # dense: every value travels
outputs = []

def probe(st, bucket):
    g = torch.Generator().manual_seed(rank)
    bucket.buffer().copy_(torch.randint(-1000, 1000, bucket.buffer().shape, generator=g).float())
    return hooks.nm_hook(st, bucket).then(lambda f: (outputs.append(f.value().tolist()), f.value())[1])

ddp.register_comm_hook(state, probe)
ddp(torch.ones(1, 64)).sum().backward()
report(dict(out=outputs[0]))
finish()
'''


def test_float32_values_are_averaged_as_the_sum_divided_by_the_group_size(tmp_path):
    """Values wider than float16 are summed, then divided by the size in float32 (integer
    inputs: the sum is exact in any order, so the average is known to the bit)."""
    import torch
    results = run_ranks(3, RANK_PRELUDE + WIDE_VALUES, tmp_path)
    inputs = [torch.randint(-1000, 1000, (256,), generator=torch.Generator().manual_seed(r)).float()
              for r in range(3)]
    want = ((inputs[0] + inputs[1] + inputs[2]) / torch.tensor(3.0)).tolist()
    for r in results:
        assert r["out"] == want


SHARED_STATE = r'''
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

state = hooks.NMState(n=2, m=4, values=torch.float32)
first, second = DDP(model()), DDP(model())
for ddp in (first, second):
    ddp.register_comm_hook(state, hooks.nm_hook)
out = {}
x = torch.randn(4, 8)
first(x).sum().backward()
second(x).sum().backward()     # a new model for this state: met afresh, as after a restart
try:
    first(x).sum().backward()  # the first comes back: its buckets would share the second's keys
    out["error"] = None
except Exception as exc:       # noqa: BLE001 - DDP may wrap the hook's error
    out["error"] = str(exc)
# a state per model trains both in turn
a, b = DDP(model()), DDP(model())
a.register_comm_hook(hooks.NMState(n=2, m=4, values=torch.float32), hooks.nm_hook)
b.register_comm_hook(hooks.NMState(n=2, m=4, values=torch.float32), hooks.nm_hook)
for step in range(3):
    for ddp in (a, b):
        ddp(x).sum().backward()
out["own states"] = True
report(out)
finish()
'''


def test_one_state_on_two_ddp_models_training_in_turn_is_refused(tmp_path):
    for out in run_ranks(2, RANK_PRELUDE + SHARED_STATE, tmp_path, timeout=120):
        assert out["error"] is not None and "give each DDP model its own state" in out["error"]
        assert out["own states"]


DIFFERENT_SETTINGS = r'''
from fusionring.ddp.cluster import ClusterState, cluster_hook
from fusionring.ddp.layer_selection import LayerSelectionState, layer_selection_hook
import fusionring.torch as hvd

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

last = size - 1
cases = {
    "n": lambda: (hooks.NMState(n=1 if rank == last else 2, m=4), hooks.nm_hook),
    "mask": lambda: (hooks.NMState(shared_mask=rank != last), hooks.nm_hook),
    "k": lambda: (ClusterState(k=4 if rank == last else 16), cluster_hook),
    "fraction": lambda: (LayerSelectionState(selection=hvd.LayerSelection.norm(
        0.5 if rank == last else 0.25)), layer_selection_hook),
    # seeds may differ by rank: no error
    "seed": lambda: (ClusterState(seed=rank), cluster_hook),
}
out = {}
x = torch.randn(4, 8)
for name, build in cases.items():
    ddp = DDP(model())
    state, hook = build()
    if isinstance(state, LayerSelectionState):
        state.attach(ddp)
    ddp.register_comm_hook(state, hook)
    try:
        for _ in range(2):
            ddp(x).sum().backward()
        out[name] = None
    except Exception as exc:       # noqa: BLE001 - DDP may wrap the hook's error
        out[name] = str(exc)
ones = torch.ones(1)
dist.all_reduce(ones)              # the group still works
out["after"] = ones.item()
report(out)
finish()
'''


def test_ranks_with_different_hook_settings_are_told_on_every_rank(tmp_path):
    """Without the check: a transport abort ('Received data size doesn't match') or a hang."""
    for out in run_ranks(3, RANK_PRELUDE + DIFFERENT_SETTINGS, tmp_path, timeout=120):
        for name, differing in (("n", "n=1"), ("mask", "shared_mask=False"), ("k", "k=4"),
                                ("fraction", "fraction=0.5")):
            assert out[name] is not None and "have different settings" in out[name], (name, out)
            assert "rank 2: " in out[name] and differing in out[name], out[name]
            assert "ranks 0, 1: " in out[name], out[name]
        assert out["seed"] is None and out["after"] == 3.0


ONE_RANK_HOOKED = r'''
from fusionring.ddp.cluster import ClusterState, cluster_hook
torch.manual_seed(0)
ddp = DDP(torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)))
if rank == 0:
    ddp.register_comm_hook(*{"nm": (hooks.NMState(), hooks.nm_hook),
                             "cluster": (ClusterState(), cluster_hook)}[KIND])
for _ in range(3):
    ddp(torch.randn(4, 7)).sum().backward()
report({})
finish()
'''


@pytest.mark.parametrize("kind", ["nm", "cluster"])
def test_a_hook_registered_on_one_rank_only_fails_at_once_instead_of_hanging(tmp_path, kind):
    """The other rank runs DDP's own allreduce of the bucket: the settings handshake must be a
    collective that gloo can tell apart from it (an all_gather waited out the group's timeout,
    30 minutes by default), as torch's own hooks registered on one rank are."""
    results, code, output = run_ranks(2, RANK_PRELUDE + f"KIND = {kind!r}\n" + ONE_RANK_HOOKED,
                                      tmp_path, timeout=60, expect_failure=True)
    assert code != 0 and results == [None, None], output[-3000:]
    assert "collective mismatch" in output or "Connection reset by peer" in output, output[-3000:]
