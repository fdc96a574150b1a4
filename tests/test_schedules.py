"""Property tests over random score tensors: every policy prunes exactly the budget or raises
ShortfallError, never breaks its constraints, never re-picks a pruned head; schedules are
monotone and end at the target."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headprune.selection.layer_policies import (LAYER_POLICIES, ShortfallError, capacity, depth_weights)
from headprune.selection.schedules import Cubic, Iterative, OneShot, UntilThreshold


@st.composite
def situations(draw):
    layers = draw(st.integers(1, 6))
    heads = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(layers, heads, generator=g)
    if draw(st.booleans()):
        scores = (scores * 3).round()  # many ties
    alive = torch.rand(layers, heads, generator=g) > draw(st.floats(0.0, 0.6))
    min_heads = draw(st.integers(0, 2))
    max_prune = draw(st.one_of(st.none(), st.integers(0, heads)))
    n_prune = draw(st.integers(0, layers * heads))
    return scores, alive, n_prune, min_heads, max_prune


def _options(name, layers, seed=0):
    if name == "sensitivity":
        g = torch.Generator().manual_seed(seed)
        return {"sensitivity": (torch.rand(layers, generator=g) - 0.2).tolist()}
    if name == "depth_prior":
        return {"protect_first": 1 if layers > 2 else 0, "protect_last": 1 if layers > 2 else 0,
                "weights": [2.0, 1.0, 2.0]}
    return {}


@pytest.mark.parametrize("name", sorted(LAYER_POLICIES))
@settings(max_examples=120, deadline=None)
@given(case=situations())
def test_policy_budget_and_constraints(name, case):
    scores, alive, n_prune, min_heads, max_prune = case
    layers, heads = alive.shape
    options = _options(name, layers)
    sensitivity = options.pop("sensitivity", None)
    policy = LAYER_POLICIES[name](min_heads_per_layer=min_heads, max_prune_per_layer=max_prune, **options)
    caps = capacity(alive, min_heads, max_prune)
    if name == "depth_prior" and layers > 2:
        caps[0] = caps[-1] = 0
    try:
        chosen = policy(scores, alive, n_prune, sensitivity=sensitivity)
    except ShortfallError as err:
        assert n_prune > sum(caps) and err.available == sum(caps)
        assert "min_heads_per_layer" in str(err)
        return
    assert len(chosen) == n_prune
    assert len(set(chosen)) == n_prune
    assert all(alive[l, h] for l, h in chosen), "re-picked an already pruned head"
    after = alive.clone()
    for l, h in chosen:
        after[l, h] = False
    for layer in range(layers):
        lost_now = int(alive[layer].sum() - after[layer].sum())
        assert lost_now <= caps[layer]
        if lost_now:
            assert int(after[layer].sum()) >= min_heads
            if max_prune is not None:
                assert heads - int(after[layer].sum()) <= max_prune


@settings(max_examples=200, deadline=None)
@given(target=st.floats(0.0, 0.99), step=st.floats(0.01, 0.99), rounds=st.integers(1, 12),
       initial=st.floats(0.0, 0.99))
def test_schedules_monotone_and_end_at_target(target, step, rounds, initial):
    initial = min(initial, target)
    for schedule in (Iterative(target_sparsity=target, step=step), OneShot(target_sparsity=target),
                     Cubic(target_sparsity=target, rounds=rounds, initial_sparsity=initial),
                     UntilThreshold(target_sparsity=target, step=step)):
        s = schedule.sparsities()
        if target == 0:
            assert s == []
            continue
        assert s[-1] == pytest.approx(target)
        assert all(b >= a - 1e-12 for a, b in zip(s, s[1:]))
        assert all(0 < x <= target + 1e-12 for x in s)
        counts = [schedule.heads_after(i, 144) for i in range(len(s))]
        assert counts == sorted(counts)


def test_cubic_shape():
    s = Cubic(target_sparsity=0.8, rounds=4).sparsities()
    assert s == pytest.approx([0.8 - 0.8 * (3 / 4) ** 3, 0.8 - 0.8 * (1 / 2) ** 3, 0.8 - 0.8 * (1 / 4) ** 3, 0.8])
    steps = [b - a for a, b in zip([0.0] + s, s)]
    assert steps == sorted(steps, reverse=True)  # fast first, slow near the target


def test_until_threshold_rule():
    s = UntilThreshold(threshold=0.98)
    assert s.stop_reason({"acc": 0.9}, {"acc": 0.89}) is None
    assert s.stop_reason({"acc": 0.9}, {"acc": 0.87}).startswith("threshold")
    with pytest.raises(ValueError, match=r"schedule\.threshold"):
        UntilThreshold(threshold=0)


def test_depth_weights():
    assert depth_weights(5, weights=[2.0, 1.0, 2.0]) == [2.0, 1.5, 1.0, 1.5, 2.0]
    w = depth_weights(4, protect_first=1, protect_last=1)
    assert w[0] == w[-1] == float("inf") and w[1:3] == [1.0, 1.0]


def test_sensitivity_policy_prefers_insensitive_layers():
    scores = torch.rand(3, 8, generator=torch.Generator().manual_seed(0))
    alive = torch.ones(3, 8, dtype=torch.bool)
    chosen = LAYER_POLICIES["sensitivity"]()(scores, alive, 9, sensitivity=[1.0, 0.1, 1.0])
    per_layer = [sum(1 for l, _ in chosen if l == i) for i in range(3)]
    assert per_layer[1] > per_layer[0] and per_layer[1] > per_layer[2]
