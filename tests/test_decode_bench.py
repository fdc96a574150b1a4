"""headprune-bench on a pretrained decoder and its exports (bench.llm, bench.pruned_dir): the rows
and their fields, KV bytes exactly the kept KV-group share of the dense model's, the dense model
taken from the origin an export records (never its own pruned config), old exports refused.
Tiny random Llama GQA models, seconds; never timings."""
import json

import pytest

from headprune.runs import export_pruned
from headprune import heads_of_kv_groups, prune_heads, save_pruned
from headprune.apps.bench import run
from headprune.deploy.hf import read_origin
from headprune.lightning.module import HeadPruneModule
from headprune.results import RunResults
from tests.helpers import SIX_HEADS, compose_bench
from tests.helpers import llama as tiny_llama_lm

ONLY_LLM = ["bench.encoder.enabled=false", "bench.train_step.enabled=false", "bench.onnxruntime.enabled=false",
            "bench.decoder.enabled=false", "bench.llm.enabled=true"]
LLM_FIELDS = {"model", "variant", "pruned_dir", "threads", "batch", "prompt_len", "new_tokens", "prefill_ms",
              "per_token_ms", "per_token_ratio", "attention_share", "dense_attention_share", "kept_attention_work",
              "bound", "ratio_to_bound", "kv_cache_bytes", "kv_ratio", "kv_heads_share", "kv_exact"}


def llama(seed: int = 0):
    """3 layers x 6 query / 3 KV heads (groups of 2), head_dim 8."""
    return tiny_llama_lm(seed=seed, **SIX_HEADS)


def without_groups(model, per_layer: int):
    """The model with its first `per_layer` KV groups removed from every layer (a plain export)."""
    return prune_heads(model, heads_of_kv_groups(model, {layer: range(per_layer) for layer in range(3)}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A dense folder and two exports recording it: 1 and 2 of 3 KV groups removed."""
    root = tmp_path_factory.mktemp("llm")
    llama().save_pretrained(root / "dense")
    for removed in (1, 2):
        save_pruned(without_groups(llama(), removed), root / f"kv{removed}" / "export", origin=str(root / "dense"))
    return root


@pytest.mark.slow  # decode timings of exports: over ~2 s
def test_llm_section_rows_bounds_and_exact_kv_ratios(folders, tmp_path):
    exports = [folders / "kv1" / "export", folders / "kv2" / "export"]
    results = run(compose_bench(tmp_path, *ONLY_LLM, f"bench.llm.pruned_dirs=[{exports[0]},{exports[1]}]",
                                "bench.llm.batches=[1,2]", "bench.llm.prefill_batches=[1]"))
    rows = results["llm"]
    assert len(rows) == 3 * 2 and all(LLM_FIELDS <= set(r) for r in rows)  # 3 models x 2 batches, prompt 8
    assert [r["variant"] for r in rows[:3]] == ["dense", "kv1", "kv2"]
    dense = {r["batch"]: r for r in rows if r["variant"] == "dense"}
    assert all(r["model"] == str(folders / "dense") for r in rows)
    for r in rows:
        if r["variant"] == "dense":
            continue
        kept = {"kv1": 2, "kv2": 1}[r["variant"]]  # of 3 KV groups per layer
        assert r["kv_heads_kept"] == 3 * kept and r["kv_exact"] is True
        assert r["kv_cache_bytes"] * 3 == dense[r["batch"]]["kv_cache_bytes"] * kept  # exactly, in integers
        assert r["kept_attention_work"] == pytest.approx(kept / 3)
        share = dense[r["batch"]]["attention_share"]
        assert r["bound"] == pytest.approx(1 / (1 - share * (1 - kept / 3)))
        assert r["ratio_to_bound"] == pytest.approx(r["per_token_ratio"] / r["bound"])
        assert (r["prefill_ms"] is None) == (r["batch"] == 2)  # prefill timed at prefill_batches only
    # the batch-2 cache is the batch-1 prompt's repeated: twice the bytes
    assert dense[2]["kv_cache_bytes"] == 2 * dense[1]["kv_cache_bytes"]
    assert dense[1]["kv_cache_bytes"] == 3 * 2 * 3 * 8 * 8 * 4  # layers x (K, V) x KV heads x prompt 8 x head_dim x fp32
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["summary"]["llm"]["kv_exact"] is True and "kv2/threads1/batch1" in saved["summary"]["llm"]
    assert "Pretrained decoder" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow  # decode timings of an export: over ~2 s
def test_pruned_dir_is_compared_with_the_dense_model_it_records(folders, tmp_path):
    """The decoder section's dense row is the recorded origin (18 heads), not the export's own
    config (12 heads, KV ratio 1.000, sparsity 0: the old behaviour)."""
    results = run(compose_bench(tmp_path, f"bench.pruned_dir={folders / 'kv1' / 'export'}",
                                "bench.encoder.enabled=false", "bench.train_step.enabled=false",
                                "bench.decoder.variants.masked=[]", "bench.decoder.variants.unstructured_dense=[]"))
    rows = {r["variant"]: r for r in results["decoder"]}
    assert rows["dense"]["heads_kept"] == 18 and rows["dense"]["kv_heads_kept"] == 9
    assert rows["exported"]["heads_kept"] == 12 and rows["exported"]["sparsity"] == pytest.approx(1 / 3, abs=1e-4)
    assert rows["exported"]["kv_cache_bytes"] * 3 == rows["dense"]["kv_cache_bytes"] * 2
    assert str(folders / "dense") in rows["dense"]["model"]


@pytest.mark.slow  # builds and saves exports: over ~2 s
def test_export_without_origin_is_refused_unless_named(folders, tmp_path):
    save_pruned(without_groups(llama(), 1), tmp_path / "old")  # as exports were written before
    assert read_origin(tmp_path / "old") is None
    for overrides in ([f"bench.pruned_dir={tmp_path / 'old'}"], [*ONLY_LLM, f"bench.llm.pruned_dirs=[{tmp_path / 'old'}]"]):
        with pytest.raises(ValueError, match=r"records no dense model.*bench\.dense_model="):
            run(compose_bench(tmp_path / "out", *overrides))
        assert not (tmp_path / "out" / "bench.json").exists()
    results = run(compose_bench(tmp_path / "named", *ONLY_LLM, f"bench.pruned_dir={tmp_path / 'old'}",
                                f"bench.dense_model={folders / 'dense'}", "bench.llm.batches=[1]"))
    assert {r["variant"] for r in results["llm"]} == {"dense", "old"}


def test_a_dense_model_of_other_shape_is_refused(folders, tmp_path):
    other = tiny_llama_lm(**{**SIX_HEADS, "num_hidden_layers": 2})
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"has 3 layers, its dense model .* 2: it was not pruned from it"):
        run(compose_bench(tmp_path / "out", *ONLY_LLM, f"bench.pruned_dir={folders / 'kv1' / 'export'}",
                          f"bench.dense_model={tmp_path / 'other'}"))


def test_origin_is_recorded_by_both_export_kinds_and_by_the_train_app(folders, tmp_path):
    uneven = prune_heads(llama(), {0: [0, 1]})  # layers keep different numbers: headprune_layout.json
    save_pruned(uneven, tmp_path / "uneven", origin="smollm2")
    assert read_origin(tmp_path / "uneven") == "smollm2"
    assert json.loads((folders / "kv1" / "export" / "headprune_layout.json").read_text())["dense_model"] == str(
        folders / "dense")
    for model_cfg, want in (({"pretrained": str(folders / "dense"), "random_init": False}, str(folders / "dense")),
                            ({"pretrained": "smollm2", "random_init": False}, "smollm2"),
                            ({"pretrained": "smollm2", "random_init": True}, None)):
        module = HeadPruneModule(without_groups(llama(), 1), num_labels=None, task="causal_lm")
        results = RunResults(tmp_path, config={"model": model_cfg})
        export_pruned(module, tmp_path / "export", results, baseline_params={})
        assert read_origin(tmp_path / "export") == want


@pytest.mark.parametrize("override,pattern", [
    ("bench.llm.batches=[0]", r"bench\.llm\.batches=\[0\].*allowed: a non-empty list of positive integers"),
    ("bench.llm.prefill_batches=[3]", r"bench\.llm\.prefill_batches contains \[3\].*allowed: a subset"),
    ("bench.llm.new_tokens=0", r"bench\.llm\.new_tokens=0.*allowed: an integer >= 1"),
    ("bench.llm.prompt_lens=[70]", r"exceeds .* 64 positions"),
])
def test_bad_llm_values_name_the_field(folders, override, pattern, tmp_path):
    with pytest.raises(ValueError, match=pattern):
        run(compose_bench(tmp_path, *ONLY_LLM, f"bench.pruned_dir={folders / 'kv1' / 'export'}", override))


def test_llm_without_an_export_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"bench\.llm\.enabled=true needs pruned exports.*bench\.pruned_dir="):
        run(compose_bench(tmp_path, *ONLY_LLM))


@pytest.mark.parametrize("given", ["missing", "not_a_model", "encoder", "no_origin"])
def test_a_bad_llm_export_is_named_by_the_setting_it_was_given_in(given, tmp_path):
    """bench.llm.pruned_dirs=[...]: a folder that does not exist, holds no model or holds an
    encoder is said to be that (not "records no dense model"), naming bench.llm.pruned_dirs[i]
    (not bench.pruned_dir), before any work."""
    from tests.helpers import PRUNE, tiny

    good = tmp_path / "good"
    save_pruned(without_groups(llama(), 1), good, origin=str(tmp_path / "dense"))
    bad = tmp_path / "bad"
    if given == "not_a_model":
        bad.mkdir()
    elif given == "encoder":
        save_pruned(prune_heads(tiny("bert"), PRUNE), bad, origin="minilm")
    elif given == "no_origin":
        save_pruned(without_groups(llama(), 1), bad)
    named = {"missing": "does not exist", "not_a_model": r"holds no model \(no config\.json\)",
             "encoder": r"holds no causal LM \(BertForSequenceClassification\)",
             "no_origin": "records no dense model"}[given]
    with pytest.raises((ValueError, FileNotFoundError), match=rf"bench\.llm\.pruned_dirs\[1\]={bad} {named}"):
        run(compose_bench(tmp_path / "out", *ONLY_LLM, f"bench.llm.pruned_dirs=[{good},{bad}]"))
    assert not (tmp_path / "out" / "bench.json").exists()


@pytest.mark.slow  # decode timings of a windowed export: over ~2 s
def test_llm_section_counts_a_windowed_exports_cache_and_work_as_its_layout_says(folders, tmp_path):
    """A KV-modes export (full / windowed / removed units, sink 1 + window 3): its prompt cache holds
    what costs.kv_bytes predicts (a windowed unit sink + window tokens, a removed one none), counted
    in the live cache; its attention work gives windowed heads sink + window keys. Seen failing
    before the section was window-aware: the cache could not be cropped back (a windowed cache
    refuses crop), and kv_exact compared with the kept KV-head share."""
    from headprune.costs.flops import attention_flops
    from headprune.heads.windows import KVLayout, apply_kv_layout

    modes = (("window", "full", "removed"), ("full", "window", "window"), ("removed", "full", "window"))
    model = llama()
    apply_kv_layout(model, KVLayout(modes, sink=1, window=3))
    save_pruned(model, tmp_path / "win" / "export", origin=str(folders / "dense"))
    results = run(compose_bench(tmp_path, *ONLY_LLM, f"bench.llm.pruned_dirs=[{tmp_path / 'win' / 'export'}]",
                                "bench.llm.batches=[1,2]", "bench.llm.prefill_batches=[1]"))
    rows = {(r["variant"], r["batch"]): r for r in results["llm"]}
    per_token = 2 * 8 * 4  # K and V x head_dim x float32, one KV head
    for batch in (1, 2):
        win = rows["win", batch]
        # prompt 8: full units 8 tokens, windowed min(8, 1 + 3) = 4, removed 0
        assert win["kv_cache_bytes"] == win["kv_predicted_bytes"] == batch * per_token * ((4 + 8) + (8 + 4 + 4) + (8 + 4))
        assert win["kv_exact"] is True and win["kv_units"] == {"full": 3, "window": 4, "removed": 2}
    new = rows["win", 1]["new_tokens"]

    def work(full_heads, window_heads, full_units, window_units):
        return sum(attention_flops(1, 1, 8 + i + 1, full_heads, full_units, 8, 48)
                   + attention_flops(1, 1, min(8 + i + 1, 4), window_heads, window_units, 8, 48) * bool(window_heads)
                   for i in range(new))
    dense = 3 * sum(attention_flops(1, 1, 8 + i + 1, 6, 3, 8, 48) for i in range(new))
    kept = work(2, 2, 1, 1) + work(2, 4, 1, 2) + work(2, 2, 1, 1)  # 2 query heads per unit
    assert rows["win", 1]["kept_attention_work"] == pytest.approx(kept / dense)
    assert "held exactly what the layout predicts" in (tmp_path / "bench.md").read_text()
