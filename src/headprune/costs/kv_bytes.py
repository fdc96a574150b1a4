"""KV-cache bytes, one counter for every caller: the price of a layout (analytic) and the bytes a
live cache holds (counted), which a test keeps equal.

Why one module: the budget's cost tables, the bench, the GGUF export, the experiments and the
windowed cache each counted bytes their own way, and one of them (the bench reading only each
layer's `.keys` / `.values`) under-reported a windowed layer, whose windowed heads sit in
`window_keys` / `window_values`.

Price (`held_tokens`, `layer_bytes`, `model_bytes`): per layer and unit (a KV head, or KV group
under GQA), the tokens it holds at a context of `context` tokens, times 2 (K and V) x head_dim
x the cache dtype's bytes x batch:
- a `removed` unit holds nothing;
- a `full` unit holds every token, or, in a layer the model itself windows (Gemma 3's sliding
  layers, Mistral's `sliding_window`: `native_windows`, read from the config as transformers'
  caches read it), what that layer's cache keeps: sliding_window - 1 tokens between steps in a
  DynamicCache (generate()'s default), sliding_window in a static one (`static=True`);
- a `window` unit (heads.windows) holds its sinks and last window, sink + window tokens, or what
  its layer's own window keeps if that is fewer: such a unit is already windowed by the model.
All at most `context`. A model with no KV layout has every kept unit full.

Count (`cache_bytes`): the key and value tensors of every layer of a transformers cache, by the
layer's kind: dynamic and static layers (sliding ones included) their `keys` / `values`;
`heads.windows.WindowedCacheLayer` (and the ring layers built on it) also `window_keys` /
`window_values`; a layer kind this module does not know is refused rather than under-counted.
A static layer counts what it allocated (its whole max_cache_len), the bytes a server reserves.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import (DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer,
                                      StaticSlidingWindowLayer)

from headprune.heads.adapters import get_adapter
from headprune.heads.headless import HeadlessCacheLayer
from headprune.heads.layout import MODES, REMOVED, WINDOW, Layout
from headprune.heads.sliding import native_windows
from headprune.heads.windows import WindowedCacheLayer

def held_tokens(mode: str, context: int, sink: int = 0, window: int = 1, native: int | None = None,
                static: bool = False) -> int:
    """Tokens one unit in `mode` holds at `context` tokens (module docstring); `native`: its
    layer's own sliding window (None: none); `static`: a static cache (a sliding layer keeps its
    whole window) rather than a dynamic one (it keeps window - 1 between steps)."""
    if mode not in MODES:
        raise ValueError(f"KV mode {mode!r} is not allowed; allowed: {', '.join(MODES)}")
    if mode == REMOVED:
        return 0
    held = context
    if native == 0:
        return 0
    if native is not None:
        held = min(held, native if static else native - 1)
    if mode == WINDOW:
        held = min(held, sink + window)
    return held


def token_bytes(kv_heads: int, head_dim: int, value_bytes: int) -> int:
    """K plus V bytes one token adds for `kv_heads` heads of `head_dim` values of `value_bytes`."""
    return 2 * kv_heads * head_dim * value_bytes


def value_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of one cached value: `dtype`'s, else the model's parameters' (what its cache holds)."""
    if dtype is not None:
        return torch.empty((), dtype=dtype).element_size()
    return next(model.parameters()).element_size()


def unit_modes(model: nn.Module) -> list[list[str]]:
    """Per layer, each original unit's mode as `model` stands (`heads.layout.Layout.of_model`):
    `removed` where surgery removed its heads, else its KV layout's mode, else `full`."""
    return [list(layer) for layer in Layout.of_model(model).modes]


def layer_bytes(modes: list[str], context: int, head_dim: int, value_bytes: int, batch: int = 1, sink: int = 0,
                window: int = 1, native: int | None = None, static: bool = False) -> int:
    """The bytes one layer whose units are in `modes` holds at `context` tokens (module docstring)."""
    tokens = sum(held_tokens(m, context, sink, window, native, static) for m in modes)
    return token_bytes(1, head_dim, value_bytes) * tokens * batch


def model_bytes(model: nn.Module, context: int, batch: int = 1, modes: list[list[str]] | None = None,
                sink: int | None = None, window: int | None = None, dtype: torch.dtype | None = None,
                static: bool = False) -> list[int]:
    """Per layer, the KV bytes `model` holds at `context` tokens x `batch` (module docstring).
    `modes`: per layer, each original unit's mode (default: `unit_modes(model)`, the model as it
    stands); `sink` / `window`: a windowed unit's (default: the attached KV layout's)."""
    adapter, layout = get_adapter(model), Layout.of_model(model)
    sink = sink if sink is not None else layout.sink
    window = window if window is not None else layout.window
    modes = [list(layer) for layer in layout.modes] if modes is None else modes
    d, width, natives = adapter.head_dim(model.config), value_bytes(model, dtype), native_windows(model.config)
    if len(modes) != len(natives):
        raise ValueError(f"KV modes for {len(modes)} layers; the model has {len(natives)}")
    return [layer_bytes(m, context, d, width, batch, sink, window, natives[l], static) for l, m in enumerate(modes)]


PLAIN_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer,
                HeadlessCacheLayer)  # keys, values (an attention-free layer's: empty)


def cache_layer_bytes(layer) -> int:
    """The bytes one transformers cache layer holds (module docstring); an empty layer holds 0."""
    if isinstance(layer, WindowedCacheLayer):
        names = ("keys", "values", "window_keys", "window_values")
    elif type(layer) in PLAIN_LAYERS:
        names = ("keys", "values")
    elif type(layer) is DummyLayer:
        return 0
    else:
        raise ValueError(f"cache layer {type(layer).__name__} is not counted (what it holds beyond keys and values "
                         "is not known here); allowed: " + ", ".join(c.__name__ for c in PLAIN_LAYERS)
                         + ", DummyLayer, heads.windows.WindowedCacheLayer and the ring layers built on it")
    if not getattr(layer, "is_initialized", False):
        return 0
    return sum(t.numel() * t.element_size() for t in (getattr(layer, n, None) for n in names) if t is not None)


def cache_bytes(cache) -> int:
    """The bytes every layer of a transformers cache holds (its self-attention part, for an
    encoder-decoder cache)."""
    cache = getattr(cache, "self_attention_cache", cache)
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"{type(cache).__name__} has no per-layer storage to count; allowed: a transformers Cache")
    return sum(cache_layer_bytes(layer) for layer in layers)
