"""selection/layer_policies.py: which heads each policy picks, and property tests over random
score tensors (hypothesis): every policy prunes exactly the budget or raises ShortfallError,
never breaks its constraints, never re-picks a pruned head."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headprune.selection.layer_policies import (LAYER_POLICIES, GlobalPolicy, ShortfallError, UniformPolicy,
                                                capacity, depth_weights, layer_normalized)


def test_global_picks_lowest_and_respects_minimum():
    scores = torch.tensor([[0.1, 0.2, 0.9], [0.05, 0.8, 0.7]])
    alive = torch.ones(2, 3, dtype=torch.bool)
    assert sorted(GlobalPolicy()(scores, alive, 2)) == [(0, 0), (1, 0)]
    # layer 0 may lose at most 2 of 3 heads with min 1; the next lowest after (0,0),(0,1) is (1,0)
    chosen = GlobalPolicy(min_heads_per_layer=1)(torch.tensor([[0.0, 0.01, 0.02], [0.5, 0.6, 0.7]]), alive, 3)
    assert sorted(chosen) == [(0, 0), (0, 1), (1, 0)]


def test_global_never_rechooses_pruned_and_budget_error():
    scores = torch.zeros(2, 3)
    alive = torch.tensor([[False, True, True], [True, True, True]])
    chosen = GlobalPolicy(min_heads_per_layer=1)(scores, alive, 3)
    assert (0, 0) not in chosen and len(chosen) == 3
    with pytest.raises(ValueError, match="min_heads_per_layer"):
        GlobalPolicy(min_heads_per_layer=1)(scores, alive, 4)


def test_global_normalisation_changes_ranking():
    scores = torch.tensor([[10.0, 20.0], [0.1, 0.3]])
    alive = torch.ones(2, 2, dtype=torch.bool)
    assert GlobalPolicy(min_heads_per_layer=0)(scores, alive, 1) == [(1, 0)]
    normed = layer_normalized(scores, alive)
    assert GlobalPolicy(min_heads_per_layer=0, normalize=True)(scores, alive, 1) == [
        divmod(int(normed.argmin()), 2)]


def test_uniform_spreads_evenly():
    torch.manual_seed(0)
    scores = torch.rand(4, 6)
    alive = torch.ones(4, 6, dtype=torch.bool)
    chosen = UniformPolicy()(scores, alive, 8)
    per_layer = [sum(1 for l, _ in chosen if l == i) for i in range(4)]
    assert per_layer == [2, 2, 2, 2]
    for layer in range(4):
        picked = sorted(h for l, h in chosen if l == layer)
        lowest = sorted(scores[layer].argsort()[:2].tolist())
        assert picked == lowest


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_depth_prior_keeps_more_of_a_heavier_layer_whatever_the_sign_of_the_scores(sign):
    """Layer 1 has weight 2: with the same scores in both layers it must lose fewer heads, for
    positive scores (Taylor, Fisher) and for negative ones (entropy's -H, signed LRP) alike."""
    from headprune.selection.layer_policies import DepthPriorPolicy

    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    scores = sign * torch.stack([base, base]) if sign > 0 else torch.stack([-base.flip(0), -base.flip(0)])
    alive = torch.ones(2, 4, dtype=torch.bool)
    policy = DepthPriorPolicy(protect_first=0, protect_last=0, weights=[1.0, 2.0], normalize=False,
                              min_heads_per_layer=0)
    chosen = policy(scores, alive, 3)
    per_layer = [sum(1 for l, _ in chosen if l == i) for i in range(2)]
    assert per_layer[0] > per_layer[1], (sign, chosen)


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


# every policy that places a number of heads (measured and attention_drop allocate cost budgets from
# the model itself: tests/test_measured_allocation.py)
HEAD_COUNT_POLICIES = sorted(n for n, c in LAYER_POLICIES.items() if not getattr(c, "measures_layout", False))


@pytest.mark.parametrize("name", HEAD_COUNT_POLICIES)
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
