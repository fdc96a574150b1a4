"""The trainer-free Pruner: a whole prune-and-fine-tune schedule without a Trainer, its state for
resume (the cost table travels with it), budgets as classes and recoveries with hooks."""
import copy

import pytest
import torch

from headprune import Loaders, Pruner, get_metric, prune_heads, prune_to_budget
from headprune.recovery import Distill, LeastSquares, NoRecovery
from headprune.results import RunResults
from headprune.selection.budgets import FlopsBudget, KVBudget, LatencyBudget, allocate
from headprune.selection.layer_policies import GlobalPolicy, SensitivityPolicy, UniformPolicy
from headprune.selection.schedules import Iterative, OneShot
from tests.helpers import tiny_batch, tiny_bert


def _loaders(tokenizer) -> Loaders:
    return Loaders(score=[tiny_batch(tokenizer, 8, seed=s) for s in range(2)], val=[tiny_batch(tokenizer, 8, seed=9)])


def test_prune_and_finetune_without_a_trainer(tokenizer):
    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    schedule = Iterative(target_sparsity=0.5, step=0.25, baseline_epochs=0, epochs_per_round=1)
    pruner = Pruner(model, get_metric("taylor"), schedule, GlobalPolicy())
    loaders, seen = _loaders(tokenizer), []

    def finetune(m, k):
        seen.append(k)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        for batch in loaders.score:
            pruner.loss(batch).backward()
            opt.step()
            opt.zero_grad()

    data = pruner.run(loaders, finetune=finetune)
    assert seen == [0, 1] and [r["round"] for r in data["rounds"]] == [1, 2]
    assert all(set(r) >= {"val", "val_before_finetune", "scores", "pruned"} for r in data["rounds"])
    assert data["final"]["sparsity"] == 0.5 and data["final"]["stop_reason"] == "target_reached"
    assert data["final"]["val"] == data["rounds"][-1]["val"]  # no recovery epochs: the last round's


def test_a_resumed_pruner_continues_where_it_stopped(tokenizer):
    """Round 1, state_dict, a fresh Pruner on a copy of the model: round 2 prunes what the
    uninterrupted run pruned."""
    schedule = Iterative(target_sparsity=0.5, step=0.25, baseline_epochs=0, epochs_per_round=0)
    loaders = _loaders(tokenizer)
    whole = Pruner(tiny_bert(), get_metric("magnitude"), schedule, GlobalPolicy())
    whole.run(loaders)
    first = Pruner(tiny_bert(), get_metric("magnitude"), schedule, GlobalPolicy())
    first.record_baseline(loaders)
    first.step(0, loaders)
    model = copy.deepcopy(first.model)
    again = Pruner(model, get_metric("magnitude"), schedule, GlobalPolicy())
    again.mask.mask.copy_(first.mask.mask)
    again.load_state_dict(copy.deepcopy(first.state_dict()))
    data = again.run(loaders)
    assert [r["pruned"] for r in data["rounds"]] == [r["pruned"] for r in whole.rounds]


def test_a_resumed_latency_run_keeps_its_dense_costs(tmp_path, tokenizer):
    """The cost table travels in the state: a resumed latency-budget run whose table cache is gone
    measures nothing on its (physically pruned) model and writes no table under the dense key;
    its dense reference for the final measurement is a model of the dense shape."""
    budget = LatencyBudget(target=0.8, batch=2, seq=8, warmup=0, repeats=1, cache_dir=str(tmp_path / "cache"))
    schedule = Iterative(target_sparsity=0.5, step=0.25, baseline_epochs=0, epochs_per_round=0)
    loaders = _loaders(tokenizer)
    first = Pruner(tiny_bert(), get_metric("magnitude"), schedule, GlobalPolicy(), budget)
    first.record_baseline(loaders)
    first.step(0, loaders)
    state = copy.deepcopy(first.state_dict())
    for f in (tmp_path / "cache").iterdir():
        f.unlink()
    pruned = prune_heads(copy.deepcopy(first.mask.unmasked_copy(first.model)), first.mask.pruned())
    again = Pruner(pruned, get_metric("magnitude"), schedule, GlobalPolicy(), budget, dense_factory=tiny_bert)
    again.load_state_dict(state)
    again.resume()
    assert again.costs == first.costs and not any((tmp_path / "cache").iterdir())
    assert sum(p.numel() for p in again.dense.parameters()) > sum(p.numel() for p in pruned.parameters())
    again.step(1, loaders)
    assert again.rounds[-1]["budget"]["dense_cost"] == first.costs.dense


# -- budgets -----------------------------------------------------------------------------------
def test_cost_budgets_refuse_what_they_would_ignore():
    with pytest.raises(ValueError, match="schedule.target_sparsity=0 plans no round"):
        FlopsBudget(target=0.5).check(OneShot(target_sparsity=0.0), GlobalPolicy())
    with pytest.raises(ValueError, match="layer_policy=sensitivity with budget=flops"):
        FlopsBudget(target=0.5).check(OneShot(target_sparsity=0.5), SensitivityPolicy())
    with pytest.raises(ValueError, match="budget=kv keeps a share of the KV cache, which only a decoder"):
        KVBudget(target=0.5).check_model(tiny_bert(), OneShot())
    with pytest.raises(ValueError, match=r"budget.target=1.5 must be in \(0, 1\]"):
        FlopsBudget(target=1.5)


def test_kv_seq_is_not_checked_against_positions_but_flops_seq_is():
    model = tiny_bert(max_position_embeddings=64)
    FlopsBudget(seq=64).check_model(model, OneShot())
    with pytest.raises(ValueError, match="budget.seq=128 exceeds the model's 64 positions"):
        FlopsBudget(seq=128).check_model(model, OneShot())


@pytest.mark.parametrize("target", [1.5, -1.0, 0.0, "half"])
def test_prune_to_budget_checks_its_target(target, tokenizer):
    with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
        prune_to_budget(tiny_bert(), [tiny_batch(tokenizer)], {"kind": "heads", "target": target}, recovery="none")


def test_prune_to_budget_refuses_a_training_recovery(tokenizer):
    with pytest.raises(ValueError, match="allowed: recovery=least_squares, none"):
        prune_to_budget(tiny_bert(), [tiny_batch(tokenizer)], {"kind": "heads", "target": 0.5}, recovery="distill")


def test_a_cost_budget_keeps_at_least_one_head(tokenizer):
    report = prune_to_budget(tiny_bert(), [tiny_batch(tokenizer)], {"kind": "flops", "target": 0.05, "batch": 2,
                                                                    "seq": 8}, metric="magnitude", recovery="none",
                             rearrange=False, layer_policy=GlobalPolicy(min_heads_per_layer=0))
    assert sum(report["round"]["heads_per_layer"]) >= 1


def test_an_unreachable_cost_target_ends_as_budget_not_met(tokenizer):
    pruner = Pruner(tiny_bert(), get_metric("magnitude"), OneShot(target_sparsity=0.5, epochs_per_round=0),
                    GlobalPolicy(min_heads_per_layer=1), FlopsBudget(target=0.01, batch=2, seq=8), NoRecovery())
    data = pruner.run(_loaders(tokenizer))
    assert data["final"]["stop_reason"].startswith("budget not met: ") and "shortfall" in data["rounds"][0]


def test_the_policy_ranks_units_for_a_cost_budget():
    """`normalize` is used, not ignored: layer 0's raw scores are 100x layer 1's, so without it the
    budget takes all it may from layer 1 (one head per layer stays); normalised, the cuts split."""
    scores = torch.tensor([[100.0, 200.0, 300.0, 400.0], [1.0, 2.0, 3.0, 4.0]])
    alive = torch.ones(2, 4, dtype=torch.bool)
    costs = FlopsBudget(batch=1, seq=4)
    from headprune.costs.tables import LayerCosts

    table = LayerCosts([{k: float(k) for k in range(5)} for _ in range(2)], 8.0, unit="FLOPs")
    units = [[h] for h in range(4)]
    raw, _ = allocate(scores, alive, table, 0.5, GlobalPolicy(normalize=False), units)
    normed, _ = allocate(scores, alive, table, 0.5, GlobalPolicy(normalize=True), units)
    same, report = allocate(scores, alive, table, 0.5, UniformPolicy(), units)
    assert sorted(raw) == [(0, 0), (1, 0), (1, 1), (1, 2)] and costs.kind == "flops"
    assert sorted(normed) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert report["kept_units_per_layer"] == [2, 2]


# -- recoveries --------------------------------------------------------------------------------
def test_recoveries_check_their_schedules():
    with pytest.raises(ValueError, match="recovery=distill trains after each round"):
        Distill().check(OneShot(target_sparsity=0.5, epochs_per_round=0))
    with pytest.raises(ValueError, match="recovery=none trains nothing after pruning"):
        NoRecovery().check(OneShot(target_sparsity=0.5, epochs_per_round=1))


def test_the_teacher_is_the_pruners_one_dense_copy(tmp_path, tokenizer):
    distill = Distill()
    pruner = Pruner(tiny_bert(), get_metric("magnitude"), OneShot(target_sparsity=0.5, baseline_epochs=0),
                    GlobalPolicy(), FlopsBudget(target=0.6, batch=2, seq=8), distill, results=RunResults(tmp_path))
    pruner.step(0, _loaders(tokenizer))
    assert pruner.dense is distill.state.model and (tmp_path / "teacher" / "config.json").is_file()
    logits, loss = distill.training_loss(pruner.model, tiny_batch(tokenizer), pruner.task)
    assert loss.shape == (6,) and distill.take_train_stats()["teacher_seconds"] > 0


def test_a_teacher_folder_is_loaded_as_saved(tmp_path, tokenizer):
    """The teacher never inherits the student's config overrides (a 2-layer teacher stays 2
    layers); one that cannot teach this student is refused, naming recovery.teacher."""
    from headprune import save_pruned

    save_pruned(tiny_bert(num_hidden_layers=2), tmp_path / "t2")
    distill = Distill(teacher=str(tmp_path / "t2"))
    distill.check_model(tiny_bert(num_hidden_layers=3))
    assert distill.state.model.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="recovery.teacher=.*num_labels=2, the model being pruned 3"):
        Distill(teacher=str(tmp_path / "t2")).check_model(tiny_bert(num_labels=3))
    with pytest.raises(ValueError, match="recovery.teacher=.* hidden states"):
        Distill(teacher=str(tmp_path / "t2"), hidden_weight=1.0).check_model(tiny_bert(num_hidden_layers=3))


def test_least_squares_refuses_a_resume():
    with pytest.raises(ValueError, match="recovery=least_squares tunes each round against the unpruned"):
        LeastSquares().resume(None)


def test_final_cost_share_is_the_kept_layouts_share(tokenizer):
    """results.json final.cost_share under a cost budget: the kept units' cost over dense, from the
    budget's table at its batch and seq (recomputed here from the kept heads); none under heads."""
    budget = FlopsBudget(target=0.6, batch=2, seq=8)
    pruner = Pruner(tiny_bert(), get_metric("magnitude"), OneShot(target_sparsity=0.4, baseline_epochs=0,
                                                                   epochs_per_round=0), GlobalPolicy(), budget)
    final = pruner.run(_loaders(tokenizer))["final"]
    kept = pruner.mask.heads_per_layer()
    assert final["cost_share"] == pytest.approx(pruner.costs.total(kept) / pruner.costs.dense)
    assert 0 < final["cost_share"] <= 0.6 and final["cost_share"] < 1
    heads = Pruner(tiny_bert(), get_metric("magnitude"), OneShot(target_sparsity=0.5, baseline_epochs=0,
                                                                  epochs_per_round=0), GlobalPolicy())
    assert "cost_share" not in heads.run(_loaders(tokenizer))["final"]
