"""headprune-bench: structure of its outputs on tiny models in quick mode, exact KV-cache ratios,
analytic FLOP counts against hand computations, and the building blocks. Never timings."""
import copy
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
from hydra.errors import ConfigCompositionException
from transformers.pytorch_utils import Conv1D

from headprune import HeadMask, prune_heads, save_pruned
from headprune.bench.decoder import build_decoder, decode, prefill
from headprune.costs.kv_bytes import cache_bytes
from headprune.costs.replay import record_attention_calls, replay
from headprune.costs.flops import attention_flops, ffn_flops, model_attention_flops
from headprune.bench import render
from headprune.bench.config import register_bench_schema
from headprune.bench.report import headline_table, markdown, summary, summary_lines
from headprune.bench.sections import SECTIONS, Section, register
from headprune.costs.timing import Case, Clock, Stats, interleaved
from headprune.bench.variants import (SparseLinear, build_variants, qkvo_modules, qkvo_weight_count,
                                      removal_counts)
from headprune.apps.bench import run
from headprune.apps.config_paths import config_dir
from tests.helpers import compose_bench, tiny

ENCODER_FIELDS = {"variant", "sparsity", "batch", "seq", "forward_ms", "attention_ms", "forward_ratio",
                  "attention_ratio", "theoretical_attention_ratio"}
DECODER_FIELDS = {"variant", "sparsity", "prefill_ms", "per_token_ms", "kv_cache_bytes", "kv_ratio"}
SPARSITIES = [0.25, 0.5, 0.75]
ONNX_SPARSITIES = [0.5]  # one pruned export beside the dense one: torch.onnx exports are most of a quick run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick bench run through the Hydra config, logging to an offline wandb run."""
    out = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    try:
        results = run(compose_bench(out, "logger=wandb", f"bench.onnxruntime.sparsities={ONNX_SPARSITIES}"))
    finally:
        mp.undo()
    return out, results


# -- the committed measurement ------------------------------------------------------------------
REPO = config_dir().parent
COMMITTED = REPO / "docs" / "bench"


def test_committed_bench_tables_are_rendered_from_its_json():
    """docs/bench/bench.md, the summary lines quoted in docs/bench.md and the headline table of the
    site's bench guide (docs/guide_bench.md) are what the report code makes of the committed bench.json
    (a full, not quick, run)."""
    results = json.loads((COMMITTED / "bench.json").read_text())
    assert results["meta"]["quick"] is False
    assert summary(results) == results["summary"]
    assert markdown(results) == (COMMITTED / "bench.md").read_text()
    docs = (REPO / "docs" / "bench.md").read_text()
    for line in summary_lines(results["summary"]):
        assert line in docs, line
    assert headline_table(results) in (REPO / "docs" / "guide_bench.md").read_text()


# -- the app's outputs ------------------------------------------------------------------------
@pytest.mark.slow  # the module-scoped quick_run bench takes ~30 s
def test_quick_run_writes_json_markdown_and_plot(quick_run):
    out, results = quick_run
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    saved = json.loads((out / "bench.json").read_text())
    assert saved["encoder"] == json.loads(json.dumps(results["encoder"]))
    assert saved["meta"]["quick"] is True and saved["meta"]["threads"] == 1
    assert "| pruned_uniform | 0.50 |" in (out / "bench.md").read_text()
    assert list((out / "wandb").glob("offline-run-*")), "no offline wandb run written"


@pytest.mark.slow  # the module-scoped quick_run bench takes ~30 s
def test_train_step_rows_compare_pruned_with_masked_at_each_sparsity(quick_run):
    results = quick_run[1]
    rows = results["train_step"]
    names = {(r["variant"], r["sparsity"]) for r in rows}
    assert names == {("dense", 0.0)} | {(v, s) for s in SPARSITIES for v in ("masked", "pruned_uniform", "pruned_skewed")}
    at = {(r["variant"], r["sparsity"]): r for r in rows}
    for s in SPARSITIES:
        for layout in ("uniform", "skewed"):
            r = at[(f"pruned_{layout}", s)]
            assert r["vs_masked_ratio"] == pytest.approx(at[("masked", s)]["step_ms"] / r["step_ms"])
            assert r["theoretical_forward_ratio"] > 1.0 and r["heads_kept"] == round(12 * (1 - s))
        assert at[("masked", s)]["vs_masked_ratio"] is None and at[("masked", s)]["theoretical_forward_ratio"] == 1.0
    assert results["summary"]["train_step"]["vs_masked_ratio_50"] == at[("pruned_uniform", 0.5)]["vs_masked_ratio"]
    assert "## Training step" in (quick_run[0] / "bench.md").read_text()


@pytest.mark.slow  # the module-scoped quick_run bench takes ~30 s
def test_onnxruntime_rows_time_exported_dense_and_pruned_models(quick_run):
    results = quick_run[1]
    rows = results["onnxruntime"]
    assert {(r["variant"], r["sparsity"]) for r in rows} == \
        {("dense", 0.0)} | {("pruned_uniform", s) for s in ONNX_SPARSITIES}
    for r in rows:
        assert r["ort_ms"] > 0 and r["max_abs_diff_vs_torch"] < 1e-4 and r["threads"] == 1
    summary = results["summary"]["onnxruntime"]
    assert summary["ort_ratio_50"] == next(r["ort_ratio"] for r in rows if r["sparsity"] == 0.5)
    assert summary["torch_forward_ratio_50"] > 0 and "## ONNX Runtime forward" in (quick_run[0] / "bench.md").read_text()


@pytest.mark.slow  # the module-scoped quick_run bench takes ~30 s
def test_encoder_rows_cover_every_variant_with_every_field(quick_run):
    rows = quick_run[1]["encoder"]
    assert {(r["batch"], r["seq"]) for r in rows} == {(2, 8)}
    names = {(r["variant"], r["sparsity"]) for r in rows}
    expected = ({("dense", 0.0), ("masked", 0.5), ("unstructured_sparse", 0.5)}
                | {(v, s) for s in SPARSITIES for v in ("pruned_uniform", "pruned_skewed", "unstructured_dense")})
    assert names == expected and len(rows) == len(expected)
    for r in rows:
        assert ENCODER_FIELDS <= set(r)
        assert r["forward_ms"] > 0 and r["attention_ms"] > 0 and r["repeats"] == 2
        assert r["forward_spread_ms"]["min"] <= r["forward_ms"] <= r["forward_spread_ms"]["max"]
    dense = next(r for r in rows if r["variant"] == "dense")
    assert dense["forward_ratio"] == dense["attention_ratio"] == dense["theoretical_attention_ratio"] == 1.0


@pytest.mark.slow  # the module-scoped quick_run bench takes ~30 s
def test_encoder_theoretical_ratios(quick_run):
    """Removing s of every head scales every attention FLOP by (1 - s); masking removes none."""
    for r in quick_run[1]["encoder"]:
        if r["kind"] == "pruned":
            assert r["theoretical_attention_ratio"] == pytest.approx(1 / (1 - r["sparsity"]))
            assert r["heads_kept"] == round(12 * (1 - r["sparsity"]))  # 3 layers x 4 heads
        elif r["kind"] == "masked":
            assert r["theoretical_attention_ratio"] == 1.0 and r["heads_kept"] == 12
        elif r["kind"].startswith("unstructured"):  # projections shrink, scores do not
            assert 1.0 < r["theoretical_attention_ratio"] < 1 / (1 - r["sparsity"])


@pytest.mark.slow  # the module-scoped quick_run bench takes ~30 s
def test_decoder_rows_and_exact_kv_cache_ratios(quick_run):
    rows = quick_run[1]["decoder"]
    assert {r["model"] for r in rows} == {"gpt2_tiny", "llama_gqa_tiny"}
    for model in ("gpt2_tiny", "llama_gqa_tiny"):
        kv_heads = 3 * 4  # 3 layers x 4 KV heads (Llama: 8 query heads in 4 groups)
        mine = [r for r in rows if r["model"] == model]
        assert len(mine) == 1 + 2 * 3 + 2  # dense, 2 pruned layouts x 3 sparsities, masked and unstructured at 0.5
        dense = mine[0]
        assert dense["variant"] == "dense" and dense["kv_heads_kept"] == kv_heads
        for r in mine:
            assert DECODER_FIELDS <= set(r)
            assert r["prefill_ms"] > 0 and r["per_token_ms"] > 0 and 0 < r["per_token_attention_share"] < 1
            if r["kind"] == "pruned":  # whole KV heads (groups) go: exactly (1 - s) of the dense cache
                assert r["kv_ratio"] == 1 - r["sparsity"]
                assert r["kv_cache_bytes"] * kv_heads == dense["kv_cache_bytes"] * r["kv_heads_kept"]
            else:
                assert r["kv_ratio"] == 1.0
    # dense GPT-2 cache by hand: layers x (K, V) x batch x heads x tokens x head_dim x 4 bytes
    gpt2 = next(r for r in rows if r["model"] == "gpt2_tiny" and r["variant"] == "dense")
    assert gpt2["kv_cache_bytes"] == 3 * 2 * 1 * 4 * (8 + 3) * 8 * 4
    assert quick_run[1]["summary"]["decoder"]["llama_gqa_tiny"]["kv_exact"] is True


@pytest.mark.slow
def test_pruned_dir_benchmarks_the_exported_model(tmp_path):
    model = build_decoder({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64,
                           "vocab_size": 128, "bos_token_id": 0, "eos_token_id": 0})
    model.save_pretrained(tmp_path / "dense")  # the origin the export records (its dense baseline)
    prune_heads(model, {0: [0, 1, 2], 1: [3]})
    save_pruned(model, tmp_path / "export", origin=str(tmp_path / "dense"))
    results = run(compose_bench(tmp_path, f"bench.pruned_dir={tmp_path / 'export'}", "bench.encoder.enabled=false"))
    rows = {r["variant"]: r for r in results["decoder"]}
    assert set(rows) == {"dense", "masked", "exported", "unstructured_dense"}
    assert rows["exported"]["sparsity"] == 0.5 and rows["exported"]["kv_ratio"] == 0.5
    assert rows["masked"]["kv_ratio"] == 1.0 and (tmp_path / "bench.json").is_file()


@pytest.mark.slow
def test_console_entry_point_quick(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "headprune.apps.bench", "bench.quick=true", "bench.decoder.enabled=false",
           "bench.train_step.enabled=false", "bench.onnxruntime.enabled=false",  # quick_run runs those
           "bench.sparsities=[0.5]", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["decoder"] == saved["train_step"] == saved["onnxruntime"] == [] and saved["encoder"]


# -- the section registry ---------------------------------------------------------------------
@dataclass
class ToySettings:
    enabled: bool = False
    rows: int = 2


def toy_section():
    """A section written as a new bench module would be: settings, run, table, summary, lines."""
    return Section(
        "toy", ToySettings,
        run=lambda inputs: [{"variant": f"v{i}", "seed": inputs.cfg.seed} for i in range(inputs.bench.toy.rows)],
        table=lambda rows: render.table("## Toy", rows, [render.GRID[0], render.fmt("seed", "d")]),
        summary=lambda rows, results: {"n": len(rows)},
        summary_lines=lambda block: [f"- toy: {block['n']} rows"])


@pytest.fixture
def toy():
    register(toy_section())
    register_bench_schema()
    yield
    del SECTIONS["toy"]
    register_bench_schema()


def test_a_registered_section_is_configured_run_and_rendered(toy, tmp_path):
    """One module registering a Section plus its config block: typed settings, a run, its rows,
    summary, summary line and table in bench.json and bench.md; the other sections as before."""
    off = [f"bench.{name}.enabled=false" for name in ("encoder", "train_step", "onnxruntime", "decoder")]
    with pytest.raises(ConfigCompositionException):
        compose_bench(tmp_path, "bench.toy.row=3")
    results = run(compose_bench(tmp_path, *off, "bench.toy.enabled=true", "bench.toy.rows=3"))
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert list(saved) == ["meta", "encoder", "train_step", "onnxruntime", "decoder", "llm", "ort_decode", "serve", "llamacpp", "scale", "toy",
                           "summary"]
    assert saved["toy"] == results["toy"] == [{"variant": f"v{i}", "seed": 0} for i in range(3)]
    assert saved["summary"] == {"toy": {"n": 3}} and saved["meta"]["config"]["toy"] == {"enabled": True, "rows": 3}
    text = (tmp_path / "bench.md").read_text()
    assert "- toy: 3 rows\n" in text and "## Toy\n\n| variant | seed |\n|---|---:|\n| v0 | 0 |" in text
    assert run(compose_bench(tmp_path, *off))["toy"] == []  # disabled by its own `enabled`


def test_sections_register_once_in_report_order():
    assert list(SECTIONS) == ["encoder", "train_step", "onnxruntime", "decoder", "llm", "ort_decode", "serve", "llamacpp", "scale"]
    with pytest.raises(ValueError, match="'encoder' is registered twice"):
        register(replace(SECTIONS["encoder"], table=lambda rows: []))


# -- bad configs ------------------------------------------------------------------------------
@pytest.mark.parametrize("override,pattern", [
    ("bench.layouts=[diagonal]", r"bench\.layouts: 'diagonal'.*allowed: uniform, skewed"),
    ("bench.device=tpu", r"bench\.device: 'tpu'.*allowed: auto, cpu, cuda"),
    ("bench.decoder.models=[gpt3]", r"bench\.decoder\.models: 'gpt3'.*allowed: gpt2, llama_gqa"),
    ("+bench.encoder.variants.sparse=[0.5]", r"bench\.encoder\.variants: 'sparse'.*allowed: masked, pruned"),
    ("bench.decoder.variants.masked=[0.5,1.5]", r"bench\.decoder\.variants\.masked contains 1\.5"),
    ("bench.sparsities=[1.0]", r"bench\.sparsities contains 1\.0"),
    ("bench.repeats=0", r"bench\.repeats=0.*allowed: an integer >= 1"),
])
def test_bad_values_name_the_field(override, pattern, tmp_path):
    with pytest.raises(ValueError, match=pattern):
        run(compose_bench(tmp_path, override))


def test_command_line_wins_over_quick_values(tmp_path):
    cfg = compose_bench(tmp_path, "bench.encoder.seqs=[4]")
    assert cfg.bench.encoder.seqs == [4] and cfg.bench.encoder.batches == [2] and cfg.bench.repeats == 2


def test_typo_fails_at_compose(tmp_path):
    with pytest.raises(ConfigCompositionException):
        compose_bench(tmp_path, "bench.repeat=3")


# -- FLOPs by hand ----------------------------------------------------------------------------
def test_attention_flops_by_hand():
    # B=2, T=S=5, 3 heads of 4 (MHA), hidden 12: Q,K,V,O 4 x 2*2*5*12*12 = 11520; QK^T and PV 2 x 2*2*3*5*5*4 = 2400
    assert attention_flops(2, 5, 5, heads=3, kv_heads=3, head_dim=4, hidden=12) == 11520 + 2400
    # GQA, B=1, T=S=3, 4 query heads, 2 KV heads of 4, hidden 16: Q,O 2 x 2*3*16*16 = 3072, K,V 2 x 2*3*16*8 = 1536,
    # QK^T and PV 2 x 2*4*3*3*4 = 576
    assert attention_flops(1, 3, 3, heads=4, kv_heads=2, head_dim=4, hidden=16) == 3072 + 1536 + 576
    # one decode step (T=1) against 10 cached keys: projections 2*1*12*48 = 1152, scores + sum 2 x 2*3*10*4 = 480
    assert attention_flops(1, 1, 10, heads=3, kv_heads=3, head_dim=4, hidden=12) == 1152 + 480
    # half the Q/K/V/O weights zero: projections halve, scores stay
    assert attention_flops(2, 5, 5, 3, 3, 4, 12, weight_density=0.5) == 5760 + 2400
    assert ffn_flops(2, 5, hidden=12, intermediate=48) == 2 * 2 * 5 * 12 * 48 * 2
    per_layer = [attention_flops(2, 5, 5, h, h, 4, 12) for h in (3, 1)]
    assert model_attention_flops(2, 5, 5, [3, 1], [3, 1], 4, 12) == sum(per_layer)


# -- layouts and variants ---------------------------------------------------------------------
def test_removal_counts():
    assert removal_counts("uniform", 6, 12, 0.5) == [6] * 6
    skewed = removal_counts("skewed", 6, 12, 0.5)
    assert sum(skewed) == 36 and max(skewed) <= 11
    assert skewed[2] > skewed[0] and skewed[3] > skewed[5]  # more from the middle layers
    assert removal_counts("skewed", 6, 4, 0.75) == [3] * 6  # every layer keeps one unit: no room to skew
    with pytest.raises(ValueError, match=r"bench\.layouts contains 'diagonal'; allowed: uniform, skewed"):
        removal_counts("diagonal", 6, 12, 0.5)


def test_reported_sparsity_is_the_share_actually_removed():
    # 0.3 x 4 heads rounds to 1 head per layer (0.25); skewed takes the last layer's from the middle one
    variants = build_variants(tiny("bert"), {"pruned": [0.3]}, ["uniform", "skewed"])
    assert [(v.name, v.sparsity, v.heads) for v in variants] == [
        ("dense", 0.0, [4, 4, 4]), ("pruned_uniform", 0.25, [3, 3, 3]), ("pruned_skewed", 0.25, [3, 2, 4])]


def test_unstructured_zeroes_as_many_weights_as_head_pruning():
    dense = tiny("bert")
    removed = qkvo_weight_count(dense) - qkvo_weight_count(prune_heads(copy.deepcopy(dense), {0: [0, 1], 1: [0, 1],
                                                                                              2: [0, 1]}))
    variants = build_variants(dense, {"unstructured_dense": [0.5], "unstructured_sparse": [0.5]}, ["uniform"])
    zeroed = variants[1]
    assert zeroed.name == "unstructured_dense"
    n_zero = sum(int((m.weight == 0).sum()) for layer in qkvo_modules(zeroed.model) for m in layer)
    assert n_zero == removed == qkvo_weight_count(dense) // 2
    assert sum(zeroed.densities) / 3 == pytest.approx(0.5)
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(variants[2].model(input_ids=ids).logits, zeroed.model(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-4)


def test_attention_replay_records_core_and_output_projection_inputs():
    """BERT's sub-layer is timed as BertSelfAttention + output.dense (not the residual LayerNorm); the
    output projection's input is recorded before the HeadMask gate, which runs again on replay."""
    model = tiny("bert")
    HeadMask.for_model(model).prune([(0, 1)])
    calls = record_attention_calls(model, torch.randint(0, 100, (2, 7)))
    assert [type(m).__name__ for m, _, _ in calls] == ["BertSelfAttention", "Linear"] * 3
    assert calls[1][0] is model.bert.encoder.layer[0].attention.output.dense
    context = calls[1][1][0].view(2, 7, 4, 8)  # (B, T, H, D)
    assert context[:, :, 1].abs().sum() > 0  # head 1 not yet gated
    seen = []
    handle = calls[1][0].register_forward_hook(lambda m, args, out: seen.append(args[0].view(2, 7, 4, 8)))
    with torch.no_grad():
        replay(calls)
    handle.remove()
    assert seen[0][:, :, 1].abs().sum() == 0  # the gate ran on replay


@pytest.mark.parametrize("make", [lambda: torch.nn.Linear(6, 10), lambda: Conv1D(10, 6)])
def test_sparse_linear_matches_its_module(make):
    torch.manual_seed(0)
    module = make()
    with torch.no_grad():
        module.weight.mul_(torch.rand_like(module.weight) > 0.5)
    x = torch.randn(2, 3, 6)  # (B, T, in)
    torch.testing.assert_close(SparseLinear(module)(x), module(x).detach(), atol=1e-6, rtol=1e-5)


def test_kv_cache_bytes_after_prefill_and_decode():
    model = build_decoder({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 32,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64})
    with torch.no_grad():
        cache = decode(model, *prefill(model, torch.randint(0, 64, (3, 5))), steps=2)
    # layers x (K, V) x batch x KV heads x (5 + 2) tokens x head_dim x 4 bytes
    assert cache_bytes(cache) == 2 * 2 * 3 * 2 * 7 * 8 * 4


# -- timing -----------------------------------------------------------------------------------
def test_interleaved_alternates_cases_and_drops_warmup():
    calls = []
    cases = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
             "c": Case(run=lambda state: calls.append(state), setup=lambda: "c")}
    stats = interleaved(cases, Clock("cpu"), warmup=1, repeats=3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert {name: s.n for name, s in stats.items()} == {"a": 3, "b": 3, "c": 3}


def test_interleaved_collects_only_what_its_calls_leave_and_unfreezes(unfrozen_gc):
    """Between rounds the collector skips the objects alive before the timing (frozen, then thawed):
    a cycle made by a timed call is collected, the caller's objects are not rescanned."""
    import gc
    import weakref

    class Node:
        pass

    made, frozen = [], []

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        made.append(weakref.ref(a))
        frozen.append(gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    interleaved({"cycle": cycle}, Clock("cpu"), warmup=0, repeats=2)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    assert made[0]() is None  # the first round's cycle went in the collection before round 2
    assert min(frozen) > 1000  # this session's objects sat out the timing


def test_stats_median_and_quartiles():
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median_ms, s.q1_ms, s.q3_ms, s.min_ms, s.max_ms, s.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert s.scaled(2).median_ms == 1.5
