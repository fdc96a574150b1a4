"""bench.scale: every LLM pipeline stage in its own child process, its seconds and peak resident
memory per model byte (quick mode: a 2-layer Llama, seconds); its settings refused before any work."""
from __future__ import annotations

import json

import pytest

from headprune.apps.bench import run
from headprune.bench.config import check
from headprune.bench.scale import MIB, STAGES
from tests.helpers import compose_bench

OFF = [f"bench.{name}.enabled=false" for name in ("encoder", "train_step", "onnxruntime", "decoder")]


def llama_bytes(spec: dict, bytes_per_param: int = 4) -> int:
    """A tied-embedding Llama's parameter bytes, counted by hand from its config."""
    e, f, layers, vocab = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"], spec["vocab_size"]
    d = e // spec["num_attention_heads"]
    attention = e * d * (2 * spec["num_attention_heads"] + 2 * spec["num_key_value_heads"])  # q, k, v, o
    per_layer = attention + 3 * e * f + 2 * e  # + gate, up, down, two RMSNorms
    return (vocab * e + layers * per_layer + e) * bytes_per_param  # + embeddings (tied), final norm


@pytest.mark.slow  # ~14 s alone (load 4.8): a child process per stage, each starting torch
def test_quick_scale_runs_every_stage_in_a_child_with_its_peak_per_model_byte(tmp_path):
    """Quick mode: the tiny Llama through load, dense evaluation, Fisher scoring, the measured KV
    allocation, refit, KL steps and export; each row's ratio is its net peak over the model's
    bytes counted from the config; the KL teacher is live; the work folder is gone afterwards."""
    cfg = compose_bench(tmp_path, *OFF, "bench.scale.enabled=true")
    results = run(cfg)
    rows = results["scale"]
    spec = dict(cfg.bench.scale.shapes.llama_tiny)
    assert [r["stage"] for r in rows] == list(STAGES) and {r["model"] for r in rows} == {"llama_tiny"}
    for r in rows:
        assert r["model_bytes"] == llama_bytes(spec) and r["dtype"] == "float32"
        assert r["peak_ratio"] == pytest.approx((r["peak_rss_mib"] - r["base_rss_mib"]) * MIB / r["model_bytes"])
        assert r["peak_rss_mib"] >= r["setup_peak_rss_mib"] and r["peak_rss_mib"] > r["base_rss_mib"] > 100
        assert r["seconds"] > 0 and r["tokens"] == 4 * 16
    by = {r["stage"]: r for r in rows}
    assert by["dense_eval"]["info"]["ppl"] > 1
    # the measured allocation kept at most kv_target of the KV bytes (whole groups: 1 of 2 per layer)
    assert by["allocation"]["info"]["kv_share"] <= 0.67 and by["allocation"]["info"]["heads_pruned"] == 4
    assert by["refit"]["info"]["tokens"] == {"fit": 48, "heldout": 16}
    kl = by["kl"]
    assert kl["teacher"] == "live" and kl["info"]["steps"] == 2 and kl["target"] == 4.0
    assert by["export"]["info"]["from"] == "kl" and by["export"]["info"]["params_after"] < rows[0]["params"]
    assert not list(tmp_path.glob("scale_*"))  # checkpoints between stages are removed
    block = results["summary"]["scale"]
    assert list(block) == ["scoring", "allocation", "refit", "kl"] and block["kl"]["teacher"] == "live"
    assert block["refit"]["peak_ratio"] == by["refit"]["peak_ratio"]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["scale"] == rows
    text = (tmp_path / "bench.md").read_text()
    assert "## Scale (random-init models, float32, 64 calibration tokens)" in text
    assert "- scale, kl at llama_tiny (0M parameters): peak" in text and "teacher live" in text


@pytest.mark.slow  # 6.8 s wall (quick loop, load 5): the KL stage runs in a forkserver child starting torch
def test_quick_scale_kl_with_a_cached_teacher_holds_no_teacher(tmp_path):
    """bench.scale.teacher_logits=cached: the KL stage's teacher is its top-k, built in the set-up,
    and the dense copy is freed before the steps (the row says cached)."""
    cfg = compose_bench(tmp_path, *OFF, "bench.scale.enabled=true", "bench.scale.teacher_logits=cached")
    kl = {r["stage"]: r for r in run(cfg)["scale"]}["kl"]
    assert kl["teacher"] == "cached" and kl["info"]["steps"] == 2


@pytest.mark.parametrize("override, message", [
    ("bench.scale.teacher_logits=disk", "bench.scale.teacher_logits"),
    ("bench.scale.samples=2", "bench.scale.samples=2 is not allowed"),
    ("bench.scale.models=[gpt9]", "bench.scale.models: 'gpt9' is not allowed"),
    ("+bench.scale.skip.llama_tiny=[scoring]", "bench.scale.skip.llama_tiny: 'scoring' is not allowed"),
    ("bench.scale.kv_target=1.0", "bench.scale.kv_target=1.0 is not allowed"),
    ("bench.scale.seq=65", "exceeds bench.scale.shapes.llama_tiny's max_position_embeddings=64"),
])
def test_bad_scale_settings_are_refused_naming_the_field(tmp_path, override, message):
    cfg = compose_bench(tmp_path, "bench.scale.enabled=true", override)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        check(cfg.bench)


def test_scale_is_off_by_default_and_measures_the_three_shapes(tmp_path):
    cfg = compose_bench(tmp_path, "bench.quick=false")
    scale = cfg.bench.scale
    assert not scale.enabled
    assert list(scale.models) == ["smollm2_135m", "smollm2_360m", "llama_1b"]
    assert dict(scale.skip) == {"llama_1b": ["kl"]}
    assert llama_bytes(dict(scale.shapes.smollm2_135m), 1) == 134_515_008  # SmolLM2-135M's parameters
    assert llama_bytes(dict(scale.shapes.smollm2_360m), 1) == 361_821_120  # SmolLM2-360M's


def _collect():
    """experiments/scale/collect.py, loaded by path (experiments are not a package)."""
    from tests.helpers import experiment_script

    return experiment_script("scale/collect")


def test_scale_readme_blocks_regenerate_from_the_committed_bench_json():
    """experiments/scale/README.md's measured table, conditions and projection are exactly what
    collect.py renders from the committed bench.json (the raw file every number traces to)."""
    collect = _collect()
    bench = json.loads((collect.HERE / "bench.json").read_text())
    text = (collect.HERE / "README.md").read_text()
    assert collect.render(text, bench) == text
    assert [r["stage"] for r in bench["scale"] if r["model"] == "smollm2_135m"] == list(STAGES)
    # the projection's parameter counts are the target models' published ones
    assert collect.llama_params(collect.TARGETS["Llama-3.1-8B"]) == 8_030_261_248
    assert collect.llama_params(collect.TARGETS["Llama-3.1-70B"]) == 70_553_706_496


@pytest.mark.slow
def test_quick_scale_with_streamed_models_chooses_the_same_heads_holding_one_block(tmp_path):
    """bench.scale.model_device=cpu: scoring, allocation and refit with the models' blocks streamed
    allocate what the resident run allocates; the device held one block of each model at a time
    (the residency trace), less than the whole model."""
    resident = {r["stage"]: r for r in run(compose_bench(tmp_path / "run", *OFF, "bench.scale.enabled=true",
                                                         "+bench.scale.skip.llama_tiny=[load,dense_eval,kl,export]"))["scale"]}
    streamed = {r["stage"]: r for r in run(compose_bench(tmp_path / "cpu", *OFF, "bench.scale.enabled=true",
                                                         "+bench.scale.skip.llama_tiny=[load,dense_eval,kl,export]",
                                                         "bench.scale.model_device=cpu"))["scale"]}
    assert list(streamed) == ["scoring", "allocation", "refit"]
    for key in ("heads_pruned", "kept_units_per_layer", "kv_share"):
        assert streamed["allocation"]["info"][key] == resident["allocation"]["info"][key]
    assert streamed["refit"]["info"]["tokens"] == resident["refit"]["info"]["tokens"]
    for stage, r in streamed.items():
        assert r["model_device"] == "cpu" and resident[stage]["model_device"] == "run"
        for name, d in r["info"]["device"].items():
            assert d["streamed"] and d["peak_resident_blocks"] == 1, (stage, name)
        assert r["device_ratio"] < resident[stage]["device_ratio"]
    assert set(streamed["refit"]["info"]["device"]) == {"model", "dense"}
