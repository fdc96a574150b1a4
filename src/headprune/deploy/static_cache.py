"""A static KV cache for serving an export in PyTorch: every buffer allocated once, at the first
write, and written in place at each decode step; a layer's windowed KV units in a ring.

Why: a server holds a fixed budget of cache memory and decodes with one shape per step (CUDA
graphs, torch.compile), so it preallocates. transformers' StaticCache does that for full and
natively sliding layers (`StaticLayer`, `StaticSlidingWindowLayer`); a layer with windowed KV
units (heads.windows) gets `StaticWindowedLayer`: its full units' keys in a (B, F, max_len, D)
buffer like a StaticLayer's, its windowed units' in a ring of S = sink + window entries (B, W, S,
D; max_len entries when that is fewer) with each entry's slot (S,), written where the slot's
residue puts it (a sink at its own slot, a later token at sink + (slot - sink) % window, over the
one token the new query may no longer see), so the ring always holds exactly what the next query
sees, and a decode step allocates no cache memory. The positions live in device tensors (`position`), so a captured step replays.
The idea is deploy/onnx_ring.py's, where the ring is a graph input instead.

The split attention call (heads.windowed_attention) reads the ring under a mask built from the
slots (unused entries at `EMPTY_SLOT`), the full units' buffer under the model's mask over
max_len keys (`get_mask_sizes`), as transformers' static layers are read. A prefill of several
tokens attends over the ring and the new tokens (chunked, as `WindowedCacheLayer` does), then
writes the tokens it keeps into the ring. Bytes: `costs.kv_bytes` counts the buffers (a static
cache holds what it reserves: max_len per full unit, sink + window per windowed one).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DummyLayer, StaticLayer, StaticSlidingWindowLayer

from headprune.costs.kv_bytes import native_windows
from headprune.heads.adapters import get_adapter, model_shape
from headprune.heads.windowed_attention import EMPTY_SLOT, first_keys
from headprune.heads.layout import Layout
from headprune.heads.windows import KVWindows, WindowedCacheLayer


class StaticWindowedLayer(WindowedCacheLayer):
    """One layer's static cache when some of its KV heads are windowed (module docstring):
    `keys` / `values` (B, F, max_len, D), `window_keys` / `window_values` (B, W, sink + window,
    D), `slots` (S,), `position` () the next token's slot."""

    chunked = True  # a long prefill's windowed heads attend chunk by chunk
    is_compileable = True

    def see(self, mask: torch.Tensor | None) -> None:
        """The serving bench's batches are unpadded, so every row's sinks start at slot 0 (`first`
        stays None: one ring for all rows). A left-padded batch is refused: its rows' sinks would
        start at their first real token, which this one shared ring does not keep apart."""
        first = first_keys(mask) if self.length == 0 else None
        if first is not None and bool((first > 0).any()):
            raise ValueError("the static windowed cache serves unpadded batches; a left-padded batch needs the "
                             "dynamic cache (heads.windows.WindowedCacheLayer), which keeps each row's sinks")
    is_sliding = False

    def __init__(self, windowed: list[bool], sink: int, window: int, max_len: int):
        super().__init__(windowed, sink, window)
        self.max_cache_len = max_len
        self.position = torch.zeros((), dtype=torch.long)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.split_heads(key_states)
        b, d, dv = key_states.shape[0], key_states.shape[-1], value_states.shape[-1]
        ring = min(self.sink + self.window, self.max_cache_len)  # a shorter cache never wraps: slot = entry
        self.keys = key_states.new_zeros(b, len(self.full_heads), self.max_cache_len, d)  # (B, F, L, D)
        self.values = value_states.new_zeros(b, len(self.full_heads), self.max_cache_len, dv)
        self.window_keys = key_states.new_zeros(b, len(self.window_heads), ring, d)  # (B, W, S, D)
        self.window_values = value_states.new_zeros(b, len(self.window_heads), ring, dv)
        self.slots = torch.full((ring,), EMPTY_SLOT, dtype=torch.long, device=self.device)  # (S,)
        self.position = self.position.to(self.device)
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.window_keys, self.window_values, self.slots, self.position):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def ring_index(self, slots: torch.Tensor) -> torch.Tensor:
        """The ring entry of each slot: a sink its own, a later token sink + (slot - sink) % window."""
        return torch.where(slots < self.sink, slots, self.sink + (slots - self.sink) % self.window)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.armed:
            raise ValueError("a static windowed KV cache layer was written outside a forward its KVWindows hook armed "
                             "(attach the layout's KVWindows)")
        self.armed = False
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        if isinstance(self.length, int) and self.length + n_new > self.max_cache_len:
            raise ValueError(f"the static cache holds {self.max_cache_len} tokens; {self.length} are written and "
                             f"{n_new} more were given")
        self.length += n_new
        new = torch.arange(n_new, device=self.device) + self.position  # (Q,): the new tokens' slots
        full, window = self.heads.full_pick, self.heads.window_pick
        self.keys.index_copy_(2, new, key_states[:, full])  # (B, F, L, D), in place
        self.values.index_copy_(2, new, value_states[:, full])
        if n_new == 1:  # decode: the new token over the entry the query may no longer see, then the ring
            at = self.ring_index(new)  # (1,)
            self.window_keys.index_copy_(2, at, key_states[:, window])
            self.window_values.index_copy_(2, at, value_states[:, window])
            self.slots.index_copy_(0, at, new)
            self.step = (self.window_keys, self.window_values, self.slots, new)
        else:  # prefill: attend over the ring and the new tokens, then keep the sinks and the last window
            keys = torch.cat([self.window_keys, key_states[:, window]], dim=-2)  # (B, W, S + Q, D)
            values = torch.cat([self.window_values, value_states[:, window]], dim=-2)
            self.step = (keys, values, torch.cat([self.slots, new]), new)
            end = self.position + n_new
            kept = ((new < self.sink) | (new >= end - self.window)).nonzero().flatten()  # (k,) distinct ring entries
            at = self.ring_index(new[kept])
            self.window_keys.index_copy_(2, at, key_states[:, window][:, :, kept])
            self.window_values.index_copy_(2, at, value_states[:, window][:, :, kept])
            self.slots.index_copy_(0, at, new[kept])
        self.position.add_(n_new)
        return self.keys, self.values

    def get_seq_length(self):
        return self.position if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            for t in (self.keys, self.values, self.window_keys, self.window_values):
                t.zero_()
            self.slots.fill_(EMPTY_SLOT)
            self.position.zero_()
        self.length, self.armed, self.step = 0, False, None

    def _rows(self, pick) -> None:
        slots = self.slots  # (S,): one ring shared by every row (unpadded batches, `see`), not per row
        super()._rows(pick)  # new buffers (outside decode: `repeat_rows`)
        self.slots = slots
        if self.is_initialized and not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.window_keys, self.window_values):
                torch._dynamo.mark_static_address(t)


def static_cache(model: nn.Module, max_len: int) -> Cache:
    """A static cache of `max_len` tokens for `model` as it stands: per layer a StaticLayer, the
    model's own sliding layers a StaticSlidingWindowLayer, a layer with windowed KV units (its
    attached KV layout) a `StaticWindowedLayer`. Buffers are allocated at the first write (the
    batch is the prefill's)."""
    if max_len < 1:
        raise ValueError(f"a static cache of {max_len} tokens; allowed: max_len >= 1")
    layout = Layout.of_model(model)
    windows = KVWindows(layout) if layout.windowed else None
    natives = native_windows(model.config)
    if len(natives) != model.config.get_text_config(decoder=True).num_hidden_layers:
        raise ValueError(f"model_type={model.config.model_type!r} has layers without per-token keys (linear attention): "
                         "a static cache for them is not built here (not done); allowed: attention-only decoders")
    layers = []
    for l in range(model_shape(model)[0]):
        windowed = windows.kv_windowed(model, l) if windows is not None else []
        if natives[l] == 0:
            layers.append(DummyLayer())
        elif any(windowed):
            if natives[l] is not None:
                raise ValueError(f"layer {l} has windowed KV units and its own sliding window of {natives[l]} "
                                 "tokens: a static cache for both is not built (not done); allowed: windowed units "
                                 "in layers the model does not window itself")
            layers.append(StaticWindowedLayer(windowed, layout.sink, layout.window, max_len))
        elif natives[l] is not None:
            layers.append(StaticSlidingWindowLayer(max_cache_len=max_len, sliding_window=natives[l]))
        else:
            layers.append(StaticLayer(max_cache_len=max_len))
    get_adapter(model)  # a family headprune knows (refused by name otherwise)
    return Cache(layers=layers)


def repeat_rows(cache: Cache, batch: int) -> None:
    """Every layer's buffers of a batch-1 static cache repeated to `batch` rows (new buffers, once,
    before decoding): the shapes and work of `batch` prompts without `batch` prefills."""
    for layer in cache.layers:
        if isinstance(layer, StaticWindowedLayer):
            layer.batch_repeat_interleave(batch)
        elif isinstance(layer, StaticLayer) and layer.is_initialized:
            if layer.keys.shape[0] != 1:
                raise ValueError(f"repeat_rows repeats a batch-1 cache; this one holds {layer.keys.shape[0]} rows")
            layer.keys, layer.values = layer.keys.repeat(batch, 1, 1, 1), layer.values.repeat(batch, 1, 1, 1)
            layer.batch_size = batch
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)


def snapshot(cache: Cache) -> list[dict]:
    """What a decode round changes besides tokens past the prompt (which the next round writes
    over and the mask hides): positions, rings and sliding buffers, per layer."""
    saved = []
    for layer in cache.layers:
        if isinstance(layer, StaticWindowedLayer) and layer.is_initialized:
            saved.append({"length": layer.length, **{n: getattr(layer, n).clone() for n in
                                                      ("position", "slots", "window_keys", "window_values")}})
        elif isinstance(layer, StaticSlidingWindowLayer) and layer.is_initialized:
            saved.append({"cumulative_length_int": layer.cumulative_length_int,
                          **{n: getattr(layer, n).clone() for n in ("cumulative_length", "keys", "values")}})
        elif isinstance(layer, StaticLayer) and layer.is_initialized:
            saved.append({"cumulative_length": layer.cumulative_length.clone()})
        else:
            saved.append({})
    return saved


def restore(cache: Cache, saved: list[dict]) -> None:
    """Put `snapshot`'s state back, in place (the buffers keep their addresses)."""
    for layer, state in zip(cache.layers, saved):
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                getattr(layer, name).copy_(value)
            else:
                setattr(layer, name, value)
