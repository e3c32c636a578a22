"""A recorded arrival order (FUSIONRING_PS_RECORD) replayed in one process through the sync policy and the
optimizer gives the server's parameters bit for bit, under asp, ssp and adaptive with a slowed worker, and under
bsp with layer selection and a branch only some workers use."""
import pytest
import torch

from conftest import run_ranks
from fusionring.ps.sync import make_policy

SCRIPT = r'''
import atexit, time, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < {servers}:
    atexit.register(report, {{"server": True}})
ps.init(num_servers={servers})
k, W = ps.worker_rank(), ps.num_workers()
torch.manual_seed(k)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.8),
                              named_parameters=model.named_parameters(), sync="{sync}", staleness=2, slack=1)
gen = torch.Generator().manual_seed(10 + k)
epoch = 0
# under adaptive the fast workers keep training until the server announces a split, so that the split does not
# depend on how fast this host runs them (bounded, so a missing split fails the assertion instead of hanging)
while epoch < 6 or ({extend} and k < W - 1 and not ps.stats()["group_changes"] and epoch < 300):
    for step in range(5):
        if k == W - 1:
            time.sleep(0.02)  # the straggler
        opt.param_groups[0]["lr"] = 0.05 / (1 + 0.1 * epoch)  # a schedule the server must follow
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    opt.end_epoch()
    epoch += 1
s = ps.stats()
ps.shutdown()
report({{"version": s["version"], "bits": [p.detach().numpy().tobytes().hex() for p in model.parameters()],
        "changes": len(s["group_changes"]), "staleness": [s["staleness_max"], s["staleness_sum"], s["pushes"]]}})
'''


def replay(record):
    """One process: the recorded events through a fresh policy and a fresh optimizer, as the rules say."""
    names = record["names"]
    params = {n: record["initial"][n].clone() for n in names}
    # a server of several holds its share of each param group
    kept = [i for i, g in enumerate(record["groups"]) if any(n in params for n in g["names"])]
    groups = [{"params": [params[n] for n in record["groups"][i]["names"] if n in params],
               **record["groups"][i]["hyper"]} for i in kept]
    optimizer = record["optimizer"](groups)
    policy = make_policy(record["sync"], record["num_workers"], record["staleness"], record["slack"])
    grads, hyper, absent = {}, {}, {}
    versions = [[t.numpy().tobytes().hex() for t in params.values()]]
    for event in record["events"]:
        if event[0] == "push":
            _, k, iteration, h, g, no_gradient = event
            grads[k], hyper[k], absent[k] = g, h, set(no_gradient)
            decision = policy.push(k, iteration)
        elif event[0] == "epoch":
            decision = policy.end_epoch(event[1], event[2])
        elif event[0] == "unblock":
            decision = policy.unblock()
        else:
            decision = policy.leave(event[1])
        for update in decision.updates:
            for group, h in zip(optimizer.param_groups, [hyper[update[-1][0]][i] for i in kept]):
                group.update({key: v for key, v in h.items() if isinstance(v, (int, float))})
            for n in names:
                # a parameter a push left out (layer selection) counts as zero; one it had no gradient
                # for is left out of bsp's average
                terms = [(grads[k][n], w) for k, w in update if n in grads[k]]
                if terms and decision.average:
                    taking = sum(1 for k, _ in update if n not in absent[k])
                    terms = [(g, 1.0 / taking) for g, _ in terms]
                total = None
                for g, w in terms:
                    total = g * w if total is None else total + g * w
                if len(terms) == 1 and terms[0][1] == 1.0:
                    total = terms[0][0]
                params[n].grad = total
            optimizer.step()
            versions.append([t.detach().numpy().tobytes().hex() for t in params.values()])
    return params, versions


@pytest.mark.parametrize("sync", ["asp", "ssp", "adaptive"])
def test_replaying_the_recorded_arrival_order_gives_the_same_parameters(tmp_path, sync):
    record_path = str(tmp_path / "arrivals")
    results = run_ranks(4, SCRIPT.format(sync=sync, extend=sync == "adaptive", servers=1), tmp_path, timeout=180,
                        env={"FUSIONRING_PS_RECORD": record_path})
    record = torch.load(record_path + ".server0", weights_only=False)
    pushes = [e for e in record["events"] if e[0] == "push"]
    per_worker = [sum(1 for e in pushes if e[1] == k) for k in range(3)]
    assert per_worker[2] == 30  # the straggler
    if sync == "adaptive":
        assert min(per_worker[:2]) >= 30
    else:
        assert per_worker[:2] == [30, 30]
    assert [e[1] for e in pushes] != sorted(e[1] for e in pushes)  # the workers interleaved
    params, versions = replay(record)
    for n in record["names"]:
        assert params[n].numpy().tobytes() == record["final"][n].numpy().tobytes(), n
    for r in results[1:]:
        # each worker ends on the parameters of the server version it was last sent
        assert r["bits"] == versions[r["version"]]
    if sync == "adaptive":
        assert any(r["changes"] for r in results[1:])  # the straggler split the workers into groups


def test_two_adaptive_servers_each_replay_their_own_arrival_order(tmp_path):
    """Each server runs the rule on its own arrival order (a quiet spell aggregating a list that waits on a
    worker the other server holds is recorded too): each server's record replays to its parameters."""
    record_path = str(tmp_path / "arrivals")
    results = run_ranks(5, SCRIPT.format(sync="adaptive", extend=True, servers=2), tmp_path, timeout=240,
                        env={"FUSIONRING_PS_RECORD": record_path})
    for server in (0, 1):
        record = torch.load(f"{record_path}.server{server}", weights_only=False)
        params, _ = replay(record)
        for n in record["names"]:
            assert params[n].numpy().tobytes() == record["final"][n].numpy().tobytes(), (server, n)
    assert any(r["changes"] for r in results[2:])
    for r in results[2:]:
        most, total, pushes = r["staleness"]
        assert most <= total <= most * pushes  # each step counts its stalest shard


PARTLY_USED = r'''
import atexit, torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
k = ps.worker_rank()
torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.side = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)

    def forward(self, x, use):
        h = torch.relu(self.a(x))
        return self.b(h) + (self.side(h) if use else 0)

model = Net()
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              sync="bsp", layer_selection=hvd.LayerSelection.norm(k=1))
for t in range(10):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * k + t))
    opt.zero_grad(); model(x, use=(k == 0 and t % 2 == 0)).pow(2).mean().backward(); opt.step()
ps.shutdown()
report({"bits": [p.detach().numpy().tobytes().hex() for p in model.parameters()]})
'''


def test_a_bsp_record_tells_a_left_out_layer_from_a_parameter_with_no_gradient(tmp_path):
    record_path = str(tmp_path / "partly")
    results = run_ranks(3, PARTLY_USED, tmp_path, timeout=120, env={"FUSIONRING_PS_RECORD": record_path})
    record = torch.load(record_path + ".server0", weights_only=False)
    pushes = [e for e in record["events"] if e[0] == "push"]
    assert any(e[5] for e in pushes) and any(not e[5] for e in pushes)  # the side branch, now and then
    params, versions = replay(record)
    for n in record["names"]:
        assert params[n].numpy().tobytes() == record["final"][n].numpy().tobytes(), n
    assert results[1]["bits"] == results[2]["bits"] == versions[-1]


QUIET = r'''
import atexit, time, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 2:
    atexit.register(report, {"server": True})
ps.init(num_servers=2)
k = ps.worker_rank()
torch.manual_seed(k)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                              sync="adaptive")
gen = torch.Generator().manual_seed(10 + k)
epoch, seen = 0, None
while (epoch < 3) if k == 2 else (seen is None or epoch < seen + 20) and epoch < 3000:
    if k == 2:
        time.sleep(4.0 if epoch == 2 else 0.3)   # the straggler, busy for a while
    elif seen is None and ps.stats()["group_changes"]:
        seen = epoch
        if k == 1:
            time.sleep(1.5)   # worker 0 waits in the group's list, and nobody else pushes
    x = torch.randn(8, 6, generator=gen)
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    opt.end_epoch()
    epoch += 1
s = ps.stats()
ps.shutdown()
report({"changes": len(s["group_changes"])})
'''


def test_a_quiet_spell_releases_a_group_waiting_on_two_servers(tmp_path):
    """With the straggler and worker 1 busy, no push moves the slack counter: each server of
    several aggregates worker 0's gradient alone after a quiet spell, and its record replays."""
    record_path = str(tmp_path / "quiet")
    results = run_ranks(5, QUIET, tmp_path, timeout=180, env={"FUSIONRING_PS_RECORD": record_path})
    assert results[2]["changes"] >= 1
    for server in (0, 1):
        record = torch.load(f"{record_path}.server{server}", weights_only=False)
        assert any(e[0] == "unblock" for e in record["events"]), server
        params, _ = replay(record)
        for n in record["names"]:
            assert params[n].numpy().tobytes() == record["final"][n].numpy().tobytes(), (server, n)
