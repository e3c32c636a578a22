"""Bad input fails clearly on every rank, and the library keeps working afterwards."""
import os
import time

import pytest

from conftest import run_ranks

MISMATCH = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}

def attempt(label, fn):
    try:
        fn()
        out[label] = None
    except hvd.TensorMismatchError as exc:
        out[label] = str(exc)

attempt("shape", lambda: hvd.allreduce(torch.zeros(17, 17) if r != 2 else torch.zeros(18, 18),
                                       name="layer1.weight"))
attempt("dtype", lambda: hvd.allreduce(torch.zeros(3, dtype=torch.float32 if r else torch.float64),
                                       name="mixed"))
attempt("op", lambda: hvd.allreduce(torch.zeros(3), name="ops", op=hvd.Sum if r else hvd.Max))
attempt("root", lambda: hvd.broadcast(torch.zeros(3), root_rank=r % 2, name="roots"))
attempt("allgather", lambda: hvd.allgather(torch.zeros(2, 3 + (r == 1)), name="cols"))
# still usable, also under a name that failed before
out["after"] = hvd.allreduce(torch.ones(17, 17), name="layer1.weight", op=hvd.Sum)[0, 0].item()
report(out)
'''


def test_mismatches_raise_on_every_rank_with_names_and_ranks(tmp_path):
    results = run_ranks(3, MISMATCH, tmp_path, timeout=60)
    for out in results:
        assert out["shape"] == ("allreduce 'layer1.weight': ranks 0, 1 sent shape [17, 17], "
                                "rank 2 sent [18, 18]")
        assert "dtype" in out["dtype"] and "rank 0 sent dtype float64" in out["dtype"]
        assert "ranks 1, 2 sent float32" in out["dtype"]
        assert "'ops'" in out["op"] and "Max" in out["op"] and "Sum" in out["op"]
        assert "root rank" in out["root"] and "'roots'" in out["root"]
        assert "'cols'" in out["allgather"] and "rank 1 sent [4]" in out["allgather"]
        assert out["after"] == 3.0
    assert results[0] == results[1] == results[2]  # one message, the same on every rank


SET_MISMATCH = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
pair = hvd.add_process_set([1, 2])
out = {}
if r in (1, 2):
    for label, fn in (
            ("shape", lambda: hvd.allreduce(torch.zeros(r), name="w", process_set=pair)),
            ("root", lambda: hvd.broadcast(torch.zeros(2), root_rank=r, name="b",
                                           process_set=pair)),
            ("stall", lambda: hvd.allreduce(torch.zeros(2), name=f"only{r}",
                                            process_set=pair))):
        try:
            fn()
            out[label] = None
        except Exception as exc:  # noqa: BLE001
            out[label] = str(exc)
report(out)
'''


def test_process_set_errors_name_global_ranks(tmp_path):
    """Ranks in a process set are global ranks in its messages too (set [1, 2] of 3)."""
    # The set's runtime fails after the stall, so the ranks may not shut down cleanly.
    results, _, output = run_ranks(3, SET_MISMATCH, tmp_path, timeout=90, expect_failure=True,
                                   env={"FUSIONRING_STALL_SHUTDOWN_S": "3"})
    assert None not in results, output
    assert results[0] == {}
    for out in results[1:]:
        assert out["shape"] == "allreduce 'w': rank 1 sent shape [1], rank 2 sent [2]"
        assert out["root"] == "broadcast 'b': rank 1 sent root rank 1, rank 2 sent 2"
        # whichever name passed the limit first is listed, with the global rank it waits for
        assert ("allreduce 'only1' (missing on rank 2)" in out["stall"]
                or "allreduce 'only2' (missing on rank 1)" in out["stall"]), out["stall"]
        assert "rank 0" not in out["stall"], out["stall"]


LOCAL_ERRORS = r'''
import torch
import fusionring.torch as hvd
out = {}
try:
    hvd.size()
except ValueError as exc:
    out["before_init"] = str(exc)
try:
    hvd.allreduce(torch.ones(2))
except ValueError as exc:
    out["allreduce_before_init"] = str(exc)
hvd.init()
from mpi4py import MPI
# The name must still be in flight when it is submitted again: one rank at a time tries it,
# while the other holds its own submission back, so the first cannot complete meanwhile.
for late in (1, 0):
    if hvd.rank() != late:
        h = hvd.allreduce_async(torch.ones(2), name="dup")
        try:
            hvd.allreduce_async(torch.ones(2), name="dup")
        except ValueError as exc:
            out["in_flight"] = str(exc)
        MPI.COMM_WORLD.Barrier()
    else:
        MPI.COMM_WORLD.Barrier()
        h = hvd.allreduce_async(torch.ones(2), name="dup")
    out["first_still_works"] = hvd.synchronize(h).tolist()
out["reuse_after_done"] = hvd.allreduce(torch.ones(2), name="dup").tolist()
for dtype in (torch.uint32, torch.bool):
    try:
        hvd.allreduce(torch.zeros(2, dtype=dtype), name="weird")
    except ValueError as exc:
        out[str(dtype)] = str(exc)
try:
    hvd.broadcast(torch.zeros(2), root_rank=7, name="far")
except ValueError as exc:
    out["root range"] = str(exc)
# As Horovod: synchronize() of an unknown or finished handle returns None; poll() raises.
out["synchronize"] = repr(hvd.synchronize(123456))
try:
    hvd.poll(123456)
except ValueError as exc:
    out["poll"] = str(exc)
out["twice"] = repr(hvd.synchronize(h))  # already synchronized
report(out)
'''


def test_local_errors_are_clear_value_errors(tmp_path):
    for out in run_ranks(2, LOCAL_ERRORS, tmp_path, timeout=60):
        assert "init()" in out["before_init"] and "size()" in out["before_init"]
        assert "init()" in out["allreduce_before_init"]
        assert "'allreduce.dup'" in out["in_flight"] and "already in flight" in out["in_flight"]
        assert out["first_still_works"] == [1.0, 1.0]
        assert out["reuse_after_done"] == [1.0, 1.0]
        assert "uint32" in out["torch.uint32"] and "'weird'" in out["torch.uint32"]
        assert "bool" in out["torch.bool"]
        assert out["root range"] == "broadcast 'far': root_rank 7 is out of range for 2 ranks"
        assert out["synchronize"] == "None"
        assert "unknown handle" in out["poll"]
        assert out["twice"] == "None"


ONE_RANK_REFUSES = r'''
import time, torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}
started = time.monotonic()

def attempt(label, fn):
    try:
        fn()
        out[label] = None
    except Exception as exc:  # noqa: BLE001
        out[label] = f"{type(exc).__name__}: {exc}"

# A dtype only rank 1 sends, named.
attempt("dtype", lambda: hvd.allreduce(torch.ones(3, dtype=torch.bool if r == 1 else
                                                  torch.float32), name="x"))
# An unnamed alltoall whose splits are wrong on rank 2 only; the next unnamed operation must
# still pair up across ranks.
attempt("splits", lambda: hvd.alltoall(torch.arange(6.0), splits=[2, 2, 2] if r != 2 else
                                       [1, 1, 1]))
attempt("after_unnamed", lambda: out.update(
    unnamed=hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum).tolist()))
# One bad tensor of a group on rank 0: the whole group fails on the others.
attempt("group", lambda: hvd.grouped_allreduce(
    [torch.ones(2), torch.ones(2).to_sparse() if r == 0 else torch.ones(2)], name="g"))
# A root out of range on rank 2; two ranks refusing for different reasons are both named.
attempt("root", lambda: hvd.broadcast(torch.ones(2), root_rank=7 if r == 2 else 0, name="b"))
attempt("two", lambda: hvd.allgather(
    torch.ones(2, dtype=torch.bool) if r == 0 else torch.ones(2) if r == 1 else [1, 2],
    name="two"))
# Caught and submitted again at once, under the same name, by every rank.
for tries in range(2):
    try:
        bad = r == 1 and tries == 0
        out["retry"] = hvd.allreduce(torch.tensor([1.0, 2.0], dtype=torch.bool if bad else
                                                  torch.float32), name="y", op=hvd.Sum).tolist()
        break
    except (ValueError, hvd.TensorMismatchError) as exc:
        out[f"retry{tries}"] = type(exc).__name__
# Within a process set, named by global rank.
pair = hvd.add_process_set([0, 2])
if r in (0, 2):
    attempt("set", lambda: hvd.reducescatter(torch.ones(3) if r == 0 else torch.ones(()),
                                             name="rs", process_set=pair))
out["end"] = hvd.allreduce(torch.ones(2) * r, name="end", op=hvd.Sum).tolist()
out["seconds"] = time.monotonic() - started
report(out)
'''


def test_bad_input_on_one_rank_fails_the_others_naming_it(tmp_path):
    """An error raised before anything is sent, on some ranks only, reaches the others as an
    error naming those ranks and the cause, at once, and every rank stays usable."""
    results = run_ranks(3, ONE_RANK_REFUSES, tmp_path, timeout=90)
    dtype_cause = "ValueError: tensor 'x' has unsupported dtype bool"
    assert results[1]["dtype"].startswith(dtype_cause)
    for r in (0, 2):
        assert results[r]["dtype"].startswith(
            f"TensorMismatchError: allreduce 'x' failed on rank 1, which raised {dtype_cause}")
    assert results[2]["splits"].startswith("ValueError: alltoall of an unnamed tensor: splits "
                                           "[1, 1, 1] sum to 3, but the first dimension is 6")
    for r in (0, 1):
        assert "failed on rank 2, which raised ValueError: alltoall of an unnamed tensor: " \
               "splits [1, 1, 1] sum to 3" in results[r]["splits"]
    assert results[0]["group"].startswith("ValueError: tensor 'g.1' is sparse")
    for r in (1, 2):
        assert "failed on rank 0, which raised ValueError: tensor 'g.1' is sparse" in \
            results[r]["group"]
    assert results[2]["root"] == "ValueError: broadcast 'b': root_rank 7 is out of range for 3 ranks"
    for r in (0, 1):
        assert results[r]["root"] == ("TensorMismatchError: broadcast 'b' failed on rank 2, which "
                                      "raised ValueError: broadcast 'b': root_rank 7 is out of "
                                      "range for 3 ranks")
    assert results[2]["two"].startswith("TypeError: 'two' must be a torch.Tensor, not list")
    assert results[1]["two"].startswith("TensorMismatchError: allgather 'two' failed on rank 2, "
                                        "which raised TypeError")
    # allgather moves bytes: a bool tensor is valid there, so rank 0 only hears of rank 2.
    assert results[0]["two"] == results[1]["two"]
    assert results[1]["retry0"] == "ValueError"
    assert results[0]["retry0"] == results[2]["retry0"] == "TensorMismatchError"
    assert results[2]["set"].startswith("ValueError: reducescatter 'rs': a 0-d tensor")
    assert results[0]["set"].startswith("TensorMismatchError: reducescatter 'rs' failed on "
                                        "rank 2, which raised ValueError")
    for out in results:
        assert out["after_unnamed"] is None and out["unnamed"] == [3.0, 3.0]
        assert out["retry"] == [3.0, 6.0]
        assert out["end"] == [3.0, 3.0]
        assert out["seconds"] < 20  # no stall limit waited for (it is 60 s)


REFUSED_TWICE = r'''
import time, torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
out = {"errors": []}
def refused(rows):
    try:
        hvd.alltoall(torch.zeros(rows, 2), name="z")
    except ValueError as exc:
        out["errors"].append(str(exc))
# Every rank refuses 'z' twice, then runs it; rank 0 refuses twice at once, while its first
# refusal still waits for the others, and the others settle their first before their second.
if r != 0:
    time.sleep(1.0)
refused(2 * hvd.size() + 1)
if r != 0:
    time.sleep(1.0)
refused(2 * hvd.size() + 2)
try:
    out["z"] = hvd.alltoall(torch.full((hvd.size(),), float(r)), name="z").tolist()
except Exception as exc:
    out["z"] = f"{type(exc).__name__}: {exc}"
out["end"] = hvd.allreduce(torch.ones(1), name="end", op=hvd.Sum).tolist()
report(out)
'''


def test_a_name_refused_again_meets_the_others_refusals_in_order(tmp_path):
    """Two refusals of one name, made at different paces on different ranks, are matched
    one for one: the operation that follows them meets the others' operation, not a
    refusal of theirs (rank 0's second refusal was once folded into its first)."""
    results = run_ranks(3, REFUSED_TWICE, tmp_path, timeout=60)
    for out in results:
        assert len(out["errors"]) == 2 and all("alltoall 'z'" in e for e in out["errors"])
        assert out["z"] == [0.0, 1.0, 2.0]
        assert out["end"] == [3.0]


GROUPED_DIFFERENTLY = r'''
import time, torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
out = {}
started = time.monotonic()
def attempt(label, fn):
    try:
        out[label] = fn()
    except Exception as exc:
        out[label] = f"{type(exc).__name__}: {exc}"
count = 2 if r == 2 else 3  # rank 2 groups one tensor fewer
attempt("allreduce", lambda: [t.tolist() for t in hvd.grouped_allreduce(
    [torch.ones(2) * (i + 1) for i in range(count)], name="ga", op=hvd.Sum)])
attempt("allgather", lambda: [t.tolist() for t in hvd.grouped_allgather(
    [torch.ones(1)] * (1 if r == 0 else 2), name="gg")])
attempt("async", lambda: [t.tolist() for t in hvd.synchronize(hvd.grouped_allreduce_async(
    [torch.ones(1)] * count, name="gs"))])
# The same call with agreeing counts then works, under the same names.
attempt("again", lambda: [t.tolist() for t in hvd.grouped_allreduce(
    [torch.ones(2) * (i + 1) for i in range(3)], name="ga", op=hvd.Sum)])
out["seconds"] = time.monotonic() - started
report(out)
'''


def test_ranks_that_group_differently_fail_at_once_naming_the_counts(tmp_path):
    """A grouped operation with a different number of tensors on some ranks fails on every
    rank, naming who sent how many, instead of waiting forever for the members only some
    ranks sent; the rest of each rank's group is withdrawn with it."""
    results = run_ranks(3, GROUPED_DIFFERENTLY, tmp_path, timeout=60)
    for out in results:
        assert out["allreduce"] == ("TensorMismatchError: allreduce 'ga.0': ranks 0, 1 sent "
                                    "number of tensors in the group 3, rank 2 sent 2")
        assert out["allgather"] == ("TensorMismatchError: allgather 'gg.0': rank 0 sent number "
                                    "of tensors in the group 1, ranks 1, 2 sent 2")
        assert out["async"].startswith("TensorMismatchError: allreduce 'gs.0': ranks 0, 1 sent")
        assert out["again"] == [[3.0, 3.0], [6.0, 6.0], [9.0, 9.0]]
        assert out["seconds"] < 20  # no stall limit waited for


EARLY_EXIT = r'''
import time, torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
hvd.allreduce(torch.ones(1), name="warmup")
if r == 1:
    hvd.shutdown()
    report({"left": True})
else:
    try:
        hvd.allreduce(torch.ones(1), name="never")
        report({"error": None})
    except hvd.HorovodInternalError as exc:
        report({"error": str(exc)})
'''


def test_rank_leaving_makes_others_fail_instead_of_hang(tmp_path):
    results = run_ranks(3, EARLY_EXIT, tmp_path, timeout=60)
    for r in (0, 2):
        assert "shut down" in results[r]["error"] and "rank(s) 1" in results[r]["error"]


FAILED_JOB = r'''
import torch
import fusionring.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(4), name="before")
with open("/proc/self/maps") as maps:
    segments = sorted({line.rstrip().split(None, 5)[5] for line in maps
                       if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")})
report({"segments": segments})
if hvd.rank() == 1:
    raise RuntimeError("this rank fails")
hvd.allreduce(torch.ones(4), name="after")
'''


def test_a_failed_job_leaves_no_mpi_shared_memory_file(tmp_path):
    """Ranks that end without MPI_Finalize remove MPICH's node segment from /dev/shm, which
    MPI_Finalize would have done: a container's small /dev/shm must not fill up with failures."""
    results, code, output = run_ranks(2, FAILED_JOB, tmp_path, timeout=60, expect_failure=True)
    assert code != 0 and "this rank fails" in output
    segments = {path for result in results for path in result["segments"]}
    mpich = [path for path in segments if os.path.basename(path).startswith("mpich_shm_")]
    if not mpich:
        pytest.skip(f"no MPICH node segment mapped (MPI without one): {sorted(segments)}")
    assert [path for path in mpich if os.path.exists(path)] == []


STALL = r'''
import time, torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
start = time.monotonic()
if r == 0:
    try:
        hvd.allreduce(torch.ones(1), name="lonely")
        report({"error": None})
    except hvd.FusionRingError as exc:
        report({"error": str(exc), "after_s": time.monotonic() - start,
                "stall": isinstance(exc, hvd.StallError)})
    # More work before the end (the process then ends failed, without MPI_Finalize, and the
    # launcher ends the job): meanwhile rank 1 asks for an operation.
    time.sleep(6)
else:
    time.sleep(4)
    try:
        hvd.allreduce(torch.ones(1), name="other")
        report({"error": None})
    except hvd.FusionRingError as exc:
        report({"error": str(exc)})
'''


def test_stall_warns_then_fails_every_rank(tmp_path):
    results, code, output = run_ranks(
        2, STALL, tmp_path, timeout=60, expect_failure=True,
        env={"FUSIONRING_STALL_WARNING_S": "0.5", "FUSIONRING_STALL_SHUTDOWN_S": "2"})
    assert results[0]["stall"] and "'lonely'" in results[0]["error"]
    assert "rank 1" in results[0]["error"] and results[0]["after_s"] < 10
    assert results[1]["error"] and "'lonely'" in results[1]["error"]
    assert "allreduce 'lonely' waiting" in output  # the warning, on rank 0
    # A name no other rank has submitted makes every round a full exchange; the warning
    # still comes once per warning time, as Horovod's (at 0.5, 1 and 1.5 s, perhaps 2 s),
    # neither once per round nor once per check (every 0.25 s).
    assert 2 <= output.count("waiting for the rest") <= 4, output[-2000:]


CLASH = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
try:
    if r == 0:
        hvd.allgather(torch.ones(2), name="k")
    else:
        hvd.allreduce(torch.ones(2), name="k")
    report({"error": None})
except hvd.FusionRingError as exc:
    report({"error": str(exc)})
'''


def test_one_name_for_different_operations_is_named_in_the_stall_messages(tmp_path):
    # Operations are told apart by kind as well as name (as in Horovod), so an allgather on
    # one rank and an allreduce on another under one name wait for each other: the stall
    # warning and the stall error say so.
    results, code, output = run_ranks(
        2, CLASH, tmp_path, timeout=60, expect_failure=True,
        env={"FUSIONRING_STALL_WARNING_S": "0.5", "FUSIONRING_STALL_SHUTDOWN_S": "2"})
    clash = "'k' is allgather on rank 0, allreduce on rank 1: every rank must call the same"
    assert clash in output
    for out in results:
        assert clash in out["error"], out


SHM_LATE_PEER = r'''
import time
import numpy as np
from mpi4py import MPI
from fusionring import _C
comm = MPI.COMM_WORLD
shm = _C.SharedMemoryAllreduce(MPI._handleof(comm.Dup()), 4096)
x = np.ones(10, np.float32)
shm.allreduce([x.ctypes.data], [x.nbytes], 0, 0)
assert (x == comm.size).all()
if comm.rank == 0:
    # Rank 1 is late: a bounded wait fails with a message naming both ranks.
    try:
        shm.allreduce([x.ctypes.data], [x.nbytes], 0, 0, timeout_s=0.5)
        report("no error")
    except RuntimeError as exc:
        report(str(exc))
    time.sleep(3)
else:
    time.sleep(1.5)
    # Now rank 0 has given up on that call: rank 1 waits for it in vain, and times out too.
    try:
        shm.allreduce([x.ctypes.data], [x.nbytes], 0, 0, timeout_s=0.5)
        report("no error")
    except RuntimeError as exc:
        report(str(exc))
'''


def test_shared_memory_waits_fail_with_a_message_instead_of_hanging(tmp_path):
    results = run_ranks(2, SHM_LATE_PEER, tmp_path, timeout=60)
    assert "rank 0 waited 0 s for rank 1 in a shared-memory allreduce" in results[0]
    assert "rank 1 waited 0 s for rank 0 in a shared-memory allreduce" in results[1]


SHM_CLOSE = r'''
import os, time
import numpy as np
from mpi4py import MPI
from fusionring import _C
comm = MPI.COMM_WORLD
x = np.ones(10, np.float32)
shm = _C.SharedMemoryAllreduce(MPI._handleof(comm.Dup()), 4096)
shm.allreduce([x.ctypes.data], [x.nbytes], 0, 0)
if comm.rank == 1:
    time.sleep(0.5)  # close() waits for the late rank
started = time.monotonic()
closed = shm.close(30.0)
waited = time.monotonic() - started
try:
    shm.allreduce([x.ctypes.data], [x.nbytes], 0, 0)
    after = "no error"
except ValueError as exc:
    after = str(exc)
# A second window that rank 1 never closes: rank 0 gives up at its time limit.
lone = _C.SharedMemoryAllreduce(MPI._handleof(comm.Dup()), 4096)
lone_closed = None
started = time.monotonic()
if comm.rank == 0:
    lone_closed = lone.close(1.0)
report({"closed": closed, "after": after, "waited": waited, "lone_closed": lone_closed,
        "lone_waited": time.monotonic() - started})
comm.Barrier()
'''


def test_shared_memory_window_is_freed_together_and_given_up_on_a_peer_that_never_closes(tmp_path):
    results = run_ranks(2, SHM_CLOSE, tmp_path, timeout=60)
    assert [r["closed"] for r in results] == [True, True]
    assert results[0]["waited"] > 0.3  # rank 0 waited for rank 1 to close too
    assert all("closed" in r["after"] for r in results)
    assert results[0]["lone_closed"] is False and 0.9 < results[0]["lone_waited"] < 20


EARLY_SHUTDOWN = r'''
import os, time, torch
import fusionring.torch as hvd
from mpi4py import MPI
hvd.init()
hvd.allreduce(torch.ones(3))
if hvd.rank() == 1:
    started = time.monotonic()
    hvd.shutdown()  # returns at once, though rank 0 is still busy
    report(time.monotonic() - started)
else:
    time.sleep(2)
    report(0.0)
'''


def test_shutdown_does_not_wait_for_ranks_still_running(tmp_path):
    results = run_ranks(2, EARLY_SHUTDOWN, tmp_path, timeout=60)
    assert results[1] < 1.0


EXECUTOR_FAILURE = r'''
import time, torch
import fusionring.torch as hvd
from fusionring.compression import Compressor
hvd.init()
r = hvd.rank()

class Faulty(Compressor):
    """Reduces inside the runtime; on rank 1 the reduction itself breaks."""
    in_runtime = True
    name = "faulty"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor

    @staticmethod
    def communicate(context):
        if r == 1:
            raise RuntimeError("device lost")
        return None  # the other ranks send nothing, so nobody waits for rank 1's bytes

out = {}
try:
    hvd.allreduce(torch.ones(4), name="g", compression=Faulty())
    out["first"] = None
except hvd.FusionRingError as exc:
    out["first"] = str(exc)
start = time.monotonic()
try:
    for _ in range(200):
        hvd.allreduce(torch.ones(4), name="next")
    out["next"] = None
except hvd.FusionRingError as exc:
    out["next"] = str(exc)
out["after_s"] = time.monotonic() - start
report(out)
'''


def test_a_failing_reduction_fails_every_rank_with_its_cause(tmp_path):
    """An error inside one rank's reduction reaches that rank's caller with its cause, and
    the other ranks' next operations fail naming that rank instead of hanging."""
    results = run_ranks(3, EXECUTOR_FAILURE, tmp_path, timeout=60)
    assert results[1]["first"] is not None and "device lost" in results[1]["first"]
    assert "rank 1" in results[1]["first"]
    for r in (0, 2):
        assert results[r]["next"] is not None, results[r]
        assert "rank(s) 1" in results[r]["next"] and "shut down" in results[r]["next"]
        assert results[r]["after_s"] < 30


FAILS_INSIDE_A_COLLECTIVE = r'''
import time, torch
import fusionring.torch as hvd
from fusionring.runtime.collectives import MpiCollectives

def broken(self, requests):
    raise RuntimeError("out of buffers")

if int(__import__("os").environ.get("PMI_RANK", "0")) == 1:
    MpiCollectives.allgather = broken  # before init(): the loop takes it from the class
hvd.init()
try:
    hvd.allgather(torch.ones(2), name="gathered")  # ranks 0 and 2 wait inside MPI for rank 1
except hvd.FusionRingError:
    pass
if __import__("os").environ["THEN"] == "sleeps":
    time.sleep(120)
'''


@pytest.mark.parametrize("then", ["sleeps", "ends"])
def test_a_rank_failing_inside_an_agreed_collective_aborts_instead_of_hanging(tmp_path, then):
    """The peers are inside the data collective that rank 1 will never enter, so its shutdown
    notice cannot reach them: rank 1 prints its error and aborts the job, also when its
    script ends meanwhile (its exit waits for that decision instead of finalizing MPI)."""
    started = time.monotonic()
    _, code, output = run_ranks(3, FAILS_INSIDE_A_COLLECTIVE, tmp_path, timeout=100,
                                expect_failure=True, env={"THEN": then})
    assert code != 0, output[-2000:]
    assert ("background loop failed on rank 1 in allgather 'gathered': RuntimeError: out of buffers"
            in output), output[-2000:]
    assert "aborting the job" in output
    assert time.monotonic() - started < 60, output[-2000:]


PAYLOAD_PARTS = r'''
import torch
import fusionring.torch as hvd
from fusionring.compression import Compressor
hvd.init()
r, P = hvd.rank(), hvd.size()

class TopTwo:
    """Horovod's shape: a plain class of static methods; its payload holds indices."""
    @staticmethod
    def compress(tensor):
        values, indices = tensor.abs().topk(2)
        return (tensor[indices], indices), tensor.shape

    @staticmethod
    def decompress(payload, shape):
        values, indices = payload
        return torch.zeros(shape).index_put_((indices,), values)

class Halves(Compressor):
    """Two summable parts (the sum of the halves is the halves of the sum), declared so."""
    name = "halves"
    summable = True

    @staticmethod
    def compress(tensor):
        return (tensor[:3].clone(), tensor[3:].clone()), None

    @staticmethod
    def decompress(payload, ctx):
        return torch.cat(payload)

class Opaque(Compressor):
    name = "opaque"
    summable = False

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(payload, ctx):
        return payload

x = torch.arange(6, dtype=torch.float32) * (r + 1)
out = {}
for label, compression in (("indices", TopTwo), ("opaque", Opaque)):
    try:
        hvd.allreduce(x, name=f"grad.{label}", compression=compression, op=hvd.Sum)
        out[label] = None
    except ValueError as exc:
        out[label] = str(exc)
out["halves"] = hvd.allreduce(x, name="grad.halves", compression=Halves, op=hvd.Sum).tolist()
out["after"] = hvd.allreduce(x, name="grad.indices", op=hvd.Sum).tolist()  # still usable
report(out)
'''


def test_a_payload_that_is_not_summable_is_refused_on_every_rank(tmp_path):
    """A Horovod-style compressor whose payload holds indices is not summed silently: every
    rank gets a ValueError naming the compressor and the tensor, and nothing is sent; parts
    declared summable are summed part by part."""
    size = 2
    total = [float(i * sum(range(1, size + 1))) for i in range(6)]
    for out in run_ranks(size, PAYLOAD_PARTS, tmp_path, timeout=60):
        assert out["indices"] is not None and "TopTwo" in out["indices"], out
        assert "grad.indices" in out["indices"] and "several parts" in out["indices"]
        assert "int64 tensor" in out["indices"]
        assert out["opaque"] is not None and "opaque" in out["opaque"]
        assert "grad.opaque" in out["opaque"] and "not summable" in out["opaque"]
        assert out["halves"] == total
        assert out["after"] == total


THREAD_LEVEL = r'''
import warnings
import mpi4py
mpi4py.rc.thread_level = "serialized"
import torch
import fusionring.torch as hvd
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hvd.init()
messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
report({"messages": messages, "sum": hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()})
'''


def test_mpi_below_thread_multiple_is_warned_about(tmp_path):
    """Like Horovod: MPI already initialized without MPI_THREAD_MULTIPLE gets a warning that
    names the level and the fix."""
    for out in run_ranks(2, THREAD_LEVEL, tmp_path, timeout=60):
        assert len(out["messages"]) == 1, out
        assert "MPI_THREAD_SERIALIZED" in out["messages"][0]
        assert "thread_level = 'multiple'" in out["messages"][0]
        assert out["sum"] == [2.0, 2.0]


DATA_LOADER_WORKERS = r'''
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
import fusionring.torch as hvd
GUARDED = {guarded}

def train():
    hvd.init()
    data = TensorDataset(torch.arange(64.0).reshape(32, 2), torch.arange(32) % 2)
    loader = DataLoader(data, batch_size=8, num_workers=1, multiprocessing_context="{context}")
    model = torch.nn.Linear(2, 2)
    hvd.broadcast_parameters(model.state_dict(), 0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    weights = hvd.allgather(model.weight.detach().unsqueeze(0))
    report(all(torch.equal(weights[0], w) for w in weights))

if GUARDED:
    if __name__ == "__main__":
        train()
else:
    train()  # also runs in every worker that imports this script again
'''


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_data_loader_workers_that_import_the_script_again(context, tmp_path):
    # Guarded: the workers import the script without starting fusionring, and training works.
    code = DATA_LOADER_WORKERS.format(guarded=True, context=context)
    assert run_ranks(2, code, tmp_path / "guarded", timeout=120) == [True, True]
    # Unguarded: each worker's init() says what happened instead of MPI aborting on the
    # launcher's inherited variables, and the job ends.
    code = DATA_LOADER_WORKERS.format(guarded=False, context=context)
    _, returncode, output = run_ranks(2, code, tmp_path / "unguarded", timeout=120,
                                      expect_failure=True)
    assert returncode != 0
    assert "which multiprocessing started from MPI rank" in output
    assert "if __name__ == '__main__':" in output
    assert "PMIU_write error" not in output and "PMI_Init failed" not in output


SUBPROCESS_OF_A_RANK = r'''
import os, subprocess, sys
import fusionring.torch as hvd
hvd.init()
child = "import fusionring.torch as hvd; hvd.init(); print('world', hvd.size())"
result = "rank 0 checks"
if "PMI_FD" not in os.environ:
    result = "no PMI_FD"          # not MPICH's launcher: nothing to check
elif hvd.rank() == 0:
    inherited = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                               timeout=60)
    alone = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                           timeout=60, env={k: v for k, v in os.environ.items()
                                            if not k.startswith("PMI_")})
    server = subprocess.run([sys.executable, "-c", "import fusionring.ps as ps; ps.init(num_servers=1)"],
                            capture_output=True, text=True, timeout=60)
    result = [inherited.returncode, inherited.stderr, alone.returncode, alone.stdout,
              server.returncode, server.stderr]
hvd.barrier()
report(result)
'''


def test_a_program_a_rank_starts_that_calls_init_is_told_why_it_cannot(tmp_path):
    # A subprocess inherits the rank's PMI variables but not the launcher's socket: init()
    # names that instead of MPI aborting with a PMI write error; without the variables it
    # runs as a world of one, as the message suggests.
    results = run_ranks(2, SUBPROCESS_OF_A_RANK, tmp_path, timeout=120)
    if results[0] == "no PMI_FD":
        pytest.skip("the launcher hands its connection over otherwise than by PMI_FD")
    code, stderr, alone_code, alone_out, ps_code, ps_stderr = results[0]
    assert code != 0
    assert "not its connection to the launcher" in stderr, stderr[-2000:]
    assert "without the PMI_* variables" in stderr
    assert "PMIU_write error" not in stderr and "PMI_Init failed" not in stderr
    assert alone_code == 0 and "world 1" in alone_out
    # The parameter server's init() makes the same check.
    assert ps_code != 0 and "ps.init() was called in process" in ps_stderr, ps_stderr[-2000:]
    assert "PMIU_write error" not in ps_stderr and "PMI_Init failed" not in ps_stderr


STALL_UNCAUGHT = r'''
import time
import torch
import fusionring.torch as hvd
hvd.init()
if hvd.rank() == 1:
    time.sleep(90)          # alive, but never submits: rank 0's allreduce stalls
hvd.allreduce(torch.ones(2), name="lonely")
'''


def test_a_rank_that_stalls_ends_the_job_failed_instead_of_holding_it(tmp_path):
    """After the stall limit rank 0 raises StallError, uncaught; it must then leave at once
    with a failure (the stalled rank would hold MPI_Finalize, so the launcher would never
    learn of it), and the launcher ends the job."""
    started = time.monotonic()
    _, code, output = run_ranks(2, STALL_UNCAUGHT, tmp_path, timeout=80, expect_failure=True,
                                env={"FUSIONRING_STALL_SHUTDOWN_S": "2"})
    assert code != 0 and "StallError" in output
    assert time.monotonic() - started < 45, output[-2000:]


RAISES_WHILE_PEER_IS_BUSY = r'''
import os, time
import torch
import fusionring.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(4), name="first")
if hvd.rank() == 1:
    time.sleep(120)          # busy outside the library (a long evaluation, a stuck loader)
raise {error}("rank 0 ends on an error of its own")
'''


@pytest.mark.parametrize("error", ["RuntimeError", "KeyboardInterrupt"])
def test_a_rank_that_ends_on_its_own_exception_ends_the_job_while_a_peer_is_busy(tmp_path, error):
    """An uncaught exception (or Ctrl-C) on one rank ends that rank at once with a failure:
    MPI_Finalize would wait for the busy peer, so the launcher would never learn of it."""
    started = time.monotonic()
    _, code, output = run_ranks(2, RAISES_WHILE_PEER_IS_BUSY.format(error=error), tmp_path,
                                timeout=100, expect_failure=True)
    assert code != 0 and f"{error}: rank 0 ends on an error of its own" in output, output[-2000:]
    assert time.monotonic() - started < 45, output[-2000:]


COLLECTIVE_IN_A_FORKED_WORKER = r'''
import torch
import fusionring.torch as hvd
from torch.utils.data import DataLoader, Dataset

class Calls(Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        try:
            hvd.allreduce(torch.ones(1), name=f"in_worker_{i}")
            return "no error"
        except hvd.HorovodInternalError as exc:
            return f"{type(exc).__name__}: {exc}"

hvd.init()
errors = [e for batch in DataLoader(Calls(), batch_size=None, num_workers=1,
                                    multiprocessing_context="fork") for e in [batch]]
report({"errors": errors, "after": hvd.allreduce(torch.ones(1), name="after", op=hvd.Sum).item()})
'''


def test_a_collective_in_a_forked_data_loader_worker_is_refused_naming_the_fork(tmp_path):
    """A forked child inherits the runtime but not its thread; it is told it is no rank."""
    results = run_ranks(2, COLLECTIVE_IN_A_FORKED_WORKER, tmp_path, timeout=90)
    for rank, r in enumerate(results):
        assert len(r["errors"]) == 2 and r["after"] == 2.0, r
        for error in r["errors"]:
            assert f"was forked from rank {rank}" in error and "DataLoader worker" in error, r


ONE_BAD_CALL = r'''
import time, numpy as np, torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
x = torch.ones(4)
bad = {
    "op": lambda name: hvd.allreduce(x, name=name, op=42 if r == 1 else hvd.Sum),
    "numpy": lambda name: hvd.allreduce(np.ones(4, np.float32) if r == 1 else x, name=name),
    # a lossy codec's ring encodes float32: an integer tensor would come back rounded
    "integer": lambda name: hvd.allreduce(x.long() if r == 1 else x, name=name,
                                          compression=hvd.Compression.nm(2, 4)),
}
out = {}
for case, call in bad.items():
    for name in ("b." + case, None):       # an unnamed call draws the same number everywhere
        started = time.monotonic()
        try:
            call(name)
            out[f"{case}.{name}"] = "no error"
        except Exception as exc:          # noqa: BLE001
            out[f"{case}.{name}"] = f"{type(exc).__name__}: {exc}"
        out[f"{case}.{name}.s"] = time.monotonic() - started
out["after"] = hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum).tolist()
report(out)
'''


def test_a_bad_argument_on_one_rank_fails_the_others_at_once(tmp_path):
    """A bad op, a non-tensor or an integer tensor for a lossy codec on one rank raised there
    before a request existed: the other ranks waited on the name until the stall limit (with
    one set, the library then refused every later collective)."""
    results = run_ranks(3, ONE_BAD_CALL, tmp_path, timeout=90,
                        env={"FUSIONRING_STALL_SHUTDOWN_S": "20"})
    assert "compresses floating-point tensors; tensor 'b.integer' is int64" in (
        results[1]["integer.b.integer"])
    for r, out in enumerate(results):
        for case in ("op", "numpy", "integer"):
            for name in ("b." + case, "None"):
                message = out[f"{case}.{name}"]
                assert out[f"{case}.{name}.s"] < 10, (case, name, out)
                if r == 1:
                    assert message.startswith(("ValueError", "TypeError")), message
                else:
                    assert message.startswith("TensorMismatchError") and "on rank 1" in message, message
        assert out["after"] == [3.0, 3.0]

