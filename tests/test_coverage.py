"""tools/coverage.py: the coverage table generated from transformers' auto mappings. A sample of
model types is checked here (a pass, a refusal with its reason, an image model, a failure the checks
must catch); docs/coverage.md is the rendering of docs/coverage.json, and both agree with the
adapters registered now. The full run is `python -m tools.coverage --out
docs/coverage.json --markdown docs/coverage.md` (32 minutes with the config variants on two shared cores)."""
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
    # prune_heads' own check (heads/verify.py) masks with the same broken hook: off, so that the
    # coverage table's comparison is what this test reads
    monkeypatch.setattr("headprune.heads.surgery.wanted", lambda model, verify: False)
    row = coverage.check_model_type("qwen3", ["causal_lm"])
    assert row["status"] == "fails" and row["reason"].startswith("eager: removal != mask (max |diff|")


def test_unknown_types_and_bad_sizes_are_named():
    with pytest.raises(ValueError, match=r"not in transformers' mappings: \['no_such_model'\]"):
        coverage.run(["no_such_model"])
    row = coverage.check_model_type("gpt2", ["causal_lm"])
    assert row["status"] == "passes" and row["checks"]["plain"].startswith("layout file")
    row = coverage.check_model_type("cvt", ["image_classification"])  # a config the sizes do not build
    assert row["status"] == "not built" and row["seconds"] >= 0 and "variants" not in row


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


def test_config_variants_are_the_fields_the_attention_reads():
    """Each type's variants come from the config fields its attention classes read: booleans flipped
    (Cohere's per-head q/k norms, biases, GPT-2's scaling flags), head_dim apart from hidden / heads,
    soft-capping off, sliding and full layers alternating, partial rotary; fields not varied say why."""
    from headprune.heads.adapters import get_adapter
    from tools.config_variants import config_variants

    def names(model_type, task="causal_lm"):
        model = coverage._builder(model_type, task)("eager")
        found, skipped = config_variants(model, get_adapter(model))
        return set(found), skipped

    assert names("cohere")[0] == {"attention_bias=True", "use_qk_norm=True", "head_dim=32"}
    assert {"attention_bias=True", "head_dim=32", "layer_types=sliding,full,sliding"} <= names("qwen3")[0]
    assert {"attn_logit_softcapping=None", "layer_types=full,full,full"} <= names("gemma2")[0]
    assert {"qk_layernorm=True", "partial_rotary_factor=1.0"} <= names("phi")[0]
    assert {"reorder_and_upcast_attn=True", "scale_attn_weights=False"} <= names("gpt2")[0]
    # BERT's cross-attention reaches the attention through its layer (transformers 5.25's BertLayer
    # reads add_cross_attention and builds a second BertAttention): named, with why it is not varied
    found, skipped = names("bert")
    assert "is_decoder=True" in found and "cross-attention" in skipped["add_cross_attention"]


@pytest.mark.slow
def test_the_committed_variants_are_the_ones_the_harness_finds_now(committed):
    """The committed table is fresh: for every passing type, the variants it checked and the fields it
    says are not varied are what tools/config_variants.py finds on the installed transformers."""
    from headprune.heads.adapters import get_adapter
    from tools.config_variants import config_variants

    stale = {}
    for row in committed["rows"]:
        if row["status"] != "passes":
            continue
        model = coverage._builder(row["model_type"], row["task"])("eager")
        found, skipped = config_variants(model, get_adapter(model))
        if sorted(found) != sorted(v["variant"] for v in row["variants"]) or skipped != row["not_varied"]:
            stale[row["model_type"]] = (sorted(found), skipped)
    assert stale == {}


def test_a_variant_that_goes_wrong_is_a_failure_of_that_variant(monkeypatch):
    """The row of a type whose default passes records each variant's own result: Cohere without the
    per-head norm slicing (`head_norms`) passes on its default config and fails under use_qk_norm."""
    import dataclasses

    monkeypatch.setitem(adapters.ADAPTERS, "cohere", dataclasses.replace(adapters.ADAPTERS["cohere"], head_norms=()))
    row = coverage.check_model_type("cohere", ["causal_lm"])
    variants = {v["variant"]: v for v in row["variants"]}
    assert row["status"] == "passes" and variants["attention_bias=True"]["status"] == "passes"
    assert variants["use_qk_norm=True"]["status"] == "fails"
    # surgery verifies itself (heads/verify.py): the unsliced per-head norm is named at prune_heads
    assert variants["use_qk_norm=True"]["reason"].startswith("eager: SurgeryError") and "q_norm" in variants["use_qk_norm=True"]["reason"]
    assert "| cohere | `use_qk_norm=True` | **no** |" in coverage.render_markdown({**coverage.run(["gpt2"]),
                                                                                  "rows": [row]})


def test_a_variant_the_config_class_does_not_keep_is_not_built():
    """Qwen3's config drops sliding_window unless use_sliding_window is set: a variant that set only the
    window would check the default again, so `applied` names the field and the variant is not built."""
    from transformers import Qwen3Config

    from tools.config_variants import applied

    config = Qwen3Config(sliding_window=4, use_sliding_window=False)
    assert applied(config, {"sliding_window": 4}) == "the config class turns sliding_window=4 into None"
    assert applied(Qwen3Config(sliding_window=4, use_sliding_window=True), {"sliding_window": 4}) == ""


def test_the_committed_table_checks_the_variants(committed):
    """Every passing type of the committed table was checked in its config variants, none of them fails,
    and the per-head norm variant that was once left unsliced (Cohere's use_qk_norm) is among them."""
    passing = [r for r in committed["rows"] if r["status"] == "passes"]
    assert all("variants" in r and "not_varied" in r for r in passing)
    failing = [(r["model_type"], v["variant"], v["reason"]) for r in passing for v in r["variants"]
               if v["status"] == "fails"]
    assert failing == []
    cohere = {v["variant"]: v["status"] for v in next(r for r in passing if r["model_type"] == "cohere")["variants"]}
    assert cohere["use_qk_norm=True"] == "passes"
    assert coverage.variant_counts(committed)["passes"] > len(passing)


def test_the_tooling_is_not_in_the_package():
    """The coverage harness and the config-reference generator are repository tooling (tools/), not
    shipped in the wheel (which packages src/headprune only)."""
    import importlib.util

    assert importlib.util.find_spec("headprune.deploy.coverage") is None
    assert importlib.util.find_spec("headprune.apps.config_reference") is None
    assert REPO / "tools" / "coverage.py" == REPO / coverage.__file__.split("/")[-2] / "coverage.py"
