"""Plan-based fusion inside training: groups fused as planned, reproducible, observable."""
import json
import re

import pytest
import torch

from conftest import run_ranks

TRAIN = r'''
import json, os, torch
import torch.nn.functional as F
import fusionring.torch as hvd
from fusionring.plan import make_plan

hvd.init()
def build():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 4))
model = build()
plan = make_plan(build(), torch.randn(8, 32), buffer_bytes=BUFFER) if BUFFER else None
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), grouping_plan=plan)
g = torch.Generator().manual_seed(1 + hvd.rank())
batches_per_step = []
for step in range(4):
    before = hvd.communication_stats()["allreduce_batches"]
    optimizer.zero_grad()
    F.cross_entropy(model(torch.randn(8, 32, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
    optimizer.step()
    batches_per_step.append(hvd.communication_stats()["allreduce_batches"] - before)
stats = hvd.communication_stats()
report({"params": [p.detach().view(-1).tolist() for p in model.parameters()],
        "batches_per_step": batches_per_step,
        "groups": len(plan.groups) if plan else None,
        "planned_bytes": sorted(plan.group_bytes) if plan else None,
        "batch_bytes": stats["batch_bytes"][-batches_per_step[-1]:]})
'''


def _train(np_, buffer, tmp_path, env=None):
    return run_ranks(np_, TRAIN.replace("BUFFER", str(buffer)), tmp_path, timeout=120, env=env)


def test_plan_groups_are_fused_as_planned_and_reproducible(tmp_path):
    first = _train(3, 8192, tmp_path / "a")
    again = _train(3, 8192, tmp_path / "b")
    unplanned = _train(3, 0, tmp_path / "c")
    groups = first[0]["groups"]
    assert groups >= 3
    for rank_result in first:
        assert rank_result["params"] == first[0]["params"]          # ranks agree
        assert rank_result["batches_per_step"] == [groups] * 4    # one reduction per group
        assert sorted(rank_result["batch_bytes"]) == first[0]["planned_bytes"]
    assert again[0]["params"] == first[0]["params"]               # bitwise, run to run
    for a, b in zip(first[0]["params"], unplanned[0]["params"]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


def test_timeline_has_a_span_per_group_and_phase(tmp_path):
    # Threshold fusion packs whatever is ready into a buffer and unpacks it afterwards.
    path = tmp_path / "threshold.json"
    _train(2, 0, tmp_path / "threshold", env={"FUSIONRING_TIMELINE": str(path),
                                              "FUSIONRING_TIMELINE_MARK_CYCLES": "1",
                                              "FUSIONRING_SHARED_MEMORY": "off"})
    events = json.loads(path.read_text())
    phases = {e["args"]["phase"] for e in events if e.get("ph") == "X"}
    assert {"negotiate", "operation", "pack", "reduce", "unpack"} <= phases
    # Under Horovod's names for the same activities.
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "RING_ALLREDUCE",
            "MEMCPY_OUT_FUSION_BUFFER"} <= names
    assert any(e["name"] == "CYCLE_START" and e["ph"] == "i" for e in events)
    # Each batch's processing span holds its pack, reduce and unpack.
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    for op in (e for e in events if e.get("name") == "ALLREDUCE"):
        inner = [e for e in events if e.get("ph") == "X" and e["tid"] == op["tid"]
                 and e["args"]["phase"] in ("pack", "reduce", "unpack")
                 and op["ts"] <= e["ts"] <= op["ts"] + op["dur"]]
        assert inner and all(e["ts"] + e["dur"] <= op["ts"] + op["dur"] + 1 for e in inner), \
            lanes[op["tid"]]
    # A plan's gradients already live in their group's buffer: reduced where they lie.
    path = tmp_path / "plan.json"
    _train(2, 8192, tmp_path / "plan", env={"FUSIONRING_TIMELINE": str(path),
                                            "FUSIONRING_SHARED_MEMORY": "off"})
    events = json.loads(path.read_text())
    # Each group is submitted and negotiated as one tensor, named for its members.
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    group_lane = re.compile(r"allreduce\.optimizer\.\d+\.group\d+\[\w[\w.]*\.\.\w[\w.]*\]$")
    group_phases = {e["args"]["phase"] for e in events
                    if e.get("ph") == "X" and group_lane.match(lanes[e["tid"]])}
    assert group_phases == {"negotiate", "operation", "reduce"}


COMPRESSED_TIMELINE = r'''
import json, os, torch
import fusionring.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
compression = {"fp16": hvd.Compression.fp16,
               "nm": hvd.Compression.nm(values=torch.float16)}[os.environ["COMPRESSION"]]
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=compression)
path = os.path.join(os.environ["FR_TEST_OUT"], "timeline.json")
hvd.start_timeline(path)
for step in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
hvd.stop_timeline()
report(json.load(open(path)) if hvd.rank() == 0 else [])
'''


@pytest.mark.parametrize("compression", ["fp16", "nm"])
def test_timeline_shows_compression_phases(compression, tmp_path):
    events = run_ranks(2, COMPRESSED_TIMELINE, tmp_path, timeout=90,
                       env={"COMPRESSION": compression})[0]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [(lanes[e["tid"]], e["args"]["phase"], e["ts"], e["ts"] + e["dur"])
             for e in events if e.get("ph") == "X"]
    assert {"COMPRESS", "DECOMPRESS"} <= {e["name"] for e in events}
    coded = [s for s in spans if s[1] in ("compress", "decompress")]
    if compression == "fp16":
        # Cast by the optimizer in the caller's thread, on each gradient's own lane: every
        # parameter, every step, both ways.
        for phase in ("compress", "decompress"):
            names = [lane for lane, name, _, _ in coded if name == phase]
            assert sorted(set(names)) == sorted(f"allreduce.{n}" for n, _ in
                                                model_names()) and len(names) == 12
    else:
        # Encoded and decoded inside the runtime's reduction, on the batch's codec lane,
        # within the span of that reduction.
        assert {name for _, name, _, _ in coded} == {"compress", "decompress"}
        reduces = [(lane, start, end) for lane, name, start, end in spans if name == "reduce"]
        for lane, _, start, end in coded:
            assert lane.endswith(" (compression)")
            batch = lane[:-len(" (compression)")]
            assert any(l == batch and a <= start and end <= b + 1 for l, a, b in reduces)


def model_names():
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    return list(model.named_parameters())


START_STOP_TIMELINE = r'''
import sys
import torch
import fusionring.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(4), name="before")
hvd.start_timeline(sys.argv[1] if len(sys.argv) > 1 else "tl.json", mark_cycles=True)
hvd.allreduce(torch.ones(4), name="during")
hvd.stop_timeline()
hvd.allreduce(torch.ones(4), name="after")
hvd.start_timeline("tl2.json")  # a second recording, without cycle marks
hvd.allreduce(torch.ones(4), name="second")
hvd.barrier()
hvd.stop_timeline()
report({"ok": True})
'''


def test_start_and_stop_timeline(tmp_path):
    run_ranks(2, START_STOP_TIMELINE, tmp_path, timeout=60)
    events = json.loads((tmp_path / "tl.json").read_text())
    lanes = {e["args"]["name"] for e in events if e.get("ph") == "M"}
    assert "allreduce.during" in lanes and not lanes & {"allreduce.before", "allreduce.after"}
    assert any(e["name"] == "CYCLE_START" for e in events)
    second = json.loads((tmp_path / "tl2.json").read_text())
    assert "allreduce.second" in {e["args"]["name"] for e in second if e.get("ph") == "M"}
    assert not any(e["name"] == "CYCLE_START" for e in second)


DIFFERENT_PLANS = r'''
import torch
import fusionring.torch as hvd
from fusionring.plan import make_plan
hvd.init()
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
plan = make_plan(model, torch.randn(4, 16), buffer_bytes=2048 if hvd.rank() == 0 else 4096)
try:
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=model.named_parameters(), grouping_plan=plan)
    report({"error": None})
except hvd.TensorMismatchError as exc:
    report({"error": str(exc), "after": hvd.allreduce(torch.ones(1), op=hvd.Sum).item()})
'''


def test_ranks_with_different_plans_fail_on_every_rank(tmp_path):
    for out in run_ranks(2, DIFFERENT_PLANS, tmp_path, timeout=60):
        assert out["error"] and "fusion_groups" in out["error"] and "rank 0" in out["error"]
        assert out["after"] == 2.0


def test_plan_not_matching_the_model_lists_the_parameters(tmp_path):
    from fusionring.plan import PlanMismatchError, make_plan

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    plan = make_plan(model, torch.randn(2, 4))
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    with pytest.raises(PlanMismatchError) as info:
        plan.check_model(other)
    assert "0.weight" in str(info.value) and "1.weight" in str(info.value)


GRAD_VIEWS = r'''
import torch
import fusionring.torch as hvd
from fusionring.plan import make_plan
hvd.init()
r, P = hvd.rank(), hvd.size()
def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
out = {}
for planned in (True, False):
    model = build()
    plan = make_plan(build(), torch.randn(2, 8), buffer_bytes=1024) if planned else None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   grouping_plan=plan, backward_passes_per_step=2)
    g = torch.Generator().manual_seed(7 + r)
    for step in range(3):
        opt.zero_grad(set_to_none=(step == 0))  # later steps accumulate into the same tensors
        for _ in range(2):
            model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opt.step()
    key = "plan" if planned else "threshold"
    out[key] = [p.detach().flatten().tolist() for p in model.parameters()]
    if planned:
        storages = {}
        for group in plan.groups:
            ptrs = {dict(model.named_parameters())[n].grad.untyped_storage().data_ptr()
                    for n in group}
            storages[len(storages)] = len(ptrs)
        out["one storage per group"] = all(v == 1 for v in storages.values())
        out["groups"] = len(plan.groups)
report(out)
'''


def test_plan_gradients_live_in_their_group_buffer(tmp_path):
    for out in run_ranks(2, GRAD_VIEWS, tmp_path, timeout=60):
        assert out["groups"] >= 2 and out["one storage per group"] is True
        for a, b in zip(out["plan"], out["threshold"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


MIXED_SIZES = r'''
import torch
import fusionring.torch as hvd
hvd.init()
sizes = [10, 3000, 7, 5000, 20, 1100, 4]          # float32 elements; limit is 4096 bytes
tensors = [torch.arange(n, dtype=torch.float32) % 97 + hvd.rank() for n in sizes]
handles = [hvd.allreduce_async_(t, name=f"mixed.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
for h in handles:
    hvd.synchronize(h)
stats = hvd.communication_stats()
report({"values": [t.tolist() for t in tensors], "batch_bytes": stats["batch_bytes"]})
'''


def test_large_tensors_are_reduced_where_they_lie_not_packed(tmp_path):
    env = {"FUSIONRING_PACK_LIMIT": "4096", "FUSIONRING_SHARED_MEMORY": "off",
           "FUSIONRING_CYCLE_TIME_MS": "20"}
    results = run_ranks(3, MIXED_SIZES, tmp_path, timeout=60, env=env)
    sizes = [10, 3000, 7, 5000, 20, 1100, 4]
    large = sorted(4 * n for n in sizes if 4 * n >= 4096)
    for out in results:
        for n, got in zip(sizes, out["values"]):
            base = torch.arange(n, dtype=torch.float64) % 97
            assert got == (3 * base + 0 + 1 + 2).tolist()
        # every buffer of at least the limit is exactly one large tensor, reduced on its own
        assert sorted(b for b in out["batch_bytes"] if b >= 4096) == large
        assert sum(out["batch_bytes"]) == 4 * sum(sizes)


TWO_OPTIMIZERS = r'''
import torch
import fusionring.torch as hvd
from fusionring import state as runtime
hvd.init()
r, P = hvd.rank(), hvd.size()

def models():
    torch.manual_seed(0)
    return (torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)),
            torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)))

def train(prefixes, ranks, steps=3):
    """Both models, each with its own optimizer; data of `ranks` (all of them: the reference)."""
    first, second = models()
    opts = []
    for model, prefix in zip((first, second), prefixes):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if len(ranks) == 1:
            named = [(prefix + n, p) for n, p in model.named_parameters()]
            opt = hvd.DistributedOptimizer(opt, named_parameters=named, groups=1)
        opts.append(opt)
    kinds = []
    for step in range(steps):
        for model, opt in zip((first, second), opts):
            # Counted from before backward: the group may go out while backward still runs.
            before = dict(runtime.get().scheduler.stats.batches_by_kind)
            opt.zero_grad()
            losses = []
            for q in ranks:
                g = torch.Generator().manual_seed(100 * step + q)
                losses.append(model(torch.randn(5, 4, generator=g)).pow(2).mean())
            (sum(losses) / len(losses)).backward()
            opt.step()
            after = runtime.get().scheduler.stats.batches_by_kind
            kinds.append({k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)})
    return [p.detach() for m in (first, second) for p in m.parameters()], kinds

out = {}
for case, prefixes in (("distinct", ("gen.", "disc.")), ("colliding", ("", ""))):
    params, kinds = train(prefixes, [r])
    reference, _ = train(prefixes, list(range(P)))
    out[case] = {"kinds": kinds,
                 "max_diff": max((a - b).abs().max().item() for a, b in zip(params, reference))}
report(out)
'''


def test_two_optimizers_each_keep_their_fusion_groups(tmp_path):
    """A GAN-style script: two DistributedOptimizers with groups. Each step of either optimizer
    goes out as one planned group (not threshold fusion), and training equals single-process
    training on the global batch; names the two models share fall to the newer optimizer's
    groups without any error."""
    for out in run_ranks(2, TWO_OPTIMIZERS, tmp_path, timeout=120):
        assert out["distinct"]["kinds"] == [{"plan": 1}] * 6, out["distinct"]["kinds"]
        for case in ("distinct", "colliding"):
            assert out[case]["max_diff"] < 1e-6, (case, out[case]["max_diff"])


BAD_GROUPS_THEN_GOOD = r'''
import torch
import fusionring.torch as hvd
from fusionring import state as runtime
hvd.init()
model = torch.nn.Linear(3, 2)
w, b = model.weight, model.bias
try:
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=model.named_parameters(), groups=[[w, w], [b]])
    error = None
except ValueError as exc:
    error = str(exc)
other = torch.nn.Linear(3, 2)  # the refused groups must not linger for another model's optimizer
opt = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                               named_parameters=[("b." + n, p) for n, p in other.named_parameters()],
                               groups=[[other.weight, other.bias]])
stats = runtime.get().scheduler.stats
other(torch.ones(4, 3) * (1 + hvd.rank())).sum().backward()
opt.step()
report({"error": error, "kinds": dict(stats.batches_by_kind),
        "groups": [list(g) for g in runtime.get().scheduler.groups]})
'''


def test_groups_refused_on_every_rank_leave_the_next_optimizer_working(tmp_path):
    for out in run_ranks(2, BAD_GROUPS_THEN_GOOD, tmp_path, timeout=60):
        assert out["error"] is not None and "overlap" in out["error"]
        # The group travels as one tensor, named for its members.
        assert out["groups"] == [["allreduce.optimizer.0.group0[b.weight..b.bias]"]]
        assert out["kinds"] == {"plan": 1}


LIVE_TIMELINE = r'''
import json, os, time, torch
import fusionring.torch as hvd
hvd.init()
hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
time.sleep(0.1)
text = open(os.environ["HOROVOD_TIMELINE"]).read() if hvd.rank() == 0 else ""
hvd.barrier()
report(text)
'''


def test_timeline_is_readable_while_the_job_runs(tmp_path):
    # As Horovod's own timeline test reads it: during the run, under Horovod's names.
    path = tmp_path / "timeline.json"
    text = run_ranks(2, LIVE_TIMELINE, tmp_path, timeout=60, env={
        "HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1"})[0]
    for needle in ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", '"ALLREDUCE"',
                   "CYCLE_START"):
        assert needle in text, needle
    events = json.loads(text)  # a complete array after every flush, as Horovod's
    assert any(e["name"] == "ALLREDUCE" and e["args"]["phase"] == "operation" for e in events)


GROUPS_AS_UNITS = r'''
import copy, torch
import torch.nn as nn
import fusionring.torch as hvd
hvd.init()
R, N = hvd.rank(), hvd.size()
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.d = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x, idx, use_b):
        h = torch.tanh(self.a(x + self.emb(idx)))
        if use_b:
            h = torch.tanh(self.b(h))
        return (self.c(h).double() * self.d).pow(2).mean()

def batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5, 4, generator=g), torch.randint(0, 10, (5,), generator=g)

def uses_b(rank, step):
    return not (rank == 1 and step == 0)   # rank 1 leaves b unused in the first step

model = Net()
reference = copy.deepcopy(model)
m = model
# Group 0 mixes float32, float64 and a sparse gradient; group 1 holds b, unused on a rank.
groups = [[m.a.weight, m.a.bias, m.emb.weight, m.d], [m.b.weight, m.b.bias, m.c.weight, m.c.bias]]
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), groups=groups,
                               backward_passes_per_step=2)
for step in range(3):
    opt.zero_grad()
    for micro in range(2):
        x, idx = batch(R, step, micro)
        model(x, idx, uses_b(R, step)).backward()
    opt.step()

# The same steps in one process: every rank's accumulated gradients, averaged.
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(3):
    total = [torch.zeros_like(p) for p in reference.parameters()]
    for rank in range(N):
        reference.zero_grad()
        for micro in range(2):
            x, idx = batch(rank, step, micro)
            reference(x, idx, uses_b(rank, step)).backward()
        for t, p in zip(total, reference.parameters()):
            if p.grad is not None:
                t += p.grad.to_dense()
    for t, p in zip(total, reference.parameters()):
        p.grad = t / N
    ref_opt.step()

errors = {n: (p.detach() - q.detach()).abs().max().item()
          for (n, p), q in zip(model.named_parameters(), reference.parameters())}
from fusionring import state as runtime

# Horovod's check: a second backward of a reduced parameter before step() is refused.
second = nn.Linear(2, 2)
opt2 = hvd.DistributedOptimizer(torch.optim.SGD(second.parameters(), lr=0.1),
                                named_parameters=[("s." + n, p) for n, p in second.named_parameters()],
                                groups=[[second.weight, second.bias]])
second(torch.ones(1, 2)).sum().backward()
try:
    second(torch.ones(1, 2)).sum().backward()
    refused = None
except AssertionError as exc:
    refused = str(exc)
opt2.synchronize()
lanes = sorted(name for group in runtime.get().scheduler.groups for name in group)
report({"errors": errors, "sparse": model.emb.weight.grad.is_sparse, "groups": lanes,
        "refused": refused})
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_groups_travel_as_one_tensor_each(np_, tmp_path):
    """Each group's gradients are reduced as one tensor per dtype; sparse gradients in a
    group go on their own, a parameter unused on one rank contributes zeros, and local
    accumulation still works: the result is single-process SGD on the averaged gradients."""
    for out in run_ranks(np_, GROUPS_AS_UNITS, tmp_path, timeout=120):
        assert max(out["errors"].values()) < 1e-6, out["errors"]
        assert out["sparse"]  # an Embedding(sparse=True) keeps sparse gradients
        # One runtime group per unit, named for its members (the sparse one included).
        assert out["groups"] == ["allreduce.optimizer.0.group0.float32[a.weight..emb.weight]",
                                 "allreduce.optimizer.0.group0.float64[d]",
                                 "allreduce.optimizer.0.group1[b.weight..c.bias]",
                                 "allreduce.optimizer.1.group0[s.weight..s.bias]"]
        assert out["refused"] is not None and "backward_passes_per_step" in out["refused"]


# A three-layer model on every rank and its single-process twin (WIDTH hidden units).
SEQUENTIAL_AND_TWIN = r'''
import copy, os, torch
import torch.nn as nn
import fusionring.torch as hvd
from fusionring import state as runtime
hvd.init()
R, N = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                      nn.Linear(WIDTH, 3))
reference = copy.deepcopy(model)

def twin_error(steps):
    """Largest difference from the twin trained in one process on every rank's gradients,
    averaged (momentum SGD, lr 0.3; `forward(m, rank, step)` is the script's)."""
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
    for step in range(steps):
        total = [torch.zeros_like(p) for p in reference.parameters()]
        for rank in range(N):
            reference.zero_grad()
            forward(reference, rank, step).backward()
            for t, p in zip(total, reference.parameters()):
                if p.grad is not None:
                    t += p.grad
        for t, p in zip(total, reference.parameters()):
            p.grad = t / N
        ref_opt.step()
    return max((p - q).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))
'''


FP16_GROUPS = SEQUENTIAL_AND_TWIN.replace("WIDTH", "32") + r'''
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                               named_parameters=model.named_parameters(), groups=2,
                               compression=hvd.Compression.fp16)

def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g)

stats = runtime.get().stats
before = stats.allreduce_bytes
for step in range(3):
    opt.zero_grad()
    model(batch(R, step)).pow(2).mean().backward()
    opt.step()
sent = stats.allreduce_bytes - before

# One process: every rank's gradients, each rounded to float16 as the wire does, averaged.
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
for step in range(3):
    total = [torch.zeros_like(p, dtype=torch.float64) for p in reference.parameters()]
    for rank in range(N):
        reference.zero_grad()
        reference(batch(rank, step)).pow(2).mean().backward()
        for t, p in zip(total, reference.parameters()):
            t += p.grad.half().double()
    for t, p in zip(total, reference.parameters()):
        p.grad = (t / N).float()
    ref_opt.step()
error = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
numel = sum(p.numel() for p in model.parameters())
report({"error": error, "sent": sent, "fp32_bytes": 3 * numel * 4,
        "groups": sorted(n for g in runtime.get().scheduler.groups for n in g)})
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_fp16_compresses_each_group_buffer_whole(np_, tmp_path):
    """With Compression.fp16 a group's buffer travels as one float16 tensor: half the bytes,
    and the averaged float16 gradients of a single-process reference."""
    for out in run_ranks(np_, FP16_GROUPS, tmp_path, timeout=120):
        assert out["error"] < 1e-4, out["error"]
        assert out["sent"] == out["fp32_bytes"] // 2
        assert out["groups"] == ["allreduce.optimizer.0.group0[0.weight..2.weight]",
                                 "allreduce.optimizer.0.group1[2.bias..4.bias]"]


AUTO_GROUPS = SEQUENTIAL_AND_TWIN.replace("WIDTH", "64") + r'''
kwargs = {} if os.environ.get("FUSIONRING_GROUPING_PLAN") else {"grouping_plan": "auto"}
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
                               named_parameters=model.named_parameters(), **kwargs)

def forward(m, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 6, generator=g)
    h = m[1](m[0](x))
    if not (rank == 0 and step == 0):   # rank 0 skips the middle layer in the first step
        h = m[3](m[2](h))
    return m[4](h).pow(2).mean()

groups_after, requests = [], []
stats = runtime.get().stats
for step in range(4):
    before = stats.allreduce_tensors
    opt.zero_grad()
    forward(model, R, step).backward()
    opt.step()
    groups_after.append(sorted(n for g in runtime.get().scheduler.groups for n in g))
    requests.append(stats.allreduce_tensors - before)

error = twin_error(4)
import hashlib
bits = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
report({"error": error, "groups": groups_after, "requests": requests, "bits": bits.hexdigest()})
'''


def test_auto_grouping_learns_rank_zeros_order_in_the_first_step(tmp_path):
    """grouping_plan="auto" (or FUSIONRING_GROUPING_PLAN=auto) reduces each gradient on its
    own in the first step, then fuses groups made from rank 0's ready order on every rank.
    Rank 0 skipped the middle layer in that step, so its two gradients get groups of their
    own (the other ranks saw them); training equals one process's, bit for bit run to run."""
    runs = [run_ranks(3, AUTO_GROUPS, tmp_path / "argument", timeout=120),
            run_ranks(3, AUTO_GROUPS, tmp_path / "environment", timeout=120,
                      env={"FUSIONRING_GROUPING_PLAN": "auto"})]
    for outs in runs:
        for out in outs:
            assert out["error"] < 1e-6, out["error"]
            assert out["groups"] == outs[0]["groups"]
            assert out["bits"] == runs[0][0]["bits"]  # every rank, both runs
            # One request per gradient in the first step, then one per group.
            assert out["requests"] == [6, 3, 3, 3], out["requests"]
        # Rank 0's backward order: the last layer first, the first layer last.
        assert outs[0]["groups"][1:] == [["allreduce.optimizer.0.group0[4.bias..0.weight]",
                                          "allreduce.optimizer.0.group1[2.weight]",
                                          "allreduce.optimizer.0.group2[2.bias]"]] * 3


THRESHOLD_BUFFER = SEQUENTIAL_AND_TWIN.replace("WIDTH", "16") + r'''
import hashlib
# The middle layer in float64: its 2 KiB weight is above the pack limit (reduced where it lies).
model[2].double()
reference[2].double()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
                               named_parameters=model.named_parameters())

def forward(m, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    h = m[1](m[0](torch.randn(8, 6, generator=g)))
    if not (rank == 1 and step == 3):   # rank 1 skips the middle layer once
        h = m[3](m[2](h.double()).float())
    return m[4](h).pow(2).mean()

stats = runtime.get().stats
packed, storages = [], []
for step in range(5):
    before = stats.packed_bytes
    opt.zero_grad()
    forward(model, R, step).backward()
    opt.step()
    packed.append(stats.packed_bytes - before)
    storages.append(len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}))

error = twin_error(5)

# backward(create_graph=True): the gradient keeps its graph (it is not moved into the buffer).
opt.zero_grad()
forward(model, R, 0).backward(create_graph=True)
opt.synchronize()
graph = model[0].weight.grad.requires_grad
with opt.skip_synchronize():
    opt.step()
bits = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
report({"error": error, "packed": packed, "storages": storages, "graph": graph,
        "bits": bits.hexdigest()})
'''


def test_threshold_fusion_reduces_gradients_where_they_lie(tmp_path):
    """Without a plan, the gradients below the pack limit live in one buffer after the first
    step, laid out in ready order: threshold fusion's batches are then reduced in place (no
    bytes packed) and training is the averaged single-process run, bit for bit the same as
    with FUSIONRING_GRADIENT_BUFFER=0, which packs what it fuses."""
    env = {"FUSIONRING_SHARED_MEMORY": "off", "FUSIONRING_PACK_LIMIT": "1024"}
    on = run_ranks(3, THRESHOLD_BUFFER, tmp_path / "on", timeout=120, env=env)
    off = run_ranks(3, THRESHOLD_BUFFER, tmp_path / "off", timeout=120,
                    env={**env, "FUSIONRING_GRADIENT_BUFFER": "0"})
    for a, b in zip(on, off):
        assert a["error"] < 1e-6 and b["error"] < 1e-6, (a["error"], b["error"])
        assert a["bits"] == b["bits"] == on[0]["bits"]
        assert a["graph"] and b["graph"]
        # Two dtypes below the limit -> two buffers, plus the 1 KiB weight on its own.
        assert a["storages"][1:3] == [3, 3], a["storages"]
        assert b["storages"][1] == 6
        assert a["packed"][0] > 0 and a["packed"][1:3] == [0, 0], a["packed"]
        assert sum(b["packed"][1:]) > 0, b["packed"]  # what a cycle fuses is packed


HOROVOD_GROUPS = r'''
import torch
import fusionring.torch as hvd
from fusionring import state as runtime
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(3)])
p = list(model.parameters())
out = {}
for case, groups in (("int", 4), ("list", [[p[0], p[1]], [p[4], p[5]]])):
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=groups)
    out[case] = [list(g) for g in runtime.get().scheduler.groups]
    hvd.shutdown()
    hvd.init()
report(out)
'''


def test_groups_are_formed_as_horovod_forms_them(tmp_path):
    """groups=4 over 6 parameters: Horovod's split_list gives 2, 2, 1, 1 (rounding gave 2, 1, 1, 2);
    groups as lists: a parameter in no list is a group of its own (it was left to threshold
    fusion, fused with whatever was ready)."""
    for out in run_ranks(2, HOROVOD_GROUPS, tmp_path, timeout=60):
        members = {case: [g[0].split("[", 1)[1].rstrip("]") for g in groups]
                   for case, groups in out.items()}
        assert members["int"] == ["0.weight..0.bias", "1.weight..1.bias", "2.weight", "2.bias"]
        assert members["list"] == ["0.weight..0.bias", "2.weight..2.bias", "1.weight", "1.bias"]
