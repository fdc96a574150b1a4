"""The LLM track through headprune-train: the `evaluation:` block (perplexity at several window
lengths over the same held-out tokens, on the dense model and on the export), the time per
stage, and its checks at start."""
import copy
import json

import pytest

from headprune.apps.train import run
from tests.helpers import TINY_LM_MODEL, compose_train, smollm2

TINY_LM = [*TINY_LM_MODEL, "data.max_train_samples=32",
           "data.score_samples=16", "data.max_validation_samples=8", "schedule=one_shot", "schedule.target_sparsity=0.5",
           "schedule.baseline_epochs=1", "schedule.epochs_per_round=0", "logger=none", "diagnostics.enabled=false",
           "evaluation.enabled=true", "evaluation.perplexity_seqs=[64,128]", "evaluation.perplexity_tokens=1024",
           "evaluation.zero_shot_tasks=[]", "evaluation.generate=false"]


def test_dense_and_pruned_models_are_evaluated_on_the_same_tokens(tmp_path, data_dir):
    res = run(compose_train(tmp_path, data_dir, *TINY_LM))
    saved = json.loads((tmp_path / "results.json").read_text())
    ev = saved["evaluation"]
    assert ev["settings"]["perplexity_seqs"] == [64, 128] and ev["perplexity_tokens_used"] == 1024
    assert set(ev) == {"settings", "perplexity_tokens_used", "val", "dense", "pruned"}
    # `val` is the same perplexity on the 8 validation blocks of 128 bytes, without BOS
    assert ev["val"] == {"seq": 128, "windows": 8, "tokens": 1024, "targets": 8 * 127, "bos": False}
    for which in ("dense", "pruned"):
        p = ev[which]["perplexity"]
        assert (p["seq64"]["windows"], p["seq128"]["windows"]) == (16, 8)
        assert p["seq64"]["tokens"] == p["seq128"]["tokens"] == 1024 and p["seq64"]["bos"] is True
    assert ev["dense"]["perplexity"]["seq128"]["ppl"] != ev["pruned"]["perplexity"]["seq128"]["ppl"]
    assert set(saved["stages"]) == {"load", "evaluate_dense", "train_and_prune", "export", "evaluate_pruned"}
    assert res["final"]["sparsity"] == 0.5


@pytest.mark.parametrize("override,pattern", [
    ("evaluation.perplexity_seqs=[512]", r"evaluation.perplexity_seqs: 512 tokens \(\+ BOS\) exceed the model's 256"),
    ("evaluation.perplexity_tokens=10000000", r"evaluation.perplexity_tokens=10000000 exceeds the \d+ held-out tokens"),
])
def test_evaluation_settings_are_checked_before_anything_runs(override, pattern, tmp_path, data_dir):
    with pytest.raises(ValueError, match=pattern):
        run(compose_train(tmp_path, data_dir, *TINY_LM, override))
    assert not (tmp_path / "results.json").exists()


def test_evaluation_is_for_causal_lms(tmp_path, data_dir):
    with pytest.raises(ValueError, match="evaluation.enabled=true evaluates causal LMs, but model.task=classification"):
        run(compose_train(tmp_path, data_dir, "model=tiny_bert", "evaluation.enabled=true"))


def test_arms_may_skip_the_dense_evaluation(tmp_path, data_dir):
    run(compose_train(tmp_path, data_dir, *TINY_LM, "evaluation.dense=false"))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["evaluation"]) == {"settings", "perplexity_tokens_used", "val", "pruned"}
    assert "evaluate_dense" not in saved["stages"]


@pytest.mark.real_model
def test_smollm2_prunes_whole_kv_groups_tunes_and_exports_a_plain_checkpoint(tmp_path, data_dir):
    """The real SmolLM2-135M-Instruct on a few hundred tokens: Fisher of the next-token loss, 2 of
    3 KV groups kept in every layer, least-squares tuning with bias, folded and saved: plain
    transformers (no headprune code) loads the export and computes the tuned model's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from headprune import HeadMask, fold, prune_to_budget, save_pruned
    from headprune.selection.layer_policies import UniformPolicy

    model, tok = smollm2()
    model = copy.deepcopy(model)  # the shared model stays dense for the other tests
    text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[:4000]
    ids = torch.tensor(tok.encode(text, add_special_tokens=False)[:384]).view(3, 128)  # (B, T)
    calib = [{"input_ids": ids[:2]}]
    mask = HeadMask.for_model(model)
    report = prune_to_budget(model, calib, {"kind": "kv", "target": 0.67}, metric="fisher", mask=mask,
                             layer_policy=UniformPolicy(), recovery="least_squares")
    assert report["round"]["budget"]["kept_units_per_layer"] == [2] * 30
    with torch.no_grad():
        tuned = model(input_ids=ids[2:]).logits
    fold(model, mask)
    saved = save_pruned(model, tmp_path / "export", tokenizer=tok)
    assert saved.plain_hf
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert (plain.config.num_attention_heads, plain.config.num_key_value_heads) == (6, 2)
    with torch.no_grad():
        assert float((plain(input_ids=ids[2:]).logits - tuned).abs().max()) <= 1e-4


def test_a_data_setting_another_data_option_has_is_named(tmp_path, data_dir):
    """experiment=retraining_free sets data.max_length (SST-2's); with a text corpus the run says so
    instead of a TypeError from the data module, and writes nothing."""
    with pytest.raises(ValueError, match=r"data.max_length is not a setting of data=tinyshakespeare.*"
                                         r"'~data.max_length'.*experiment=llm_kv"):
        run(compose_train(tmp_path, data_dir, "experiment=retraining_free", "model=tiny_gpt2",
                          "model.pretrained=byte-gpt2", "data=tinyshakespeare", "budget=kv", "budget.target=0.5"))
    assert not (tmp_path / "results.json").exists()
