"""Windowed KV units in layers that slide on their own (issue 56 item 1; heads/windows.py): a tiny
Gemma 3 (`layer_types` with sliding layers) and a tiny Mistral (`sliding_window` on every layer).
A windowed unit of such a layer sees the intersection of both windows; the plain forward (with
its default cache) and generate() run and equal the masked model (forwards without a cache), and
a `kv_modes=attention_mass` run through the CLI path exports a model that does the same."""
import pytest
import torch
import transformers as tf

from headprune.heads.windows import KVLayout, KVWindows, native_windows, window_allowed
from tests.helpers import tiny_tokenizer

SINK, WINDOW, NATIVE = 2, 4, 6
HD = dict(vocab_size=100, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
          intermediate_size=64, max_position_embeddings=256)
CONFIGS = {  # layers 0 and 2 slide over NATIVE tokens in Gemma 3, every layer in Mistral
    "gemma3_text": lambda **ids: tf.Gemma3TextConfig(**{**HD, **ids}, head_dim=16, query_pre_attn_scalar=12,
                                                     sliding_window=NATIVE, sliding_window_pattern=2),
    "mistral": lambda **ids: tf.MistralConfig(**{**HD, **ids}, sliding_window=NATIVE),
}
LAYOUT = KVLayout((("window", "full"), ("window", "window"), ("full", "window")), sink=SINK, window=WINDOW)


def _model(family: str, attn: str):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation=attn).eval()


def _ids(batch: int = 2, tokens: int = 20, seed: int = 1):
    return torch.randint(3, 100, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _greedy_without_cache(model, prompt, steps: int):
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def test_native_windows_read_from_the_config():
    assert native_windows(CONFIGS["gemma3_text"]()) == [NATIVE, None, NATIVE]
    assert native_windows(CONFIGS["mistral"]()) == [NATIVE] * 3
    assert native_windows(tf.LlamaConfig(**HD)) == [None] * 3
    assert native_windows(tf.Qwen2Config(**HD)) == [None] * 3  # use_sliding_window false


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_windowed_unit_sees_the_intersection_of_both_windows(family):
    """Eager attention maps of layer 0 (natively sliding, unit 0 windowed): the windowed unit's
    heads put weight exactly on the keys both windows allow, the full unit's on the layer's own
    sliding window."""
    model = _model(family, "eager")
    KVWindows(LAYOUT).attach(model)
    t = 20
    with torch.no_grad():
        maps = model(_ids(tokens=t), use_cache=False, output_attentions=True).attentions[0]  # (B, H, T, T)
    slots = torch.arange(t)
    both = window_allowed(slots, slots, SINK, WINDOW, NATIVE)
    own = window_allowed(slots, slots, 0, NATIVE)
    assert not torch.equal(both, window_allowed(slots, slots, SINK, WINDOW))  # the sinks fall out of the window
    for head, allowed in ((0, both), (1, both), (2, own), (3, own)):
        assert torch.equal(maps[:, head] > 0, allowed.expand_as(maps[:, head])), head


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_forward_and_generate_with_a_cache_equal_the_masked_model(family, attn):
    """The plain forward (its default cache: transformers' sliding cache layers, which a windowed
    layer replaces) equals the forward without a cache; generate() over 5 + 15 tokens (past both
    windows) equals greedy decoding by full forwards; the sliding layers' cache holds what the
    intersection keeps."""
    from transformers.cache_utils import DynamicCache

    from headprune.heads.windows import WindowedCacheLayer

    model = _model(family, attn)
    with torch.no_grad():
        dense = model(_ids()).logits
    KVWindows(LAYOUT).attach(model)
    with torch.no_grad():
        assert torch.allclose(model(_ids()).logits, model(_ids(), use_cache=False).logits, atol=1e-5)
        assert not torch.allclose(model(_ids()).logits, dense, atol=1e-4)
        cache = DynamicCache(config=model.config)
        out = model.generate(_ids()[:, :5], max_new_tokens=15, do_sample=False, pad_token_id=0, cache=cache)
    assert torch.equal(out, _greedy_without_cache(model, _ids()[:, :5], 15))
    layer = cache.layers[0]
    assert isinstance(layer, WindowedCacheLayer) and layer.is_sliding
    assert layer.held_tokens() == (NATIVE - 1, WINDOW)  # 19 tokens seen: the sinks left the layer's window
    assert layer.window_slots.tolist() == [15, 16, 17, 18]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_kv_modes_run_exports_a_model_that_runs(family, tmp_path, data_dir):
    """`kv_modes=attention_mass` through headprune-train's path on a config-only tiny model: the
    export (load_pruned) runs a plain forward and generate(), equal to the dense model with the
    layout applied, forward without a cache."""
    from headprune.apps.train import run
    from headprune.deploy.hf import load_pruned
    from headprune.heads.windows import apply_kv_layout
    from headprune.models.build import build_model
    from tests.helpers import compose_train, kv_modes_cli

    tok = tiny_tokenizer()
    folder = tmp_path / family
    tok.save_pretrained(folder)
    CONFIGS[family](vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id).save_pretrained(folder)
    res = run(compose_train(tmp_path / "run", data_dir, *kv_modes_cli(folder, SINK, WINDOW, "kv_modes=attention_mass")))
    layout = KVLayout.from_json(res["final"]["kv_layout"])
    assert "window" in [m for layer in layout.modes for m in layer]
    loaded = load_pruned(tmp_path / "run" / "export").eval()
    dense = build_model(str(folder), task="causal_lm", random_init=True, attn_implementation="sdpa", seed=0).eval()
    apply_kv_layout(dense, layout)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, dense(ids, use_cache=False).logits, atol=1e-5)
        out = loaded.generate(ids[:, :12], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, _greedy_without_cache(dense, ids[:, :12], 12))
