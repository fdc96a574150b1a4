import pytest
import torch

from headprune.selection.layer_policies import GlobalPolicy, UniformPolicy, layer_normalized
from headprune.selection.schedules import Iterative, OneShot


def test_iterative_sparsities_and_epochs():
    s = Iterative(target_sparsity=0.5, step=0.1, baseline_epochs=2, epochs_per_round=1)
    assert s.sparsities() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert s.total_epochs() == 7
    assert [s.heads_after(i, 72) for i in range(5)] == [7, 14, 22, 29, 36]
    assert Iterative(target_sparsity=0.25, step=0.1).sparsities() == pytest.approx([0.1, 0.2, 0.25])
    assert Iterative(target_sparsity=0.0).sparsities() == []


def test_one_shot():
    s = OneShot(target_sparsity=0.7, baseline_epochs=0, epochs_per_round=0)
    assert s.sparsities() == [0.7] and s.total_epochs() == 0


@pytest.mark.parametrize("bad", [1.0, 1.2, -0.1])
def test_target_sparsity_outside_range_names_field(bad):
    with pytest.raises(ValueError, match=r"schedule\.target_sparsity=.*\[0, 1\)"):
        Iterative(target_sparsity=bad)


def test_bad_step_and_epochs_name_field():
    with pytest.raises(ValueError, match=r"schedule\.step=0"):
        Iterative(step=0)
    with pytest.raises(ValueError, match=r"schedule\.epochs_per_round=-1"):
        OneShot(epochs_per_round=-1)


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


def test_sensitivity_profile_masks_the_weakest_heads_of_one_layer(tokenizer):
    from headprune.tasks import evaluate
    from headprune.heads.mask import HeadMask
    from headprune.selection.sensitivity import layer_sensitivity, sensitivity_profile
    from tests.conftest import tiny_batch, tiny_bert

    model = tiny_bert()
    mask = HeadMask.for_model(model)
    batches = [tiny_batch(tokenizer, seed=s) for s in range(2)]
    scores = torch.arange(12, dtype=torch.float).reshape(3, 4).flip(1)  # head 3 weakest in every layer
    mask.mask[2, 3] = 0.0  # a pruned head is never "masked" again
    before = mask.mask.clone()
    rows = sensitivity_profile(model, mask, scores, batches, shares=[0.25, 1.0])
    assert [(r["layer"], r["share"], r["heads_masked"]) for r in rows] == [
        (None, 0.0, 0), (0, 0.25, 1), (0, 1.0, 4), (1, 0.25, 1), (1, 1.0, 4), (2, 0.25, 1), (2, 1.0, 3)]
    base = evaluate(model, batches)
    trial = mask.mask.clone()
    trial[1, 3] = 0.0
    with mask.override(trial):
        masked = evaluate(model, batches)
    assert rows[0]["loss"] == pytest.approx(base["loss"])
    assert rows[3]["loss"] == pytest.approx(masked["loss"])
    assert rows[3]["loss_change"] == pytest.approx(masked["loss"] - base["loss"])
    assert rows[3]["loss_change"] != 0.0
    assert torch.equal(mask.mask, before)
    rises = layer_sensitivity(model, mask, scores, batches, share=0.25)
    assert rises == pytest.approx([r["loss_change"] for r in rows[1::2]])
    with pytest.raises(ValueError, match=r"layer_policy\.share"):
        sensitivity_profile(model, mask, scores, batches, shares=[0.0])


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


def test_one_rule_for_the_last_head():
    from headprune.selection.schedules import OneShot

    OneShot(target_sparsity=0.99).check_model(total_heads=144)  # round(142.56) = 143: one head left
    with pytest.raises(ValueError, match=r"removes all 12 heads of this model.*at most 0\.9167"):
        OneShot(target_sparsity=0.99).check_model(total_heads=12)
    with pytest.raises(ValueError, match=r"at least one head must remain"):
        OneShot(target_sparsity=1.0)
