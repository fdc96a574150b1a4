"""Physical shrink during fit: pruned heads leave the weights and the optimizer, and training goes
on exactly as it would with the heads masked."""

import pytest
import torch

from headprune import load_pruned, prune_heads
from headprune.apps.train import run
from headprune.heads.optimizer_state import carry_optimizer_state
from tests.helpers import compose_train, tiny_batch, tiny_bert

TINY = ["model=tiny_bert", "callbacks=none", "logger=none", "data.max_train_samples=96", "data.score_samples=32",
        "data.max_validation_samples=64", "trainer.num_sanity_val_steps=0",
        "+model.config_overrides.hidden_dropout_prob=0.0", "+model.config_overrides.attention_probs_dropout_prob=0.0",
        "schedule=iterative", "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=1",
        "schedule.epochs_per_round=1", "diagnostics.enabled=false"]


def _cfg(out, data_dir, *overrides):
    return compose_train(out, data_dir, *TINY, *overrides)


def test_optimizer_state_is_sliced_with_the_weights(tokenizer):
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tiny_batch(tokenizer)
    for _ in range(2):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    query = model.bert.encoder.layer[1].attention.self.query
    before = {k: v.clone() for k, v in optimizer.state[query.weight].items()}
    sliced = []
    prune_heads(model, {1: [0, 2]}, sliced=sliced)  # head_dim 8: rows 8..15 and 24..31 stay
    assert carry_optimizer_state([optimizer], sliced) == len(sliced) == 3 * 2 + 1  # Q/K/V weight+bias, O weight
    state = optimizer.state[query.weight]
    keep = torch.cat([torch.arange(8, 16), torch.arange(24, 32)])
    assert torch.equal(state["exp_avg"], before["exp_avg"][keep]) and torch.equal(state["step"], before["step"])
    assert all(p is not s.old for s in sliced for g in optimizer.param_groups for p in g["params"])
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(p.numel() for p in model.parameters())
    model(**batch).loss.backward()
    optimizer.step()  # the shrunken model trains on


@pytest.mark.slow  # two training runs: over ~2 s
def test_physical_training_equals_masked_training(tmp_path, data_dir, tokenizer):
    """Without dropout, fine-tuning with the pruned heads removed gives the weights fine-tuning with
    them masked gives: same heads, same accuracies, same exported model (AdamW moments carried over,
    LR schedule where it was). Each round's training time is recorded."""
    physical = run(_cfg(tmp_path / "physical", data_dir))
    masked = run(_cfg(tmp_path / "masked", data_dir, "pruning.physical=false"))
    assert physical["pruning"] == {"physical": True, "physical_effective": True}
    assert masked["pruning"]["physical_effective"] is False
    assert [r["pruned"] for r in physical["rounds"]] == [r["pruned"] for r in masked["rounds"]]
    for a, b in zip(physical["rounds"], masked["rounds"]):
        assert a["val"]["acc"] == b["val"]["acc"] and a["val"]["loss"] == pytest.approx(b["val"]["loss"], abs=1e-5)
        assert a["train_seconds"] > 0 and a["train_samples_per_s"] > 0
    assert physical["baseline"]["train_seconds"] > 0
    batch = tiny_batch(tokenizer)
    a, b = load_pruned(tmp_path / "physical" / "export").eval(), load_pruned(tmp_path / "masked" / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(a(**batch).logits, b(**batch).logits, atol=1e-4, rtol=0)
    # The weights agree to float rounding; one lost optimizer moment would move them by ~lr per step.
    lr = physical["config"]["optim"]["optimizer"]["lr"]
    diff = max(float((a.state_dict()[k] - v).abs().max()) for k, v in b.state_dict().items() if v.numel())
    assert diff < lr / 100, diff


@pytest.mark.slow  # a training run with a rejected round: over ~2 s
def test_a_rejected_round_keeps_its_heads(tmp_path, data_dir):
    """until_threshold may reject a round and restore its heads, so they stay in the model (masked)
    until the next round accepts them; the restored model exports with every head."""
    res = run(_cfg(tmp_path, data_dir, "schedule=until_threshold", "schedule.threshold=1.5"))
    assert res["final"]["stop_reason"].startswith("threshold") and res["final"]["sparsity"] == 0.0
    assert res["final"]["params"] == res["baseline"]["params"]

