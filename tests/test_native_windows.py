"""KV modes on models that slide their own windows (issue 56 item 1): a tiny Gemma 3 (`layer_types`
with sliding layers 0 and 2) and a tiny Mistral (`sliding_window` on every layer). A natively
sliding layer's units are already windowed: the cost table offers them full (priced at their
window) or removed, never windowed again, and a layout that windows one is refused by name. A
`kv_modes=attention_mass` run on either exports a model whose plain forward (its default cache)
and generate() run and equal the dense model with the layout applied."""
import json

import pytest
import torch
import transformers as tf

from headprune.apps.train import run
from headprune.heads.sliding import native_windows
from headprune.heads.windows import KVLayout, apply_kv_layout
from tests.helpers import compose_train, kv_modes_cli, tiny_tokenizer

SINK, WINDOW, NATIVE, SEQ = 2, 6, 12, 32  # a native window longer than the units' 8: windowing one would save bytes
SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             max_position_embeddings=256)
CONFIGS = {  # Gemma 3: layers 0 and 2 slide over NATIVE tokens, layer 1 attends to all; Mistral: both layers slide
    "gemma3_text": lambda **ids: tf.Gemma3TextConfig(**SHAPE, **ids, num_hidden_layers=3, head_dim=16,
                                                     query_pre_attn_scalar=12, sliding_window=NATIVE,
                                                     sliding_window_pattern=2),
    "mistral": lambda **ids: tf.MistralConfig(**SHAPE, **ids, num_hidden_layers=2, sliding_window=NATIVE),
}


def _model(family: str):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(CONFIGS[family](vocab_size=100), attn_implementation="sdpa").eval()


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_windowed_unit_of_a_natively_sliding_layer_is_refused_by_name(family):
    model = _model(family)
    modes = [["full", "full"] for _ in native_windows(model.config)]
    modes[0][1] = "window"
    with pytest.raises(ValueError, match=rf"layer 0 windows unit 1, but the model's layer 0 already slides its own "
                                         rf"window of {NATIVE} tokens .*allowed there: full .* or removed"):
        apply_kv_layout(model, KVLayout(modes, SINK, WINDOW))


def test_a_layer_attending_to_every_token_may_still_window_its_units():
    model = _model("gemma3_text")
    assert native_windows(model.config) == [NATIVE, None, NATIVE]
    apply_kv_layout(model, KVLayout((("full", "removed"), ("window", "full"), ("full", "full")), SINK, WINDOW))
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(3, 43).unsqueeze(0)).logits).all()


def test_measured_probes_window_no_unit_of_a_natively_sliding_layer():
    """kv_modes=measured's probes (selection.unit_probes) on Gemma 3: a sliding layer's units are
    probed removed only (windowing one raised in KVLayout.check, as on Gemma-3-270M), their window rise
    0; the layer attending to every token has both rises measured. Seen failing with the skip removed."""
    from headprune.heads.mask import HeadMask
    from headprune.selection.measured_values import measured_rises

    model = _model("gemma3_text")
    mask = HeadMask.for_model(model)
    batch = {"input_ids": torch.randint(3, 100, (1, SEQ), generator=torch.Generator().manual_seed(1))}
    removed, windowed, _ = measured_rises(model, mask, [batch], [[0, 1], [2, 3]], SINK, WINDOW)
    assert [w == [0.0, 0.0] for w in windowed] == [True, False, True]
    assert all(r != 0.0 for layer in removed for r in layer)


def test_gemma3s_own_from_pretrained_refuses_a_windowed_export_naming_load_pruned(tmp_path):
    """Issue 56.3 on the named sliding family: Gemma3ForCausalLM.from_pretrained (which only warns on
    the export's model_type) fails quoting headprune.load_pruned; load_pruned gives the windows back."""
    from headprune.deploy.hf import load_pruned, save_pruned

    model = _model("gemma3_text")
    apply_kv_layout(model, KVLayout((("full", "full"), ("window", "full"), ("full", "full")), SINK, WINDOW))
    save_pruned(model, tmp_path / "windowed")
    with pytest.raises(Exception, match=r"headprune\.load_pruned"):
        tf.Gemma3ForCausalLM.from_pretrained(tmp_path / "windowed")
    ids = torch.arange(3, 43).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(load_pruned(tmp_path / "windowed").eval()(ids).logits, model(ids).logits)


@pytest.fixture(scope="module", params=list(CONFIGS))
def sliding_dir(request, tmp_path_factory):
    """A config-only tiny model of the family with the byte tokenizer, for `model.pretrained`."""
    folder = tmp_path_factory.mktemp(request.param)
    tok = tiny_tokenizer()
    tok.save_pretrained(folder)
    CONFIGS[request.param](vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id).save_pretrained(folder)
    return request.param, folder


@pytest.mark.slow
@pytest.mark.parametrize("chooser", ["attention_mass", "measured_retrieval"])
def test_a_run_exports_a_model_whose_forward_and_generate_run(sliding_dir, chooser, tmp_path, data_dir):
    """Half of the KV bytes at seq 32: no unit of a sliding layer windowed (its 12 tokens would
    cost more than a window's 8, so a table offering it would pick it), units removed instead.
    The export's plain forward and generate() equal the dense model with the layout applied. The
    measured chooser (the experiment's default) once probed a sliding layer's unit windowed and
    failed (tests above)."""
    from headprune.deploy.hf import load_pruned
    from headprune.models.build import build_model
    from tests.test_kv_modes import greedy_by_full_forwards

    family, folder = sliding_dir
    res = run(compose_train(tmp_path, data_dir, *kv_modes_cli(folder, SINK, WINDOW, f"kv_modes={chooser}",
                                                               "model.attn_implementation=sdpa", seq=SEQ)))
    layout = KVLayout.from_json(res["final"]["kv_layout"])
    natives = native_windows(CONFIGS[family]())
    assert all("window" not in layer for layer, native in zip(layout.modes, natives) if native is not None)
    assert any("removed" in layer for layer in layout.modes)
    if family == "gemma3_text":
        assert res["budget"]["native_windows"] == {"0": NATIVE, "2": NATIVE}
    assert res["final"]["cost_share"] <= 0.5 + 1e-9
    assert json.loads((tmp_path / "results.json").read_text())["final"]["kv_layout"] == layout.to_json()

    loaded = load_pruned(tmp_path / "export").eval()
    dense = build_model(str(folder), task="causal_lm", random_init=True, attn_implementation="sdpa", seed=0).eval()
    apply_kv_layout(dense, layout)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = dense(ids, use_cache=False).logits
        assert torch.allclose(loaded(ids).logits, reference, atol=1e-5)
        out = loaded.generate(ids[:, :12], max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(dense, ids[:, :12], 20))


@pytest.mark.slow
def test_a_given_layout_windowing_a_sliding_layer_is_refused_before_any_work(sliding_dir, tmp_path, data_dir):
    """`kv_modes=given` with a layout file that windows a unit of a natively sliding layer (layer 0 of
    either family) is refused by headprune-train's config before any work, naming the file, the layer
    and its own window; the run dir holds nothing."""
    family, folder = sliding_dir
    modes = [["full", "full"] for _ in native_windows(CONFIGS[family]())]
    modes[0][1] = "window"
    layout_file = tmp_path / "modes.json"
    layout_file.write_text(json.dumps({"modes": modes, "sink": SINK, "window": WINDOW}))
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"kv_modes.layout={layout_file}: kv_modes layer 0 windows unit 1, but the "
                                         rf"model's layer 0 already slides its own window of {NATIVE} tokens"):
        run(compose_train(out, data_dir, *kv_modes_cli(folder, SINK, WINDOW, "kv_modes=given",
                                                       f"kv_modes.layout={layout_file}", "budget.target=1.0",
                                                       seq=SEQ)))
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
