"""ProcessSet.rank() as in Horovod 0.28.1: a rank outside the set gets a ValueError
(horovod_process_set_rank's "not part of provided process set"), while included() and the
set's operations on its members keep working; and add_process_set refuses a set whose ranks
an added set (or the global set) already has, as Horovod's does."""
from conftest import run_ranks

NON_MEMBER = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
low = hvd.add_process_set([0, 1])
out = {"included": low.included(), "global rank": hvd.global_process_set.rank()}
try:
    out["rank"] = low.rank()
except ValueError as exc:
    out["rank"] = "ValueError: " + str(exc)
if low.included():
    out["sum"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=low).item()
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=low)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
else:
    # A DistributedOptimizer on a set this rank is not in steps on local gradients.
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=low)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    out["outside step"] = True
report(out)
'''


def test_process_set_rank_of_a_non_member_raises(tmp_path):
    results = run_ranks(3, NON_MEMBER, tmp_path, timeout=90)
    for r, got in enumerate(results):
        assert got["global rank"] == r
        if r < 2:
            assert got == {"included": True, "global rank": r, "rank": r, "sum": 2.0}
        else:
            assert got["included"] is False and got["outside step"] is True
            assert got["rank"].startswith("ValueError: ") and "not part" in got["rank"], got



DUPLICATES = r'''
import torch
import fusionring.torch as hvd
hvd.init()
out = {}
first = hvd.add_process_set([0, 1])
for label, ranks in (("reversed", [1, 0]), ("every", [0, 1, 2]), ("range", range(3))):
    try:
        hvd.add_process_set(ranks)
        out[label] = "added"
    except ValueError as exc:
        out[label] = str(exc)
# the library stays usable, and a set removed can be added again
out["sum"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
out["removed"] = hvd.remove_process_set(first)
out["again"] = hvd.add_process_set([1, 0]).ranks
report(out)
'''


def test_a_duplicate_process_set_is_refused_as_in_horovod(tmp_path):
    for out in run_ranks(3, DUPLICATES, tmp_path, timeout=90):
        assert "duplicate process set" in out["reversed"] and "process set 1" in out["reversed"]
        for every in ("every", "range"):
            assert "duplicate process set" in out[every] and "process set 0" in out[every]
        assert out["sum"] == 3.0
        assert out["removed"] is True and out["again"] == [0, 1]
