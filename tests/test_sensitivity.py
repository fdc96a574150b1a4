"""selection/sensitivity.py: the per-layer sensitivity profile masks the weakest heads of one
layer at a time and leaves the mask as it was."""
import pytest
import torch

def test_sensitivity_profile_masks_the_weakest_heads_of_one_layer(tokenizer):
    from headprune.tasks import CLASSIFICATION
    from headprune.heads.mask import HeadMask
    from headprune.selection.sensitivity import layer_sensitivity, sensitivity_profile
    from tests.helpers import tiny_batch, tiny_bert

    model = tiny_bert()
    mask = HeadMask.for_model(model)
    batches = [tiny_batch(tokenizer, seed=s) for s in range(2)]
    scores = torch.arange(12, dtype=torch.float).reshape(3, 4).flip(1)  # head 3 weakest in every layer
    mask.mask[2, 3] = 0.0  # a pruned head is never "masked" again
    before = mask.mask.clone()
    rows = sensitivity_profile(model, mask, scores, batches, shares=[0.25, 1.0])
    assert [(r["layer"], r["share"], r["heads_masked"]) for r in rows] == [
        (None, 0.0, 0), (0, 0.25, 1), (0, 1.0, 4), (1, 0.25, 1), (1, 1.0, 4), (2, 0.25, 1), (2, 1.0, 3)]
    base = CLASSIFICATION.evaluate(model, batches)
    trial = mask.mask.clone()
    trial[1, 3] = 0.0
    with mask.override(trial):
        masked = CLASSIFICATION.evaluate(model, batches)
    assert rows[0]["loss"] == pytest.approx(base["loss"])
    assert rows[3]["loss"] == pytest.approx(masked["loss"])
    assert rows[3]["loss_change"] == pytest.approx(masked["loss"] - base["loss"])
    assert rows[3]["loss_change"] != 0.0
    assert torch.equal(mask.mask, before)
    rises = layer_sensitivity(model, mask, scores, batches, share=0.25)
    assert rises == pytest.approx([r["loss_change"] for r in rows[1::2]])
    with pytest.raises(ValueError, match=r"layer_policy\.share"):
        sensitivity_profile(model, mask, scores, batches, shares=[0.0])
