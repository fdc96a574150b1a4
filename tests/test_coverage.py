"""tools/coverage.py: the coverage table generated from transformers' auto mappings. A sample of
model types is checked here (a pass, a refusal with its reason, an image model, a failure the checks
must catch); docs/coverage.md is the rendering of docs/coverage.json, and both agree with the
adapters registered now. The full run is `python -m tools.coverage --out
docs/coverage.json --markdown docs/coverage.md` (about 4 minutes on two cores)."""
import json

import pytest

from tools import coverage
from headprune.heads import adapters
from tests.helpers import REPO

DOCS = REPO / "docs"


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads((DOCS / "coverage.json").read_text())


def test_a_sample_of_model_types_is_checked(tmp_path):
    doc = coverage.run(["qwen3", "codegen", "vit", "deepseek_v4", "deepseek_v3", "qwen3_next"])
    rows = {r["model_type"]: r for r in doc["rows"]}
    assert rows["qwen3"]["status"] == "passes" and rows["qwen3"]["adapter"] == "llama"
    assert {k: v for k, v in rows["qwen3"]["checks"].items()} == {
        "eager": "passes", "generate (eager)": "passes", "sdpa": "passes", "generate (sdpa)": "passes",
        "reload": "passes", "plain": "passes"}
    assert rows["codegen"]["status"] == "refused"
    assert "CodeGenAttention" in rows["codegen"]["reason"] and "qkv_proj" in rows["codegen"]["reason"]
    assert rows["deepseek_v4"]["status"] == "refused" and "latent attention" in rows["deepseek_v4"]["reason"]
    assert rows["deepseek_v3"]["status"] == rows["qwen3_next"]["status"] == "passes"  # MLA, a hybrid
    assert (rows["deepseek_v3"]["adapter"], rows["qwen3_next"]["adapter"]) == ("mla", "hybrid_gated")
    assert rows["vit"]["status"] == "passes" and rows["vit"]["task"] == "image_classification"
    assert doc["transformers_version"] and coverage.render_markdown(doc).count("| qwen3 | causal_lm | llama |") == 1


def test_composites_are_built_from_their_text_sub_configs():
    """Composite configs: Qwen3.5's causal-LM class is its text model alone (built from text_config's
    class, a hybrid), Gemma 3's vision-language model has its AutoConfig-declared vision tower and its
    text_config shrunk, and its heads are the text model's (the composite rule of get_adapter)."""
    doc = coverage.run(["qwen3_5", "gemma3"])
    rows = {r["model_type"]: r for r in doc["rows"]}
    assert rows["qwen3_5"]["status"] == "passes" and rows["qwen3_5"]["adapter"] == "hybrid_gated"
    assert rows["gemma3"]["status"] == "passes", rows["gemma3"]["reason"]
    assert rows["gemma3"]["adapter"] == "llama (text_config)" and rows["gemma3"]["checks"]["plain"].startswith("layout")
    config = coverage.tiny_config("gemma3")
    assert (config.text_config.hidden_size, config.vision_config.hidden_size) == (64, 64)


def test_a_check_that_goes_wrong_is_a_failure(monkeypatch):
    """Removal that does not equal masking (here: the mask's hook gating nothing) is recorded as a
    failure naming the check, not as a pass."""
    from headprune.heads.mask import HeadMask

    monkeypatch.setattr(HeadMask, "_make_hook", lambda self, model, layer: (lambda module, args: None))
    row = coverage.check_model_type("qwen3", ["causal_lm"])
    assert row["status"] == "fails" and row["reason"].startswith("eager: removal != mask (max |diff|")


def test_unknown_types_and_bad_sizes_are_named():
    with pytest.raises(ValueError, match=r"not in transformers' mappings: \['no_such_model'\]"):
        coverage.run(["no_such_model"])
    row = coverage.check_model_type("gpt2", ["causal_lm"])
    assert row["status"] == "passes" and row["checks"]["plain"].startswith("layout file")


def test_the_committed_markdown_is_the_rendering_of_the_json(committed):
    assert (DOCS / "coverage.md").read_text() == coverage.render_markdown(committed) + "\n"


def test_the_committed_table_agrees_with_the_registered_adapters(committed):
    """Every model type the table lists as passing has an adapter now, every refused one has none,
    and a type refused for a known reason carries that reason."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    rows = {r["model_type"]: r for r in committed["rows"]}
    config_type = {t: CONFIG_MAPPING[t].model_type for t in rows}  # gpt-sw3 builds a gpt2 config
    assert not [t for t, r in rows.items() if r["status"] == "fails"]
    # a composite passes through its text model's adapter ("llama (text_config)") or is built from it (qwen3_5)
    names = {a.name for a in adapters.ADAPTERS.values()}
    passing = {t: r["adapter"] for t, r in rows.items() if r["status"] == "passes"}
    assert {t: a for t, a in passing.items() if a.split(" (")[0] not in names} == {}
    for model_type, row in rows.items():
        if row["status"] == "refused":
            assert config_type[model_type] not in adapters.ADAPTERS
            if model_type in adapters.REFUSED:
                assert adapters.REFUSED[model_type] in row["reason"]
    in_mappings = [t for t in adapters.ADAPTERS if t in rows]
    assert all(rows[t]["status"] == "passes" for t in in_mappings), [t for t in in_mappings
                                                                      if rows[t]["status"] != "passes"]
