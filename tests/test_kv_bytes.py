"""The one KV-cache byte counter (costs/kv_bytes.py): a layout's price equals the bytes a live
cache holds, windowed units and natively sliding layers included, and every caller counts with it."""
import pytest
import torch
import transformers as tf
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache

from headprune.costs.kv_bytes import (cache_bytes, cache_layer_bytes, held_tokens, model_bytes, native_windows,
                                      unit_modes)
from headprune.heads.windows import KVLayout, apply_kv_layout
from tests.helpers import HD, llama

GEMMA = dict(HD, query_pre_attn_scalar=12, sliding_window=4, sliding_window_pattern=2)  # layers 0, 2 sliding


def gemma3(**overrides):
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(**{**GEMMA, **overrides})
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def ids(batch: int, tokens: int, seed: int = 0):
    return torch.randint(3, 60, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def run(model, batch: int, tokens: int, steps: int, cache=None):
    """The cache after a prefill of `tokens` and `steps` greedy one-token steps."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.no_grad():
        out = model(input_ids=ids(batch, tokens), cache=cache, use_cache=True)
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    return cache


def test_the_bench_counts_a_windowed_layers_windowed_heads():
    """Issue 56 item 4: layout [[full, window], [removed, window]], batch 2, 20 tokens, 1 + 3
    window: the cache holds 3,584 B (layer 0: one full head x 20 + one windowed head x 4, layer
    1: one windowed head x 4, at 2 x 8 x 4 B per token and head); the bench's old counter read
    only `.keys` / `.values` and said 2,560."""
    from headprune.bench import decoder, llm

    model = llama(attn="sdpa")
    apply_kv_layout(model, KVLayout((("full", "window"), ("removed", "window")), sink=1, window=3))
    cache = run(model, batch=2, tokens=20, steps=0)
    assert decoder.cache_bytes is llm.cache_bytes is cache_bytes  # the bench counts with the one counter
    assert cache_bytes(cache) == 3584
    assert sum(model_bytes(model, 20, batch=2)) == 3584


@pytest.mark.parametrize("tokens,steps", [(3, 0), (12, 0), (12, 3), (4, 6)])
def test_price_equals_count_with_windowed_units(tokens, steps):
    """A tiny Llama with windowed and removed units, batch 2, contexts below and past sink + window,
    after a prefill and after decode steps: model_bytes == cache_bytes, layer by layer."""
    model = llama(attn="sdpa")
    apply_kv_layout(model, KVLayout((("window", "full"), ("removed", "window")), sink=2, window=3))
    cache = run(model, 2, tokens, steps)
    assert [cache_layer_bytes(layer) for layer in cache.layers] == model_bytes(model, tokens + steps, batch=2)


@pytest.mark.parametrize("tokens,steps", [(2, 0), (10, 0), (10, 3)])
def test_price_equals_count_on_natively_sliding_layers(tokens, steps):
    """Gemma 3 (sliding window 4 on layers 0 and 2): its DynamicCache's sliding layers keep 3
    tokens between steps, its full layers every token; a StaticCache reserves 4 and max_cache_len."""
    model = gemma3(num_hidden_layers=3)
    assert native_windows(model.config) == [4, None, 4]
    cache = run(model, 2, tokens, steps)
    assert [cache_layer_bytes(layer) for layer in cache.layers] == model_bytes(model, tokens + steps, batch=2)
    static = run(model, 2, tokens, steps, StaticCache(config=model.config, max_cache_len=16))
    assert cache_bytes(static) == sum(model_bytes(model, 16, batch=2, static=True))


def test_mistral_sliding_window_is_read_from_the_config():
    """Mistral's `sliding_window` windows every layer; Llama's layers window none; a count after
    a prefill past the window equals the price."""
    torch.manual_seed(0)
    config = tf.MistralConfig(**{**HD, "sliding_window": 5})
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert native_windows(config) == [5] * config.num_hidden_layers
    assert native_windows(llama().config) == [None, None]
    cache = run(model, 1, 9, 2)
    assert cache_bytes(cache) == sum(model_bytes(model, 11))


def test_held_tokens_per_mode():
    assert [held_tokens(m, 100, sink=4, window=16) for m in ("full", "window", "removed")] == [100, 20, 0]
    assert held_tokens("window", 10, sink=4, window=16) == 10
    assert held_tokens("full", 4096, native=512, static=True) == 512  # Gemma 3's sliding layer at any context
    assert held_tokens("full", 4096, native=512) == 511  # ... between steps of a DynamicCache
    assert held_tokens("window", 4096, sink=64, window=448, native=512, static=True) == 512
    assert held_tokens("window", 4096, sink=4, window=60, native=512, static=True) == 64
    with pytest.raises(ValueError, match="'sliding'.*allowed: full, window, removed"):
        held_tokens("sliding", 10)


def test_the_kv_budget_prices_sliding_layers_as_their_window():
    """budget=kv at seq 4096 on a Gemma 3 config (window 512 on layers 0 and 2): a sliding layer
    costs 512 tokens per unit, a full one 4096; results.json gets the natively windowed layers."""
    from headprune.costs.tables import kv_costs, kv_mode_costs
    from headprune.selection.budgets import KVBudget

    model = gemma3(num_hidden_layers=3, sliding_window=512, max_position_embeddings=8192)
    per_unit = 2 * 16 * 4  # K and V x head_dim 16 x float32
    table = kv_costs(model, 1, 4096)
    assert [layer[1] for layer in table.cost] == [per_unit * 512, per_unit * 4096, per_unit * 512]
    modes = kv_mode_costs(model, 1, 4096, sink=4, window=60)
    assert modes.cost[1][(1, 1)] == per_unit * (4096 + 64) and modes.cost[1][(0, 1)] == per_unit * 64
    # a sliding layer's units are already windowed: kept full (its window) or removed, never windowed again
    assert sorted(modes.cost[0]) == sorted(modes.cost[2]) == [(0, 0), (1, 0), (2, 0)]
    assert modes.cost[0][(2, 0)] == 2 * per_unit * 512
    _, info = KVBudget(batch=1, seq=4096).measure(model)
    assert info == {"native_windows": {"0": 512, "2": 512}}
    _, plain = KVBudget(batch=1, seq=4096).measure(llama())
    assert plain == {}


def test_unit_modes_read_surgery_and_the_layout():
    model = llama(attn="sdpa")
    apply_kv_layout(model, KVLayout((("full", "window"), ("removed", "window")), sink=1, window=3))
    assert unit_modes(model) == [["full", "window"], ["removed", "window"]]
    assert unit_modes(llama()) == [["full", "full"], ["full", "full"]]


def test_unknown_cache_layers_are_refused_not_undercounted():
    class Extra(DynamicLayer):  # a layer kind holding more than keys and values (as quantized layers do)
        pass

    with pytest.raises(ValueError, match="Extra is not counted"):
        cache_layer_bytes(Extra())
    with pytest.raises(ValueError, match="no per-layer storage"):
        cache_bytes(object())
