"""The parameter server's sync policies replayed on recorded arrival orders, without MPI, against hand-written
single-process references of each mode's rule."""
import numpy as np
import pytest

from fusionring.ps.sync import Adaptive, ASP, BSP, SSP, make_policy


def grad(worker, it):
    return np.random.default_rng(1000 * worker + it).standard_normal(4)


def replay(policy, events, lr=0.1):
    """Run ``events`` ((kind, worker, n)) through ``policy`` with plain SGD; returns (params, replies)."""
    w = np.zeros(4)
    its = {}
    replies = []
    for kind, k, n in events:
        if kind == "push":
            its[k] = its.get(k, 0) + 1
            pushed = {k: grad(k, its[k])}
            d = policy.push(k, its[k])
            replay.pending.update(pushed)
        elif kind == "epoch":
            d = policy.end_epoch(k, n)
        else:
            d = policy.leave(k)
        for update in d.updates:
            w = w - lr * sum(wt * replay.pending[j] for j, wt in update)
        replies.append(list(d.reply))
    replay.pending.clear()
    return w, replies


replay.pending = {}


def test_bsp_averages_one_gradient_from_every_worker_then_replies_to_all():
    w, replies = replay(BSP(2), [("push", 0, 0), ("push", 1, 0), ("push", 1, 0), ("push", 0, 0)])
    ref = -0.1 * (grad(0, 1) + grad(1, 1)) / 2 - 0.1 * (grad(0, 2) + grad(1, 2)) / 2
    np.testing.assert_allclose(w, ref)
    assert replies == [[], [0, 1], [], [1, 0]]


def test_bsp_stops_waiting_for_a_worker_that_left():
    w, replies = replay(BSP(3), [("push", 0, 0), ("push", 1, 0), ("leave", 2, 0)])
    np.testing.assert_allclose(w, -0.1 * (grad(0, 1) + grad(1, 1)) / 2)
    assert replies[-1] == [0, 1]


def test_asp_applies_each_gradient_on_arrival():
    order = [0, 1, 0, 0, 1]
    w, replies = replay(ASP(2), [("push", k, 0) for k in order])
    its, ref = {}, np.zeros(4)
    for k in order:
        its[k] = its.get(k, 0) + 1
        ref = ref - 0.1 * grad(k, its[k])
    np.testing.assert_allclose(w, ref)
    assert replies == [[k] for k in order]


def test_ssp_holds_a_worker_more_than_staleness_ahead_of_the_slowest():
    _, replies = replay(SSP(2, 1), [("push", 0, 0), ("push", 0, 0), ("push", 1, 0), ("push", 1, 0)])
    assert replies == [[0], [], [0, 1], [1]]


def test_adaptive_starts_async_then_forms_the_top_s_sync_group_and_weights_by_iterations():
    p = Adaptive(3, slack=5)
    events = [("push", 0, 0), ("push", 1, 0), ("push", 2, 0)]
    events += [("epoch", 0, 1), ("epoch", 1, 1), ("epoch", 2, 1), ("epoch", 0, 2), ("epoch", 0, 3),
               ("epoch", 1, 2), ("epoch", 1, 3)]  # epochs 3, 3, 1: s = 2, group = {0, 1}
    events += [("push", 0, 0), ("push", 2, 0), ("push", 1, 0)]
    w, replies = replay(p, events)
    assert p.group == [0, 1] and p.changes[-1]["s"] == 2 and p.changes[-1]["async"] == [2]
    ref = -0.1 * (grad(0, 1) + grad(1, 1) + grad(2, 1))
    ref = ref - 0.1 * grad(2, 2)                       # asynchronous worker: applied on arrival
    ref = ref - 0.1 * (grad(0, 2) + grad(1, 2))       # iterations 2 and 2: both as fresh as the newest
    np.testing.assert_allclose(w, ref)
    assert replies[-3:] == [[], [2], [0, 1]]


def test_adaptive_slack_counter_aggregates_an_incomplete_sync_list():
    p = Adaptive(3, slack=1)
    p.epochs = {0: 3, 1: 3, 2: 1}
    p.end_epoch(0, 3)
    assert p.group == [0, 1]
    d1 = p.push(0, 7)
    d2 = p.push(2, 2)   # counter 1: not above slack
    d3 = p.push(2, 3)   # counter 2 > 1: async update, then the list of one
    assert d1.updates == [] and d2.updates == [[(2, 1.0)]]
    assert d3.updates == [[(2, 1.0)], [(0, 1.0)]] and d3.reply == [2, 0]


def test_adaptive_iteration_weights_count_less_advanced_gradients_less():
    """The most advanced gradient counts as an asynchronous one does (1); a staler one in proportion to its
    iterations, never more."""
    p = Adaptive(3, slack=10)
    p.group = [0, 1, 2]
    p.push(0, 3)
    p.push(1, 1)
    d = p.push(2, 6)
    assert d.updates == [[(0, 0.5), (1, 1 / 6), (2, 1.0)]]


def test_adaptive_returns_to_asp_when_the_epoch_gap_closes():
    p = Adaptive(3)
    for k in (0, 1):
        for e in (1, 2, 3):
            p.end_epoch(k, e)
    p.end_epoch(2, 1)
    assert p.group == [0, 1]
    p.end_epoch(2, 2)
    assert p.group == [] and [c["sync_group"] for c in p.changes] == [[0, 1], []]


@pytest.mark.parametrize("epochs,group", [
    ({0: 3, 1: 1}, [0]),                          # s = 2 = workers: the straggler stays async
    ({0: 5, 1: 5, 2: 5, 3: 1}, [0, 1, 2]),        # s = 4 = workers
    ({0: 9, 1: 2, 2: 8, 3: 1}, [0, 1, 2]),        # s = 8 > workers
    ({0: 4, 1: 2, 2: 4, 3: 2}, [0, 2]),           # s = 2 < workers: the top s
])
def test_adaptive_sync_group_leaves_the_slowest_asynchronous(epochs, group):
    p = Adaptive(len(epochs))
    for k, e in epochs.items():
        p.end_epoch(k, e)
    slowest = min(epochs, key=lambda k: (epochs[k], -k))
    assert p.group == group and slowest not in p.group
    assert p.changes[-1]["async"] == sorted(set(epochs) - set(group))
    # The slowest's pushes are applied at once, never held for the group.
    d = p.push(slowest, 1)
    assert d.updates == [[(slowest, 1.0)]] and d.reply == [slowest]


def test_replaying_a_recorded_arrival_order_is_bit_for_bit_deterministic():
    rng = np.random.default_rng(7)
    events = [("push", int(k), 0) for k in rng.integers(0, 3, 40)]
    events[10:10] = [("epoch", 0, 1), ("epoch", 1, 1), ("epoch", 2, 1), ("epoch", 0, 2), ("epoch", 0, 3)]
    for mode in ("bsp", "asp", "ssp", "adaptive"):
        a, ra = replay(make_policy(mode, 3, staleness=2, slack=3), events)
        b, rb = replay(make_policy(mode, 3, staleness=2, slack=3), events)
        assert a.tobytes() == b.tobytes() and ra == rb


@pytest.mark.parametrize("kw,name", [({"sync": "fast"}, "sync"), ({"sync": "ssp", "staleness": -1}, "staleness"),
                                     ({"sync": "adaptive", "slack": -2}, "slack")])
def test_invalid_sync_arguments_raise_value_error_naming_them(kw, name):
    with pytest.raises(ValueError, match=name):
        make_policy(num_workers=2, **kw)


@pytest.mark.parametrize("slack,further", [(None, 3), (2, 3), (0, 1), (2.5, 3)])
def test_adaptive_aggregates_an_incomplete_list_once_more_than_slack_further_pushes_arrived(slack, further):
    """As docs/ps.md and README say: the list goes once the pushes after its first entry exceed ``slack``
    (the default, 2: at the third)."""
    p = Adaptive(3, slack=slack)
    p.group = [0, 1]
    assert p.push(0, 5).updates == []   # the list's first entry: the count starts after it
    for i in range(1, further):
        assert p.push(2, i).updates == [[(2, 1.0)]]   # asynchronous, applied alone
    assert p.push(2, further).updates == [[(2, 1.0)], [(0, 1.0)]]


def _group_of_two_after_epochs(p):
    """Workers 0 and 1 three epochs ahead of worker 2, which reports its first epoch last."""
    for k in (0, 1):
        for e in (1, 2, 3):
            p.end_epoch(k, e)
    return p.end_epoch(2, 1)


def test_adaptive_logs_a_group_change_made_by_a_departure():
    p = Adaptive(3)
    _group_of_two_after_epochs(p)
    assert p.group == [0, 1]
    p.leave(0)
    assert p.group == [1]
    assert p.changes[-1] == {"update": 0, "s": 2, "sync_group": [1], "async": [2], "left": 0}
    p.leave(2)                                    # not in the group: the group does not change
    assert len(p.changes) == 2


def test_adaptive_servers_with_different_arrival_orders_are_unblocked_by_a_quiet_spell():
    """Two servers see worker 0's and worker 1's pushes on either side of the group change: each holds
    the worker the other already answered, so neither worker can push again; with the slow worker gone
    no push moves the slack counter. unblock() (a quiet spell) aggregates each list, answering them."""
    a, b = Adaptive(3), Adaptive(3)
    for p in (a, b):
        for k in (0, 1):
            for e in (1, 2, 3):
                p.push(k, e)
                p.end_epoch(k, e)
        p.push(2, 1)
    assert a.push(1, 4).reply == [1]              # server A: before the change, asynchronous
    a.end_epoch(2, 1)
    assert a.push(0, 4).reply == []               # after it: worker 0 waits for worker 1
    assert b.push(0, 4).reply == [0]
    b.end_epoch(2, 1)
    assert b.push(1, 4).reply == []               # worker 1 waits for worker 0
    for p in (a, b):
        assert p.leave(2).reply == []             # nothing releases either hold
    assert a.unblock().updates == [[(0, 1.0)]] and a.unblock().updates == []
    assert b.unblock().reply == [1]
    assert a.changes[-1]["sync_group"] == [0, 1]
