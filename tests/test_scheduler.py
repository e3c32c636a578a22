"""The online scheduler: plan groups, the not-yet list, threshold fusion, determinism, statistics."""
import math
import random

import pytest
import torch
import torch.nn as nn

from fusionring.plan import make_plan, partition_sizes
from fusionring.scheduler import (PARTIAL, PLAN, SINGLE, THRESHOLD, Entry, FusionScheduler,
                                  tensor_groups_from_plan)


def entries(spec, key="f32"):
    """Entries from {name: nbytes} (or a list of (name, nbytes)), all with one fusion key."""
    items = spec.items() if isinstance(spec, dict) else spec
    return [Entry(name, nbytes, key) for name, nbytes in items]


def names(batches):
    return [b.names for b in batches]


def kinds(batches):
    return [b.kind for b in batches]


SIZES = {"a": 10, "b": 20, "c": 30, "d": 40, "e": 50}


def by_name(*ns, key="f32"):
    return [Entry(n, SIZES[n], key) for n in ns]


def test_a_complete_group_is_one_batch_in_plan_order():
    s = FusionScheduler([["a", "b", "c"], ["d", "e"]], threshold_bytes=1000)
    batches = s.schedule(by_name("c", "a", "b"))
    assert names(batches) == [["a", "b", "c"]]
    assert kinds(batches) == [PLAN]
    assert batches[0].group_id == 0 and batches[0].nbytes == 60
    assert s.pending == ()


def test_an_incomplete_group_waits_for_the_next_cycle():
    s = FusionScheduler([["a", "b", "c"], ["d", "e"]], threshold_bytes=1000)
    assert s.schedule(by_name("a", "d", "b")) == []
    assert s.pending == ("a", "d", "b")
    batches = s.schedule(by_name("e", "c"))
    # Both groups complete this cycle: plan-group order, each in plan order.
    assert names(batches) == [["a", "b", "c"], ["d", "e"]]
    assert s.pending == ()
    assert s.stats.held_cycles == {1: 3, 0: 2}
    assert s.stats.mean_held_cycles == pytest.approx(3 / 5)


def test_a_group_spread_over_several_cycles_waits_until_the_last_member():
    s = FusionScheduler([["a", "b", "c", "d"]], threshold_bytes=1000)
    assert s.schedule(by_name("a")) == []
    assert s.schedule([]) == []
    assert s.schedule(by_name("b", "c")) == []
    assert names(s.schedule(by_name("d"))) == [["a", "b", "c", "d"]]
    assert s.stats.held_cycles == {3: 1, 1: 2, 0: 1}


def test_flush_releases_incomplete_groups_as_partial_batches():
    s = FusionScheduler([["a", "b", "c"], ["d", "e"]], threshold_bytes=1000)
    s.schedule(by_name("a", "c", "e"))
    batches = s.schedule([], flush=True)
    assert names(batches) == [["a", "c"], ["e"]]
    assert kinds(batches) == [PARTIAL, PARTIAL]
    assert [b.group_id for b in batches] == [0, 1]
    assert s.pending == ()
    assert s.schedule([], flush=True) == []


def test_max_hold_cycles_releases_a_group_that_does_not_complete():
    s = FusionScheduler([["a", "b"]], threshold_bytes=1000, max_hold_cycles=2)
    assert s.schedule(by_name("a")) == []
    assert s.schedule([]) == []
    batches = s.schedule([])
    assert names(batches) == [["a"]] and kinds(batches) == [PARTIAL]
    # b now arrives alone; its group is held again until it too goes stale.
    assert s.schedule(by_name("b")) == []
    assert s.pending == ("b",)


def test_threshold_fusion_packs_consecutive_entries_up_to_the_threshold():
    s = FusionScheduler(None, threshold_bytes=100)
    spec = [("t0", 40), ("t1", 40), ("t2", 40), ("big", 120), ("t3", 10), ("t4", 60), ("t5", 50),
            ("t6", 50)]
    batches = s.schedule(entries(spec))
    assert names(batches) == [["t0", "t1"], ["t2"], ["big"], ["t3", "t4"], ["t5", "t6"]]
    assert kinds(batches) == [THRESHOLD, SINGLE, SINGLE, THRESHOLD, THRESHOLD]
    assert all(b.nbytes <= 100 for b in batches if b.kind != SINGLE)


def test_threshold_zero_reduces_every_tensor_alone():
    s = FusionScheduler(None, threshold_bytes=0)
    batches = s.schedule(entries([("x", 1), ("y", 1), ("z", 1)]))
    assert names(batches) == [["x"], ["y"], ["z"]]
    assert kinds(batches) == [SINGLE] * 3


def test_threshold_fusion_never_mixes_fusion_keys():
    s = FusionScheduler(None, threshold_bytes=1000)
    response = [Entry("p", 1, "f32"), Entry("q", 1, "f32"), Entry("r", 1, "f16"),
                Entry("s", 1, "f32")]
    assert names(s.schedule(response)) == [["p", "q"], ["r"], ["s"]]


def test_a_plan_group_with_mixed_keys_is_split_by_key():
    s = FusionScheduler([["a", "b", "c", "d"]], threshold_bytes=1000)
    response = [Entry("a", 10, ("float32", "sum")), Entry("b", 20, ("float16", "sum")),
                Entry("c", 30, ("float32", "sum")), Entry("d", 40, ("float16", "sum"))]
    batches = s.schedule(response)
    assert names(batches) == [["a", "c"], ["b", "d"]]
    assert kinds(batches) == [PLAN, PLAN]
    for b in batches:
        assert len({e.fusion_key for e in b}) == 1


def test_tensors_outside_the_plan_follow_the_plan_batches():
    s = FusionScheduler([["a", "b"]], threshold_bytes=1000)
    batches = s.schedule([Entry("x", 5), Entry("a", 10), Entry("y", 5), Entry("b", 20)])
    assert names(batches) == [["a", "b"], ["x", "y"]]
    assert kinds(batches) == [PLAN, THRESHOLD]


def test_payload_is_carried_untouched():
    tensor = torch.zeros(3)
    s = FusionScheduler([["a"]], threshold_bytes=1000)
    (batch,) = s.schedule([Entry("a", 12, "k", payload=tensor)])
    assert batch[0].payload is tensor


def test_runtime_objects_with_the_entry_attributes_are_accepted():
    class Request:
        def __init__(self, name, nbytes):
            self.name, self.nbytes, self.fusion_key = name, nbytes, "k"

    s = FusionScheduler([["a", "b"]], threshold_bytes=1000)
    reqs = [Request("b", 4), Request("a", 4)]
    (batch,) = s.schedule(reqs)
    assert [e is r for e, r in zip(batch, [reqs[1], reqs[0]])] == [True, True]


def test_a_name_already_waiting_cannot_be_submitted_again():
    s = FusionScheduler([["a", "b"]], threshold_bytes=1000)
    s.schedule(by_name("a"))
    with pytest.raises(ValueError, match="already waiting"):
        s.schedule(by_name("a"))
    with pytest.raises(ValueError, match="already waiting"):
        s.schedule([Entry("x", 1), Entry("x", 1)])


def test_overlapping_groups_are_rejected():
    with pytest.raises(ValueError, match="must not overlap"):
        FusionScheduler([["a", "b"], ["b", "c"]], threshold_bytes=10)


def test_reset_drops_the_not_yet_list_and_returns_it():
    s = FusionScheduler([["a", "b"], ["c", "d"]], threshold_bytes=1000)
    held = by_name("c", "a")
    s.schedule(held)
    assert s.reset() == held
    assert s.pending == ()
    assert s.schedule(by_name("b")) == []
    assert s.pending == ("b",)


def test_threshold_defaults_to_the_setting(monkeypatch):
    from fusionring.config import settings
    monkeypatch.setenv("FUSIONRING_FUSION_THRESHOLD", "12345")
    settings(reload=True)
    try:
        assert FusionScheduler(None).threshold_bytes == 12345
    finally:
        monkeypatch.delenv("FUSIONRING_FUSION_THRESHOLD")
        settings(reload=True)


# ------------------------------------------------------------------------------------------
# A simulated backward pass: tensors become ready in ready order, a few per cycle


def simulate(scheduler, ordered, rng, max_per_cycle=4):
    """Feed ``ordered`` entries in random-sized chunks, then flush; return every batch."""
    batches, i = [], 0
    while i < len(ordered):
        n = rng.randint(0, max_per_cycle)
        batches += scheduler.schedule(ordered[i:i + n])
        i += n
    batches += scheduler.schedule([], flush=True)
    return batches


def test_same_input_gives_the_same_batches_on_every_rank():
    rng = random.Random(7)
    sizes = [rng.randint(1, 500) for _ in range(80)]
    ordered = [Entry(f"t{i}", s, "k" if i % 7 else "other") for i, s in enumerate(sizes)]
    groups = [[f"t{i}" for i in range(a, b)] for a, b in partition_sizes(sizes, 2000)]
    runs = []
    for _ in range(2):  # two "ranks": same response lists, same decisions
        s = FusionScheduler(groups, threshold_bytes=1500)
        runs.append([(b.kind, b.group_id, b.names) for b in simulate(s, ordered, random.Random(3))])
    assert runs[0] == runs[1]
    delivered = sorted(n for _, _, ns in runs[0] for n in ns)
    assert delivered == sorted(e.name for e in ordered)


def test_a_balanced_plan_gives_even_buffers_where_threshold_fusion_does_not():
    rng = random.Random(11)
    sizes = [rng.choice([256, 1024, 4096, 16384, 65536]) for _ in range(200)]
    ordered = [Entry(f"g{i}", s, "f32") for i, s in enumerate(sizes)]
    buffer = 512 * 1024
    groups = [[f"g{i}" for i in range(a, b)] for a, b in partition_sizes(sizes, buffer)]
    planned = FusionScheduler(groups, threshold_bytes=buffer)
    batches = simulate(planned, ordered, random.Random(1))
    # Every batch is exactly one whole plan group, so buffer sizes are the plan's.
    assert kinds(batches) == [PLAN] * len(groups)
    assert names(batches) == groups
    group_bytes = [sum(e.nbytes for e in ordered if e.name in set(g)) for g in groups]
    mean = sum(group_bytes) / len(group_bytes)
    expected_cv = math.sqrt(sum((b - mean) ** 2 for b in group_bytes) / len(group_bytes)) / mean
    assert planned.stats.coefficient_of_variation == pytest.approx(expected_cv)
    assert planned.stats.coefficient_of_variation < 0.15
    assert planned.stats.batches == len(groups)
    assert planned.stats.total_bytes == sum(sizes)
    # Horovod-style threshold fusion fuses whatever is ready in the cycle: uneven buffers.
    threshold = FusionScheduler(None, threshold_bytes=buffer)
    simulate(threshold, ordered, random.Random(1))
    assert threshold.stats.coefficient_of_variation > 3 * planned.stats.coefficient_of_variation
    assert threshold.stats.batches > planned.stats.batches


def test_stats_summarise_batch_sizes():
    s = FusionScheduler(None, threshold_bytes=0)
    s.schedule(entries([("a", 100), ("b", 300)]))
    d = s.stats.as_dict()
    assert d["batches"] == 2 and d["cycles"] == 1
    assert d["mean_batch_bytes"] == 200 and d["std_batch_bytes"] == 100
    assert d["coefficient_of_variation"] == pytest.approx(0.5)
    assert d["min_batch_bytes"] == 100 and d["max_batch_bytes"] == 300
    assert d["batches_by_kind"] == {"single": 2}
    assert list(s.stats.recent_batch_bytes) == [100, 300]


# ------------------------------------------------------------------------------------------
# From a plan to tensor-name groups


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.spare = nn.Linear(4, 4)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def test_plan_groups_become_tensor_name_groups():
    p = make_plan(Small(), torch.randn(2, 8), buffer_bytes=256)
    groups = tensor_groups_from_plan(p, lambda name: "allreduce." + name)
    used = [g for i, g in enumerate(p.groups) if not p.is_unused_group(i)]
    assert groups == [["allreduce." + n for n in g] for g in used]
    assert all("spare" not in n for g in groups for n in g)
    with_unused = tensor_groups_from_plan(p, lambda name: name, include_unused=True)
    assert with_unused[-1] == ["spare.weight", "spare.bias"]
    # A parameter that is never submitted is left out so that its group can still complete.
    skip_bias = tensor_groups_from_plan(p, lambda n: None if n == "l2.bias" else n)
    assert "l2.bias" not in [n for g in skip_bias for n in g]
    s = FusionScheduler.from_plan(p, {n: "allreduce." + n for g in p.groups for n in g},
                                  threshold_bytes=64)
    assert [list(g) for g in s.groups] == groups
    # The unused layer, if it ever does get a gradient, goes by threshold fusion.
    batches = s.schedule([Entry("allreduce.spare.weight", 64, "f32")])
    assert kinds(batches) == [SINGLE]


def test_no_plan_means_threshold_fusion_only():
    s = FusionScheduler.from_plan(None, lambda n: n, threshold_bytes=100)
    assert s.groups == ()
    assert names(s.schedule(entries([("a", 60), ("b", 40), ("c", 1)]))) == [["a", "b"], ["c"]]


@pytest.mark.parametrize("threshold", [0, 100, 1000])
@pytest.mark.parametrize("sizes", [[40], [40, 50], [40, 70], [400, 300, 200], [2000]])
def test_one_batch_agrees_with_schedule_and_count_batch_records_it_alike(threshold, sizes):
    entries = [Entry(f"t{i}", n, "k") for i, n in enumerate(sizes)]
    scheduled = FusionScheduler(None, threshold)
    batches = scheduled.schedule(entries)
    counted = FusionScheduler(None, threshold)
    assert counted.one_batch(sum(sizes), len(sizes)) == (len(batches) == 1)
    if len(batches) == 1:
        counted.count_batch(sum(sizes), len(sizes))
        assert counted.stats.as_dict() == scheduled.stats.as_dict()
