"""op=Adasum: the allreduce and the DistributedOptimizer, against a single-process reference."""
import numpy as np
import pytest
import torch

from conftest import run_ranks


def adasum_pair(a, b):
    """The Adasum combination of two vectors, in float64."""
    dot, na, nb = a @ b, a @ a, b @ b
    ca = 1.0 - dot / (2 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2 * nb) if nb > 0 else 1.0
    return ca * a + cb * b


def adasum_tree(vectors, stored=None):
    """Pairs (0, 1), (2, 3), ... first, then pairs of those results, and so on. With
    `stored` (a numpy dtype), every level's result is rounded to it, as a buffer of that
    dtype holds it between levels."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        if stored is not None:
            level = [v.astype(stored).astype(np.float64) for v in level]
    return level[0]


def rank_vector(r, n, seed):
    return np.random.default_rng(seed * 100 + r).standard_normal(n)


ALLREDUCE = r'''
import numpy as np
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}
def vec(n, seed):
    return np.random.default_rng(seed * 100 + r).standard_normal(n)
if P & (P - 1) == 0:
    out["f64"] = hvd.allreduce(torch.tensor(vec(1000, 1)), op=hvd.Adasum, name="f64").tolist()
    out["f32"] = hvd.allreduce(torch.tensor(vec(333, 2), dtype=torch.float32).reshape(3, 111),
                               op=hvd.Adasum, name="f32").flatten().tolist()
    out["f16"] = hvd.allreduce(torch.tensor(vec(64, 3), dtype=torch.float16), op=hvd.Adasum,
                               name="f16").float().tolist()
    # Long enough for several of the 16-bit kernel's blocks, with a tail of odd length.
    out["f16 long"] = hvd.allreduce(torch.tensor(vec(9001, 9), dtype=torch.float16),
                                    op=hvd.Adasum, name="f16 long").float().tolist()
    grouped = hvd.grouped_allreduce([torch.tensor(vec(50, 4)), torch.tensor(vec(7, 5))],
                                    op=hvd.Adasum, name="grp")
    out["grouped"] = [g.tolist() for g in grouped]
    t = torch.tensor(vec(20, 6))
    hvd.allreduce_(t, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5, name="scaled")
    out["scaled"] = t.tolist()
    out["zeros"] = hvd.allreduce(torch.zeros(5, dtype=torch.float64), op=hvd.Adasum).tolist()
    # Fewer elements than ranks: some ranks hold empty pieces while the vector is halved.
    out["tiny"] = [hvd.allreduce(torch.tensor(vec(n, 7 + n)), op=hvd.Adasum,
                                 name=f"tiny{n}").tolist() for n in (1, 2, 3)]
    out["bf16"] = hvd.allreduce(torch.tensor(vec(40, 8), dtype=torch.bfloat16), op=hvd.Adasum,
                                name="bf16").float().tolist()
    # Parallel vectors average, however small or unlike in scale (no threshold on norms).
    base = np.random.default_rng(1000).standard_normal(64)  # the same direction everywhere
    out["parallel tiny"] = hvd.allreduce(torch.tensor(base * 1e-30 * (r + 1), dtype=torch.float32),
                                         op=hvd.Adasum, name="parallel tiny").tolist()
    out["parallel scales"] = hvd.allreduce(torch.tensor(base * 10.0 ** (-12 * r)), op=hvd.Adasum,
                                           name="parallel scales").tolist()
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    except ValueError as exc:
        out["int error"] = str(exc)
else:
    try:
        hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="odd")
    except NotImplementedError as exc:   # as in Horovod
        out["size error"] = str(exc)
out["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist()
report(out)
'''


@pytest.mark.parametrize("np_", [2, 4, 8])
def test_adasum_allreduce_matches_the_tree_reference(tmp_path, np_):
    results = run_ranks(np_, ALLREDUCE, tmp_path, timeout=90)
    for out in results:
        for key in ("f64", "f32", "f16", "f16 long", "bf16", "grouped", "scaled", "tiny"):
            assert out[key] == results[0][key], key  # bitwise identical on every rank
    ref = lambda n, seed: adasum_tree([rank_vector(r, n, seed) for r in range(np_)])  # noqa: E731
    out = results[0]
    np.testing.assert_allclose(out["f64"], ref(1000, 1), rtol=1e-12, atol=1e-12)
    f32_inputs = [np.float32(rank_vector(r, 333, 2)).astype(np.float64) for r in range(np_)]
    np.testing.assert_allclose(out["f32"], adasum_tree(f32_inputs), rtol=1e-5, atol=1e-5)
    f16_inputs = [np.float16(rank_vector(r, 64, 3)).astype(np.float64) for r in range(np_)]
    np.testing.assert_allclose(out["f16"], adasum_tree(f16_inputs), rtol=2e-3, atol=2e-3)
    # (torch rounds float64 to float16 through float32, as the ranks' inputs were made)
    f16_long = [torch.tensor(rank_vector(r, 9001, 9), dtype=torch.float16).double().numpy()
                for r in range(np_)]
    # float16 travels as float16, so each level's result is rounded to it (to within the
    # rounding of float64 -> float32 -> float16: one unit in the last place).
    np.testing.assert_allclose(out["f16 long"], adasum_tree(f16_long, np.float16), rtol=1e-3,
                               atol=1e-4)
    np.testing.assert_allclose(out["grouped"][0], ref(50, 4), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out["grouped"][1], ref(7, 5), rtol=1e-12, atol=1e-12)
    # prescale applies to every input, postscale to the result.
    scaled = 0.5 * adasum_tree([2.0 * rank_vector(r, 20, 6) for r in range(np_)])
    np.testing.assert_allclose(out["scaled"], scaled, rtol=1e-12, atol=1e-12)
    assert out["zeros"] == [0.0] * 5
    for n, got in zip((1, 2, 3), out["tiny"]):
        np.testing.assert_allclose(got, ref(n, 7 + n), rtol=1e-12, atol=1e-12)
    bf16_inputs = [torch.tensor(rank_vector(r, 40, 8), dtype=torch.bfloat16).double().numpy()
                   for r in range(np_)]
    np.testing.assert_allclose(out["bf16"], adasum_tree(bf16_inputs), rtol=2e-2, atol=2e-2)
    base = np.random.default_rng(1000).standard_normal(64)
    np.testing.assert_allclose(out["parallel tiny"],
                               base * 1e-30 * np.mean([r + 1 for r in range(np_)]), rtol=1e-5)
    np.testing.assert_allclose(out["parallel scales"],
                               base * np.mean([10.0 ** (-12 * r) for r in range(np_)]), rtol=1e-9)
    assert "floating-point" in out["int error"]
    assert out["after"] == [float(np_)] * 2


def test_adasum_needs_a_power_of_two_ranks(tmp_path):
    for out in run_ranks(3, ALLREDUCE, tmp_path, timeout=60):
        assert "power-of-two number of ranks, not 3" in out["size error"]
        assert out["after"] == [3.0, 3.0]


OPTIMIZER = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters(), op=hvd.Adasum)
for step in range(3):
    g = torch.Generator().manual_seed(100 * step + r)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
report([p.detach().flatten().tolist() for p in model.parameters()])
'''


def _optimizer_reference(P):
    """Every rank steps its own SGD (own momentum) from the shared weights; the deltas are
    combined by the Adasum tree and added to the shared weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    shared = [p.detach().clone() for p in model.parameters()]
    momenta = [[None] * len(shared) for _ in range(P)]
    for step in range(3):
        deltas = []
        for r in range(P):
            with torch.no_grad():
                for p, s in zip(model.parameters(), shared):
                    p.copy_(s)
            g = torch.Generator().manual_seed(100 * step + r)
            x, y = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            delta = []
            for i, p in enumerate(model.parameters()):
                buf = momenta[r][i]
                buf = p.grad.clone() if buf is None else buf * 0.9 + p.grad
                momenta[r][i] = buf
                delta.append(-0.1 * buf)
            deltas.append(delta)
        for i in range(len(shared)):
            combined = adasum_tree([d[i].double().flatten().numpy() for d in deltas])
            shared[i] = shared[i] + torch.tensor(combined, dtype=torch.float32).view_as(shared[i])
    return [s.flatten().tolist() for s in shared]


def test_adasum_distributed_optimizer(tmp_path):
    results = run_ranks(2, OPTIMIZER, tmp_path, timeout=60)
    assert results[0] == results[1]
    expected = _optimizer_reference(2)
    for got, want in zip(results[0], expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
