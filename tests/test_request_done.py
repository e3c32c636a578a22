"""Request.done: set once by the loop, waited on by any number of callers, Event's semantics."""
import threading
import time

from fusionring.runtime.requests import Done, Request


def test_unset_wait_times_out_and_set_releases_every_waiter():
    done = Done()
    assert not done.is_set()
    started = time.monotonic()
    assert done.wait(0.05) is False
    assert time.monotonic() - started >= 0.04
    results = []
    waiters = [threading.Thread(target=lambda: results.append(done.wait(10))) for _ in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    done.set()
    done.set()  # a second set changes nothing
    for w in waiters:
        w.join(5)
    assert results == [True] * 4
    assert done.is_set() and done.wait() and done.wait(0) and done.wait(-1)


def test_sets_racing_waits_never_lose_the_set():
    for _ in range(200):
        done = Done()
        seen = []
        waiter = threading.Thread(target=lambda: seen.append(done.wait(5)))
        waiter.start()
        setters = [threading.Thread(target=done.set) for _ in range(2)]
        for s in setters:
            s.start()
        for s in setters:
            s.join()
        waiter.join(5)
        assert seen == [True] and done.is_set() and done.wait(0)


def test_each_request_has_its_own():
    import torch
    from fusionring.torch.functions import _allreduce_spec
    from fusionring.ops import ReduceOp
    t = torch.zeros(3)
    spec = _allreduce_spec(t.dtype, (3,), ReduceOp.Sum, 1.0, 1.0, "")
    a, b = Request("a", spec, t, t), Request("b", spec, t, t)
    a.done.set()
    assert a.done.is_set() and not b.done.is_set()
