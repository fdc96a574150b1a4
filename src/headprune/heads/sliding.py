"""The model's own sliding windows, per attention layer: what Gemma 3's `layer_types`, Mistral's
`sliding_window` or Llama 4's `attention_chunk_size` make a layer's cache keep, read from the
config as transformers' own caches read it.

Why here (heads/, below costs/): both the KV byte counter (`costs.kv_bytes`) and the KV layout
check (`heads.windows.KVLayout.check`: a natively sliding layer's units are already windowed, so
they are kept full or removed, never windowed again) read it.
"""
from __future__ import annotations

from transformers.cache_utils import get_layer_types_and_kwargs

SLIDING_TYPES = ("sliding_attention", "chunked_attention", "hybrid_sliding")  # layer_types a cache windows
LAYER_KINDS = ("full_attention", "hybrid", *SLIDING_TYPES, "dummy")  # the layer_types counted here
STATE_ONLY = ("linear_attention", "conv")  # hybrid models' layers without per-token keys (not attention blocks)


def native_windows(config) -> list[int | None]:
    """Per attention layer, the model's own sliding window in tokens (None: the layer attends to
    every token; 0: a layer that keeps no cache of its own, transformers' "dummy" layers), read by
    transformers' own `get_layer_types_and_kwargs`, as its DynamicCache and StaticCache read it
    (`layer_types`, else `sliding_window` / `attention_chunk_size` per layer). A hybrid model's
    linear-attention and convolution layers hold no per-token keys and are left out (its attention
    layers are the adapter's blocks, heads.hybrid); other layer kinds are refused."""
    config = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(config)
    windows = []
    for l, (kind, extra) in enumerate(zip(types, kwargs)):
        if kind in STATE_ONLY:
            continue
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer {l} of model_type={getattr(config, 'model_type', '?')!r} is a {kind!r} layer, "
                             f"whose cache is not per-token keys and values; KV bytes are counted for layer kinds "
                             f"{', '.join(LAYER_KINDS)}")
        windows.append(int(extra["sliding_window"]) if kind in SLIDING_TYPES else (0 if kind == "dummy" else None))
    return windows
