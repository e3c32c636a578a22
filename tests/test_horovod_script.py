"""An ordinary Horovod training script, only its import changed, equals single-process
training on the same global batch, and every rank ends with the same parameters."""
import pytest
import torch

from conftest import run_ranks

HOROVOD_SCRIPT = r'''
import torch
import torch.nn.functional as F
import horovod.torch as hvd

hvd.init()
torch.manual_seed(1234 + hvd.rank())          # different init per rank: broadcast must fix it
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3),
                            torch.nn.Linear(3, 3))
unused = torch.nn.Linear(3, 3)                # some ranks use it, some do not
params = list(model.named_parameters()) + [("unused." + n, p) for n, p in unused.named_parameters()]
optimizer = torch.optim.SGD([p for _, p in params], lr=0.1 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=params, **EXTRA)
hvd.broadcast_parameters(dict(params), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

g = torch.Generator().manual_seed(7)
X, Y = torch.randn(STEPS * 8 * hvd.size(), 8, generator=g), torch.randint(0, 3, (STEPS * 8 * hvd.size(),), generator=g)
for step in range(STEPS):
    batch = slice(step * 8 * hvd.size(), (step + 1) * 8 * hvd.size())
    x, y = X[batch][hvd.rank()::hvd.size()], Y[batch][hvd.rank()::hvd.size()]
    optimizer.zero_grad()
    out = model(x)
    if hvd.rank() == 0 and step % 2 == 0:
        out = out + 0 * unused(out).sum()      # touches `unused` on rank 0 only
    F.cross_entropy(out, y).backward()
    optimizer.step()
report({n: p.detach().tolist() for n, p in params})
'''.replace("import horovod.torch as hvd", "import fusionring.torch as hvd")


def single_process_reference(world: int, steps: int):
    torch.manual_seed(1234)  # rank 0's init, which the broadcast hands to everyone
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3),
                                torch.nn.Linear(3, 3))
    unused = torch.nn.Linear(3, 3)
    params = list(model.named_parameters()) + [("unused." + n, p)
                                               for n, p in unused.named_parameters()]
    optimizer = torch.optim.SGD([p for _, p in params], lr=0.1 * world, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    n = steps * 8 * world
    X, Y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    for step in range(steps):
        batch = slice(step * 8 * world, (step + 1) * 8 * world)
        optimizer.zero_grad()
        losses = []
        for r in range(world):  # the mean over ranks of each rank's mean loss
            x, y = X[batch][r::world], Y[batch][r::world]
            out = model(x)
            if r == 0 and step % 2 == 0:
                out = out + 0 * unused(out).sum()
            losses.append(torch.nn.functional.cross_entropy(out, y))
        (sum(losses) / world).backward()
        for _, p in params:  # ranks that never touched `unused` contribute zeros
            if p.grad is None and any(q.grad is not None for _, q in params[-2:]):
                p.grad = torch.zeros_like(p)
        optimizer.step()
    return {n: p.detach() for n, p in params}


@pytest.mark.parametrize("np_,extra", [(2, "{}"), (4, "{}"), (3, "{'backward_passes_per_step': 1,"
                                                                " 'op': hvd.Average}")])
def test_horovod_script_matches_single_process_training(np_, extra, tmp_path):
    steps = 6
    code = HOROVOD_SCRIPT.replace("**EXTRA", f"**{extra}").replace("STEPS", str(steps))
    results = run_ranks(np_, code, tmp_path, timeout=120)
    reference = single_process_reference(np_, steps)
    for name in reference:
        ranks = [torch.tensor(r[name]) for r in results]
        for r, value in enumerate(ranks):
            assert torch.equal(value, ranks[0]), f"rank {r} differs on {name}"
        assert torch.allclose(ranks[0], reference[name], atol=2e-5, rtol=1e-4), name
