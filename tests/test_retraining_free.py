"""Retraining-free pruning to a budget (Kwon et al. 2022): budget arithmetic, the latency table,
mask rearrangement, and runs that tune and export (the tuning itself: tests/test_least_squares.py)."""

import pytest
import torch

from headprune import HeadMask, fold, prune_to_budget
from headprune.costs.tables import latency_costs
from headprune.selection.budgets import FlopsBudget, KVBudget
from headprune.costs.latency import latency_table
from headprune.selection.layer_policies import GlobalPolicy
from headprune.selection.rearrange import rearrange_layer, removal_cost
from tests.helpers import inputs, tiny, tiny_batch, tiny_bert


# -- rearrangement -----------------------------------------------------------------------------------
def test_rearrangement_sees_that_two_heads_do_one_job():
    """Heads 0 and 1 have the smallest diagonal but strongly correlated gradients: removing both
    costs 1.9, removing 0 and 2 costs 1.1. The diagonal ranking takes 0 and 1; rearrangement swaps."""
    block = torch.tensor([[1.0, 0.9, 0.0], [0.9, 1.0, 0.0], [0.0, 0.0, 1.2]], dtype=torch.float64)
    assert removal_cost(block, [0, 1]) == pytest.approx(1.9)
    moved = rearrange_layer(block, [0, 1, 2], [0, 1])
    assert removal_cost(block, moved) == pytest.approx(1.1) and len(moved) == 2


# -- budgets -----------------------------------------------------------------------------------------
def test_flops_and_kv_costs():
    model = tiny("llama")  # 3 layers, 4 query heads in 2 KV groups, head_dim 8, hidden 32
    flops = FlopsBudget(target=0.5, batch=2, seq=5).table(model)
    # one KV group (2 query heads, 1 KV head): Q/K/V/O products + scores and weighted sum (2 x 2BhTSD)
    per_group = 2 * 2 * 5 * 32 * 8 * (2 * 2 + 2 * 1) + 2 * (2 * 2 * 2 * 5 * 5 * 8)
    assert flops.cost[0][1] == pytest.approx(per_group) and flops.cost[0][0] == 0
    assert flops.dense == pytest.approx(3 * 2 * per_group)
    kv = KVBudget(target=0.5, batch=2, seq=5).table(model)
    assert kv.cost[1] == {0: 0, 1: 2 * 8 * 5 * 2 * 4, 2: 2 * 2 * 8 * 5 * 2 * 4} and kv.unit == "bytes"


def test_kv_budget_prunes_whole_groups_to_the_share():
    model = tiny("llama")
    batch = [dict(inputs(), labels=None)]
    loader = [{"input_ids": batch[0]["input_ids"], "attention_mask": batch[0]["attention_mask"]}]
    report = prune_to_budget(model, loader, {"kind": "kv", "target": 0.5, "batch": 1, "seq": 8}, metric="magnitude",
                             recovery="none", rearrange=False, layer_policy=GlobalPolicy(min_heads_per_layer=0))
    kept = report["round"]["budget"]["kept_units_per_layer"]
    assert sum(kept) == 3 and report["round"]["budget"]["predicted_share"] == 0.5
    pruned = report["round"]["pruned"]
    assert all(sorted(h for l, h in pruned if l == layer) in ([], [0, 1], [2, 3], [0, 1, 2, 3]) for layer in range(3))


def test_a_budget_no_layout_meets_takes_the_cheapest_and_records_the_real_target():
    model = tiny("llama")
    loader = [{"input_ids": inputs()["input_ids"], "attention_mask": inputs()["attention_mask"]}]
    report = prune_to_budget(model, loader, {"kind": "kv", "target": 0.2, "batch": 1, "seq": 8}, metric="magnitude",
                             recovery="none", rearrange=False, layer_policy=GlobalPolicy(min_heads_per_layer=1))
    budget = report["round"]["budget"]
    assert budget["kept_units_per_layer"] == [1, 1, 1] and budget["predicted_share"] == 0.5
    assert budget["target_share"] == 0.2  # the target asked for, not the fallback's
    assert "0.2000 of dense cannot be met" in report["round"]["shortfall"]


@pytest.mark.slow  # three latency measurements: over ~2 s
def test_latency_table_is_measured_once_and_cached(tmp_path):
    model = tiny_bert()
    first = latency_table(model, batch=2, seq=8, cache_dir=tmp_path, warmup=0, repeats=2)
    assert not first["cached"] and set(first["layer_ms"]) == {0, 1, 2, 3, 4} and first["forward_ms"] > 0
    again = latency_table(model, batch=2, seq=8, cache_dir=tmp_path, warmup=0, repeats=2)
    assert again["cached"] and again["layer_ms"] == first["layer_ms"]
    other = latency_table(model, batch=2, seq=16, cache_dir=tmp_path, warmup=0, repeats=2)
    assert not other["cached"] and other["path"] != first["path"]  # another shape is another table
    costs = latency_costs(model, first["layer_ms"], first["forward_ms"])
    assert costs.total([4, 4, 4]) == pytest.approx(first["forward_ms"])  # the dense layout predicts the dense forward


def test_prune_to_budget_meets_a_flops_budget_and_reports_every_stage(tokenizer):
    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    calib = [tiny_batch(tokenizer, 8, seed=s) for s in range(2)]
    report = prune_to_budget(model, calib, {"kind": "flops", "target": 0.6, "batch": 4, "seq": 16},
                             eval_loader=[tiny_batch(tokenizer, 8, seed=5)])
    budget = report["round"]["budget"]
    assert budget["predicted_share"] <= 0.6 + 1e-9 and budget["unit"] == "FLOPs"
    assert min(report["round"]["heads_per_layer"]) >= 1  # the default policy keeps a head per layer
    assert {"costs", "search", "rearrange", "mask_tuning", "total"} <= set(report["seconds"])
    record = report["round"]  # the Pruner's round record, the same shape as a run's results.json rounds
    assert set(record["val_after_recovery"]) == {"acc", "loss"} and "rearranged" in record
    assert record["val"] == record["val_after_recovery"] and "mask_tuning" in record


def test_the_app_prunes_to_a_flops_budget_tunes_and_exports_what_it_evaluated(tmp_path, data_dir, monkeypatch):
    """experiment=retraining_free with a FLOPs budget: no training, the allocation meets the budget,
    the least-squares scales are tuned, and the export (scales folded into O, pruned heads removed)
    computes what the masked and scaled model computed."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import headprune.apps.train as train_app
    import headprune.runs.execute as execute
    from headprune import load_pruned
    from headprune.apps.config_paths import config_dir
    from headprune.models import load_tokenizer

    seen = {}
    export = execute.export_pruned
    batch = {k: v for k, v in tiny_batch(load_tokenizer("minilm")).items() if k != "labels"}

    def spy(module, *args, **kwargs):  # the evaluated model: masked, scaled by its gates
        seen["mask"] = module.head_mask.mask.clone()
        with torch.no_grad():
            seen["logits"] = module.model.eval()(**batch).logits
        export(module, *args, **kwargs)

    monkeypatch.setattr(execute, "export_pruned", spy)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={tmp_path}", f"data.data_dir={data_dir}",
                                          "experiment=retraining_free", "model=tiny_bert",
                                          "model.pretrained=sentence-transformers/all-MiniLM-L6-v2",
                                          "data.score_samples=64", "data.max_validation_samples=64", "budget=flops",
                                          "budget.target=0.6", "budget.batch=4", "budget.seq=16",
                                          "recovery.scale_range=[0.1,5.0]"])
    GlobalHydra.instance().clear()
    res = train_app.run(cfg)
    (round1,) = res["rounds"]
    assert round1["budget"]["predicted_share"] <= 0.6 and res["budget"]["unit"] == "FLOPs"
    assert "mask_tuning" in round1 and round1["val"] == round1["val_after_recovery"]
    assert "gates_folded" in res["final"] and ((seen["mask"] != 0) & (seen["mask"] != 1)).any()
    with torch.no_grad():
        torch.testing.assert_close(load_pruned(tmp_path / "export").eval()(**batch).logits, seen["logits"],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lms_prune_to_a_kv_budget_and_tune(family):
    """Decoders: Fisher of the next-token loss, whole KV groups under budget=kv (Llama-GQA), the
    least-squares scales reconstruct each layer at least as well as ones, and the export of the
    scaled model gives the masked model's logits."""
    model = tiny(family)
    mask = HeadMask.for_model(model)
    loader = [inputs(batch=4, tokens=12, seed=s) for s in range(2)]
    report = prune_to_budget(model, loader, {"kind": "kv", "target": 0.5, "batch": 1, "seq": 16}, mask=mask,
                             layer_policy=GlobalPolicy(min_heads_per_layer=0))
    assert report["round"]["budget"]["predicted_share"] <= 0.5
    assert all(r["error_tuned"] <= r["error_ones"] + 1e-12 for r in report["round"]["mask_tuning"]["layers"] if r["heads"])
    batch = inputs(seed=9)
    with torch.no_grad():
        masked = model(**batch).logits
        fold(model, mask)
        torch.testing.assert_close(model(**batch).logits, masked, atol=1e-5, rtol=0)
    if family == "llama":  # 2 of each layer's 4 query heads share a KV head: groups go whole
        assert all(len(kept) % 2 == 0 for kept in model.headprune_layout)


def test_an_image_classifier_is_pruned_to_its_budget_through_the_api():
    """ViT through `prune_to_budget(..., recovery="none")`: the batches' images (`pixel_values`) are
    its examples (was: KeyError 'input_features', issue 56)."""
    import transformers as tf

    config = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          image_size=16, patch_size=8, num_labels=2)
    torch.manual_seed(0)
    model = tf.ViTForImageClassification(config).eval()
    g = torch.Generator().manual_seed(0)
    loader = [{"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 2, (4,), generator=g)}
              for _ in range(2)]
    report = prune_to_budget(model, loader, budget={"kind": "heads", "target": 0.5}, recovery="none", eval_loader=loader)
    assert sum(report["round"]["heads_per_layer"]) == 4
    assert 0.0 <= report["round"]["val"]["acc"] <= 1.0
