"""Process sets: operations on subsets of the ranks, with Horovod's semantics."""
from conftest import run_ranks

PROCESS_SETS = r'''
import torch
import fusionring.torch as hvd
even = hvd.ProcessSet([0, 2])
hvd.init(process_sets=[even])
odd = hvd.add_process_set([1, 3])
hvd.init(process_sets=[even])  # again: a no-op
r = hvd.rank()
mine, other = (even, odd) if r % 2 == 0 else (odd, even)
out = {}
out["set"] = [mine.ranks, mine.size(), mine.rank(), mine.included(), other.included(),
              mine.process_set_id > 0, hvd.size()]
x = torch.full((3,), float(r + 1))
out["sum"] = hvd.allreduce(x, op=hvd.Sum, name="x", process_set=mine).tolist()
out["avg"] = hvd.allreduce(x, name="x", process_set=mine).tolist()
out["gather"] = hvd.allgather(torch.full((r + 1, 1), float(r)), process_set=mine).flatten().tolist()
root = mine.ranks[-1]  # a global rank
out["bcast"] = hvd.broadcast(torch.full((2,), float(r)), root_rank=root, process_set=mine).tolist()
# Backward runs on the set too (autograd calls it outside the forward's context).
w = torch.ones(3, requires_grad=True)
hvd.allreduce(w * (r + 1), op=hvd.Sum, process_set=mine).sum().backward()
out["grad"] = w.grad.tolist()
out["objects"] = [hvd.broadcast_object({"from": r}, root_rank=root, process_set=mine),
                  hvd.allgather_object(r * 10, process_set=mine)]
# The same name in flight on a set and globally at once: separate runtimes, no clash.
h_set = hvd.allreduce_async(x, op=hvd.Sum, name="both", process_set=mine)
h_all = hvd.allreduce_async(x, op=hvd.Sum, name="both")
out["async"] = [hvd.synchronize(h_set).tolist(), hvd.synchronize(h_all).tolist()]
try:
    hvd.allreduce(x, process_set=other)
    out["not member"] = "no error"
except ValueError as exc:
    out["not member"] = str(exc)
# broadcast_parameters and broadcast_optimizer_state name themselves, not their broadcasts.
named_errors = []
fresh = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
for call in (lambda: hvd.broadcast_parameters({"w": x.clone()}, 0, process_set=other),
             lambda: hvd.broadcast_optimizer_state(fresh, 0, process_set=other)):
    try:
        call()
        named_errors.append("no error")
    except ValueError as exc:
        named_errors.append(str(exc))
out["broadcasts not member"] = named_errors
out["fresh untouched"] = all(p.grad is None for p in fresh.param_groups[0]["params"])
try:
    hvd.allreduce(x, process_set=hvd.ProcessSet([0, 1]))
    out["not added"] = "no error"
except ValueError as exc:
    out["not added"] = str(exc)
try:
    hvd.broadcast(x, root_rank=other.ranks[0], process_set=mine)
    out["root outside"] = "no error"
except ValueError as exc:
    out["root outside"] = str(exc)

# A DistributedOptimizer per set: each set averages its own gradients.
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), process_set=mine)
for step in range(2):
    opt.zero_grad()
    model(torch.full((2, 4), float(r + step))).sum().backward()
    opt.step()
out["params"] = [p.detach().flatten().tolist() for p in model.parameters()]

# Ranks disagreeing on a set fail alike, and the library keeps working.
try:
    hvd.add_process_set([0, 1] if r == 0 else [0, 3])
    out["disagree"] = "no error"
except ValueError as exc:
    out["disagree"] = str(exc)
# horovod.common.process_sets' lookups: by id, and every registered set.
from fusionring.common import process_sets as hps
out["lookup"] = [hps.process_set_by_id(0) is hvd.global_process_set,
                 hps.process_set_by_id(even.process_set_id) is even,
                 [p.ranks for p in hps.process_sets()]]
try:
    hps.process_set_by_id(99)
except ValueError as exc:
    out["unknown id"] = str(exc)
out["removed"] = hvd.remove_process_set(odd)
out["after remove ids"] = [p.process_set_id for p in hps.process_sets()]
try:
    hvd.allreduce(x, process_set=odd)
    out["after remove"] = "no error"
except ValueError as exc:
    out["after remove"] = str(exc)
out["global"] = hvd.allreduce(x, op=hvd.Sum, name="end").tolist()
report(out)
'''


def _reference_params(ranks):
    """Single process: SGD on the average gradient of `ranks` (the set's members)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    for step in range(2):
        grads = []
        for r in ranks:
            model.zero_grad()
            model(torch.full((2, 4), float(r + step))).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / len(ranks)
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_process_sets(tmp_path):
    import pytest

    results = run_ranks(4, PROCESS_SETS, tmp_path, timeout=90)
    for r, out in enumerate(results):
        ranks = [0, 2] if r % 2 == 0 else [1, 3]
        assert out["set"] == [ranks, 2, ranks.index(r), True, False, True, 4]
        total = float(sum(k + 1 for k in ranks))
        assert out["sum"] == [total] * 3
        assert out["avg"] == [total / 2] * 3
        assert out["gather"] == [float(k) for k in ranks for _ in range(k + 1)]
        assert out["bcast"] == [float(ranks[-1])] * 2
        assert out["async"] == [[total] * 3, [10.0] * 3]
        assert out["grad"] == [2.0 * (r + 1)] * 3  # the set's 2 ranks, not all 4
        assert out["objects"] == [{"from": ranks[-1]}, [10 * k for k in ranks]]
        assert "is not in the process set with ranks" in out["not member"]
        assert out["broadcasts not member"][0].startswith("broadcast_parameters(): rank ")
        assert out["broadcasts not member"][1].startswith("broadcast_optimizer_state(): rank ")
        assert all("is not in the process set" in e for e in out["broadcasts not member"])
        assert out["fresh untouched"]
        assert "has not been added" in out["not added"]
        assert "root_rank" in out["root outside"]
        for got, want in zip(out["params"], _reference_params(ranks)):
            assert got == pytest.approx(want, abs=1e-6)
        assert "ranks disagree on the set" in out["disagree"]
        assert out["lookup"] == [True, True, [[0, 1, 2, 3], [0, 2], [1, 3]]]
        assert out["unknown id"] == "No known process set with id 99"
        assert out["removed"] is True
        assert out["after remove ids"] == [0, 1]
        assert "has not been added" in out["after remove"]
        assert out["global"] == [10.0] * 3


OVERLAPPING_SETS_WITH_GROUPS = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
first, second = hvd.add_process_set([0, 1]), hvd.add_process_set([0, 2])
# Rank 0 wraps an optimizer on each set, ranks 1 and 2 on theirs only: each set's members still
# agree on which optimizer's groups they install.
mine = {0: [first, second], 1: [first], 2: [second]}[r]
out = {}
for pset in mine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), groups=1,
                                   process_set=pset)
    opt.zero_grad()
    model(torch.full((2, 3), float(r + 1))).sum().backward()
    opt.step()
    out[str(pset.ranks)] = [p.detach().flatten().tolist() for p in model.parameters()]
report(out)
'''


def test_optimizers_with_groups_on_overlapping_sets_do_not_wait_on_each_other(tmp_path):
    results = run_ranks(3, OVERLAPPING_SETS_WITH_GROUPS, tmp_path, timeout=90)
    import torch

    def reference(ranks):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sum(model(torch.full((2, 3), float(q + 1))).sum() for q in ranks).div(len(ranks)).backward()
        opt.step()
        return [p.detach().flatten().tolist() for p in model.parameters()]

    for ranks, members in (([0, 1], (0, 1)), ([0, 2], (0, 2))):
        expected = reference(ranks)
        for r in members:
            for got, want in zip(results[r][str(ranks)], expected):
                assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)


SETS_TIMELINE = r'''
import torch
import fusionring.torch as hvd
with_zero, without_zero = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2])
hvd.init(process_sets=[with_zero, without_zero])
r = hvd.rank()
for i in range(5):
    hvd.allreduce(torch.ones(100), name=f"g{i}")
    for process_set in (with_zero, without_zero):
        if process_set.included():
            hvd.allreduce(torch.ones(100), name=f"s{i}", process_set=process_set)
hvd.shutdown()
report(r)
'''


def test_process_sets_record_into_the_one_timeline_file(tmp_path):
    # Each set's runtime used to open FUSIONRING_TIMELINE on its own rank 0, so several
    # processes wrote one file and the JSON came out corrupt.
    import json
    path = tmp_path / "timeline.json"
    run_ranks(3, SETS_TIMELINE, tmp_path, timeout=90, env={"FUSIONRING_TIMELINE": str(path)})
    events = json.loads(path.read_text())
    lanes = {e["args"]["name"] for e in events if e.get("ph") == "M"}
    assert {f"allreduce.g{i}" for i in range(5)} <= lanes
    assert {f"[ranks 0,1] allreduce.s{i}" for i in range(5)} <= lanes
    assert not any(lane.startswith("[ranks 1,2]") for lane in lanes)  # recorded on rank 0 only


FROM_COMMUNICATORS = r'''
import torch
import fusionring.torch as hvd
from fusionring import process_sets
from mpi4py import MPI
world = MPI.COMM_WORLD
r, size = world.Get_rank(), world.Get_size()
# Horovod's "static process sets from MPI communicators": made before init(), and each rank
# names its own half.
half = world.Split(color=r % 2, key=r)
split = hvd.ProcessSet(half)
named = [split, hvd.ProcessSet([0]), hvd.ProcessSet(list(range(size - 1, -1, -1))),
         hvd.ProcessSet([0])]
hvd.init(world, process_sets=named)
out = {"ids": [p.process_set_id for p in named], "split": split.ranks}
out["sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="half",
                           process_set=split).item()
out["zero"] = hvd.allreduce(torch.tensor([5.0]), op=hvd.Sum, name="zero",
                            process_set=named[3]).item() if r == 0 else None
hvd.shutdown()
# A list of communicators: the first is the global one, the others process sets; clones of
# the world and of a set already named add nothing.
hvd.init(comm=[world, half, world.Dup(), half.Dup()])
out["registered"] = sorted((i, p.ranks) for i, p in process_sets._registered.items())
out["after list"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="all").item()
# A set made from a copy of the world is the global set.
whole = hvd.ProcessSet(world.Dup())
hvd.init(process_sets=[whole])
out["whole"] = [whole.process_set_id, hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="whole",
                                                    process_set=whole).item()]
hvd.shutdown()
report(out)
'''


def test_process_sets_from_communicators(tmp_path):
    results = run_ranks(4, FROM_COMMUNICATORS, tmp_path, timeout=90)
    evens, odds = [0, 2], [1, 3]
    for r, out in enumerate(results):
        # Rank 0's sets come first: [0, 2] is set 1, [0] set 2; the odd half, new on rank 1,
        # is set 3. The reversed world is the global set (0); the second [0] a repeat.
        assert out["ids"] == [1 if r % 2 == 0 else 3, 2, 0, 2]
        assert out["split"] == (evens if r % 2 == 0 else odds)
        assert out["sum"] == (2.0 if r % 2 == 0 else 4.0)
        assert out["zero"] == (5.0 if r == 0 else None)
        assert out["registered"] == [[1, evens], [2, odds]]  # numbered from 1 again
        assert out["after list"] == 4.0
        assert out["whole"] == [0, 4.0]


SET_ENDINGS = r'''
import time, torch
import fusionring.torch as hvd
pair = hvd.ProcessSet([1, 2])
hvd.init(process_sets=[pair])
r = hvd.rank()
out = {"unadded": [hvd.ProcessSet([0, 1]).size(), hvd.ProcessSet([0, 1]).rank(),
                   hvd.ProcessSet([0, 1]).included()]}
out["not ints"] = []
for ranks in ([0, 1.5], [0, "1"], [0, True], 7):
    try:
        hvd.ProcessSet(ranks)
    except Exception as exc:  # noqa: BLE001
        out["not ints"].append(type(exc).__name__)
# A pending operation of a set that every rank removes fails saying so.
first = hvd.add_process_set([0, 2])
if r == 0:
    handle = hvd.allreduce_async(torch.ones(2), name="left.alone", process_set=first)
time.sleep(0.5)
hvd.remove_process_set(first)
out["removed"] = [first.size(), first.rank(), first.included()]
if r == 0:
    try:
        hvd.synchronize(handle)
    except Exception as exc:  # noqa: BLE001
        out["pending"] = str(exc)
# A member that shuts down is named by its global rank.
if r == 1:
    try:
        hvd.allreduce(torch.ones(2), name="waits.on.2", process_set=pair)
    except Exception as exc:  # noqa: BLE001
        out["peer"] = str(exc)
elif r == 2:
    time.sleep(1.0)
    pair._runtime.shutdown()
report(out)
'''


def test_a_removed_set_and_a_member_that_leaves_are_named(tmp_path):
    results = run_ranks(3, SET_ENDINGS, tmp_path, timeout=90)
    for r, out in enumerate(results):
        # As in Horovod: size and rank are None, membership is known from the ranks.
        assert out["unadded"] == [None, None, r in (0, 1)]
        assert out["removed"] == [None, None, r in (0, 2)]
        assert out["not ints"] == ["ValueError"] * 4, out
    assert results[0]["pending"] == ("process set [0, 2] was removed (remove_process_set) while "
                                     "this operation on it was pending")
    assert "because rank(s) 2 shut down" in results[1]["peer"], results[1]


SET_CYCLES = r'''
import torch
import fusionring.torch as hvd
hvd.init()

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

sums, sizes = [], []
for k in range(45):
    if k == 5:
        start = rss_mb()  # after the first sets have warmed every cache up
    pair = hvd.add_process_set([0, 1])
    if hvd.rank() in (0, 1):
        sums.append(hvd.allreduce(torch.ones(1000) * (hvd.rank() + 1), op=hvd.Sum,
                                  name="cycle", process_set=pair)[0].item())
    hvd.remove_process_set(pair)
report({"growth": rss_mb() - start, "sums": sorted(set(sums))})
'''


def test_adding_and_removing_sets_holds_no_memory(tmp_path):
    """Each removed set frees its shared memory (about 4 MB a rank) at once, not at exit."""
    results = run_ranks(3, SET_CYCLES, tmp_path, timeout=120)
    for r, out in enumerate(results):
        assert out["sums"] == ([3.0] if r < 2 else []), out
        assert out["growth"] < 40, out  # 40 cycles kept 160 MB a rank before


INIT_ON_LISTED_RANKS = r'''
import torch
from mpi4py import MPI
import fusionring.torch as hvd
world = MPI.COMM_WORLD.Get_rank()
if world < 2:    # rank 2 never calls init(), as with Horovod's MPI_Comm_create_group
    hvd.init(comm=[0, 1])
    report(dict(size=hvd.size(), rank=hvd.rank(),
                total=hvd.allreduce(torch.ones(2) * (world + 1), op=hvd.Sum, name="x").tolist()))
    hvd.shutdown()
else:
    try:
        hvd.init(comm=[0, 1])
        report("no error")
    except ValueError as exc:
        report(str(exc))
'''


def test_init_with_a_list_of_ranks_needs_only_those_ranks(tmp_path):
    results = run_ranks(3, INIT_ON_LISTED_RANKS, tmp_path, timeout=60)
    assert results[0] == {"size": 2, "rank": 0, "total": [3.0, 3.0]}
    assert results[1] == {"size": 2, "rank": 1, "total": [3.0, 3.0]}
    assert results[2] == "rank 2 is not among the ranks [0, 1] passed to init()"
