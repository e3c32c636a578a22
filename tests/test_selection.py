"""Layer selection's shared part, single process: layers, counts, the agreed top k, error feedback."""
import numpy as np
import pytest
import torch

from fusionring.selection import Accumulator, how_many, layers_of, top_k


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2, bias=False))


def test_layers_group_weight_and_bias_of_one_module():
    assert layers_of(_mlp().named_parameters()) == [["0.weight", "0.bias"], ["2.weight"]]


def test_model_without_parameters_is_refused():
    with pytest.raises(ValueError, match="no parameters"):
        layers_of(torch.nn.ReLU().named_parameters())


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_fraction_outside_unit_interval_is_refused_by_name(fraction):
    with pytest.raises(ValueError, match="fraction"):
        how_many(8, fraction, None)


def test_a_fraction_or_seed_of_another_type_is_refused_by_name():
    """A string fraction was read as a number; a string seed failed in int() naming nothing."""
    from fusionring.selection import LayerSelection
    with pytest.raises(ValueError, match=r"fraction='0.5' must be a number in \(0, 1\]"):
        LayerSelection.norm("0.5")
    with pytest.raises(ValueError, match="seed='x' must be an integer"):
        LayerSelection.random(0.5, seed="x")
    assert LayerSelection.random(0.5, seed=np.int64(3)).seed == 3


def test_count_from_fraction_or_k():
    assert how_many(8, 0.25, None) == 2
    assert how_many(8, None, 3) == 3
    assert how_many(3, 0.01, None) == 1
    with pytest.raises(ValueError, match="k="):
        how_many(8, None, 9)


def test_top_k_breaks_ties_by_lower_index_and_honours_forced_layers():
    assert top_k([1.0, 3.0, 3.0, 2.0], 2) == [1, 2]
    assert top_k([1.0, 1.0, 1.0, 1.0], 2) == [0, 1]
    assert top_k([1.0, 3.0, 3.0, 2.0], 2, forced=[0]) == [0, 1]


def test_sent_plus_residual_equals_sum_of_gradients():
    layers = [["a"], ["b"]]
    acc = Accumulator(2)
    g = torch.Generator().manual_seed(1)
    total = {"a": torch.zeros(3), "b": torch.zeros(3)}
    sent = {"a": torch.zeros(3), "b": torch.zeros(3)}
    for step in range(5):
        grads = {n: torch.randn(3, generator=g) for n in "ab"}
        for n in "ab":
            total[n] += grads[n]
        summed = {n: acc.add(n, grads[n]) for n in "ab"}
        chosen = [step % 2]
        for i in chosen:
            sent[layers[i][0]] += summed[layers[i][0]]
        acc.settle(chosen, layers, summed)
    for n in "ab":
        kept = acc.residual.get(n, torch.zeros(3))
        torch.testing.assert_close(sent[n] + kept, total[n])


def test_max_wait_forces_a_starved_layer():
    acc = Accumulator(3, max_wait=2)
    layers = [["a"], ["b"], ["c"]]
    for _ in range(2):
        acc.settle([0], layers, {})
    assert acc.forced() == [1, 2]
    assert top_k([9.0, 0.0, 0.0], 1, acc.forced()) == [1]


def test_accumulator_state_round_trip():
    acc = Accumulator(2, max_wait=4)
    acc.settle([0], [["a"], ["b"]], {"a": torch.ones(2), "b": torch.full((2,), 2.0)})
    again = Accumulator(2)
    again.load_state_dict(acc.state_dict())
    assert again.waited == [0, 1] and again.max_wait == 4
    torch.testing.assert_close(again.residual["b"], torch.full((2,), 2.0))


from fusionring.selection import LayerSelection  # noqa: E402


def _deep():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])


def _grads(model):
    model.zero_grad()
    model(torch.randn(5, 4)).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_baselines_learn_layers_when_attached_and_hyper_from_the_model():
    model = _deep()
    sel = LayerSelection.norm(0.25)
    assert sel.layers == []
    sel.attach(model.named_parameters())
    assert len(sel.layers) == 8 and sel.k == 2
    assert LayerSelection.hyper(model, fraction=0.5).k == 4
    assert LayerSelection.round_robin(k=3, model=model).k == 3


def test_selection_refuses_parameters_the_optimizer_does_not_own():
    model = _deep()
    sel = LayerSelection.hyper(model, fraction=0.25)
    with pytest.raises(ValueError, match="not owned"):
        sel.attach(list(model.named_parameters())[:4])


def test_hyper_factory_refuses_bad_fraction_and_parameterless_model():
    with pytest.raises(ValueError, match="fraction"):
        LayerSelection.hyper(_deep(), fraction=1.5)
    with pytest.raises(ValueError, match="no parameters"):
        LayerSelection.hyper(torch.nn.ReLU())


def test_norm_picks_the_largest_gradient_per_element():
    model = _deep()
    sel = LayerSelection.norm(k=1, model=model)
    g = _grads(model)
    g["5.weight"] = g["5.weight"] * 0 + 100.0
    assert sel.choose(sel.scores(g)) == [5]


def test_round_robin_visits_every_layer_once_per_cycle():
    sel = LayerSelection.round_robin(0.25, model=_deep())
    seen = []
    for _ in range(4):
        seen += sel.choose(sel.scores({}))
        sel.step_count += 1
    assert sorted(seen) == list(range(8))


def test_random_is_reproducible_from_its_seed_and_its_state():
    a, b = (LayerSelection.random(0.25, seed=3, model=_deep()) for _ in range(2))
    assert [a.choose(a.scores({})) for _ in range(5)] == [b.choose(b.scores({})) for _ in range(5)]
    state = a.state_dict()
    nxt = a.choose(a.scores({}))
    b.load_state_dict(state)
    assert b.choose(b.scores({})) == nxt


def test_hyper_leaves_the_model_unchanged_and_resumes_exactly():
    model = _deep()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sel = LayerSelection.hyper(model, fraction=0.25, hidden=16, lr=1e-2)
    for _ in range(3):
        sel.scores(_grads(model))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    state = sel.state_dict()
    twin = LayerSelection.hyper(model, fraction=0.25, hidden=16, lr=1e-2)
    twin.load_state_dict(state)
    torch.manual_seed(7)
    g = _grads(model)
    s1 = sel.scores(g)
    s2 = twin.scores(g)
    assert s1 == s2 and any(x > 0 for x in s1)


def test_optimizer_state_round_trip_continues_bit_exactly():
    import copy

    import fusionring.torch as hvd
    hvd.init()

    def run(steps, state=None):
        model = _deep()
        sel = LayerSelection.hyper(model, fraction=0.25, hidden=8, lr=1e-2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), layer_selection=sel)
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        for step in steps:
            opt.zero_grad()
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            opt.step()
        return model, opt

    whole, _ = run(range(6))
    half, opt = run(range(3))
    saved = (copy.deepcopy(half.state_dict()), copy.deepcopy(opt.state_dict()))
    resumed, _ = run(range(3, 6), saved)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_hyper_scores_stay_finite_where_alpha_underflows():
    model = _deep()
    sel = LayerSelection.hyper(model, fraction=0.25, hidden=8)
    with torch.no_grad():
        sel.fc2.bias.fill_(-200.0)   # sigmoid(-200) is 0 in float32
    assert float(sel.alpha().min()) == 0.0
    for _ in range(3):
        scores = sel.scores(_grads(model))
    assert all(s == s and abs(s) != float("inf") for s in scores)
    assert all(torch.isfinite(p).all() for p in sel.net_params)


# Recorded summed probabilities of 8 layers: two the hypernetwork moves a lot, five a little,
# one barely (an alpha that has stopped moving).
STILL = [10.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.05]


def _sends(sel, steps, scores=STILL):
    counts = [0] * len(scores)
    for _ in range(steps):
        for i in sel.choose(scores):
            counts[i] += 1
        sel.acc.settle([], sel.layers, {})  # choose() alone decides; waits do not force here
    return counts


def test_hyper_top_k_alone_starves_a_still_layer_and_accumulation_sends_it():
    literal = _sends(LayerSelection.hyper(_deep(), k=2, accumulate=False), 200)
    assert literal == [200, 200, 0, 0, 0, 0, 0, 0]
    counts = _sends(LayerSelection.hyper(_deep(), k=2), 200)
    assert sum(counts) == 400 and all(c > 0 for c in counts)
    # More probability, more sends: a layer earns k * p / sum(p) of a send per step.
    assert counts[0] >= counts[1] > max(counts[2:7]) >= min(counts[2:7]) > counts[7]
    share = [2 * s / sum(STILL) for s in STILL]
    for c, q in zip(counts[2:], share[2:]):  # a layer under one send per step gets about its share
        assert abs(c / 200 - q) <= 0.5 * q + 0.01


def test_hyper_credit_follows_the_rule_and_round_trips():
    sel = LayerSelection.hyper(_deep(), k=2)
    ref = [0.0] * 8
    for step in range(30):
        scores = [float((step * 7 + i * 3) % 5) + 0.1 * i for i in range(8)]
        ref = [c + 2 * s / sum(scores) for c, s in zip(ref, scores)]
        want = sorted(sorted(range(8), key=lambda i: (-ref[i], i))[:2])
        for i in want:
            ref[i] = 0.0
        assert sel.choose(scores) == want
    twin = LayerSelection.hyper(_deep(), k=2)
    twin.load_state_dict(sel.state_dict())
    assert _sends(twin, 20) == _sends(sel, 20)


def test_hyper_with_no_probability_yet_takes_the_first_layers_and_earns_nothing():
    sel = LayerSelection.hyper(_deep(), k=2)
    assert sel.choose([0.0] * 8) == [0, 1]
    assert sel.credit == [0.0] * 8


@pytest.mark.parametrize("make", [lambda m, w: LayerSelection.hyper(m, k=2, warmup_steps=w),
                                  lambda m, w: LayerSelection.norm(k=2, model=m, warmup_steps=w),
                                  lambda m, w: LayerSelection.round_robin(k=2, model=m, warmup_steps=w),
                                  lambda m, w: LayerSelection.random(k=2, model=m, warmup_steps=w)])
def test_warmup_sends_every_layer_first_then_k(make):
    model = _deep()
    sel = make(model, 3)
    for step in range(6):
        scores = [float((step * 5 + i * 3) % 7) for i in range(8)]
        got = sel.choose(scores)
        if step < 3:
            assert got == list(range(8))
        else:
            assert len(got) == 2
        sel.step_count += 1
    if hasattr(sel, "credit"):
        assert sel.credit != [0.0] * 8    # credit is earned from the first step after warm-up


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_warmup_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="warmup_steps"):
        LayerSelection.norm(0.25, warmup_steps=bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_waiting_16_bit_layer_keeps_its_small_gradients(dtype):
    """A layer that waits 400 steps with a gradient of 0.003 each holds 1.2: summed in float32,
    not in its 16-bit dtype (where bfloat16 stalls at 1.0 and float16 drifts)."""
    from fusionring.selection.base import Accumulator
    acc = Accumulator(1)
    g = torch.full((5,), 0.003, dtype=dtype)
    for _ in range(400):
        summed = {"w": acc.add("w", g)}
        acc.settle([], [["w"]], summed)
    want = 400 * float(g[0])
    torch.testing.assert_close(acc.residual["w"], torch.full((5,), want), rtol=1e-5, atol=0)
