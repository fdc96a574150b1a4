"""Per-unit KV modes: each KV group (GQA) or head (MHA) of each layer keeps its whole past
(`full`), only the first `sink` tokens plus the last `window` tokens (`window`, StreamingLLM /
DuoAttention's streaming heads), or nothing (`removed`).

The modes are a `heads.layout.Layout`'s (its `KVLayout` name is kept as an alias); `removed` units
are what the existing machinery removes (`HeadMask` gates, `heads.surgery`), `window` units are
restricted here.

Where the restriction sits: a forward pre-hook on each attention module (keyword arguments)
routes its kernel call through `heads.windowed_attention`, which runs the full units' heads
under the model's mask and the windowed units' heads chunk by chunk over only the keys their
window lets them see (`BandCall`). A module class not yet seen to look its kernel up (or seen
not to) also gets, in its `attention_mask`, a per-head mask of the query heads the kernel
computes: the same mask widened from (B, 1, Q, K) to (B, H, Q, K) with a windowed group's heads
also barred from keys outside its sinks and window. Both eager attention (an additive mask) and sdpa (an
additive or boolean mask, GQA packed or repeated) take a per-head mask as they take the shared
one, so the kernel, its softmax and the family's own score transforms (soft-capping, scaling)
stay the family's. A layer with no windowed unit is left alone (no hook; a hooked layer whose
windowed units were all removed returns None), so it computes bit for bit what it computes
without the hooks. Flash-attention kernels take no
per-head mask and are refused.

With a cache (generation, or any forward given one) the same hook gives each windowed layer a
cache layer of its own (`WindowedCacheLayer`, swapped into a transformers DynamicCache the first
time the layer writes to it): full KV heads keep every token, windowed ones their sinks and last
`window` tokens (the slots the next query may see, and the oldest of the window, which it may
not: sink + window in all, what `costs.tables.kv_mode_costs` counts), so the cache holds what
the layout keeps. Such a forward does only the work the layout keeps: the hook arms the module
(`heads.windowed_attention`), the cache layer hands the kernel the full heads' keys (B, F, T, D)
and keeps the windowed heads' held + new keys (B, W, n, D) aside, and the attention call runs
the family's kernel twice, full units' query heads over every key under the model's mask,
windowed units' over their held slots under a mask built from the slots, so no (B, all KV
heads, T, D) tensor is built and at a decode step a windowed head reads sink + window keys (the
new token written over the oldest window token, which the new query may not see), and
`generate()` computes what the masked full-sequence forward computes (to float rounding: the
masked keys it no longer sums over had weight exactly zero).

Positions are cache slots: query i of a forward that finds `past` tokens in the cache sits at
slot past + i, key j at slot j; a windowed head at slot p sees keys j <= p with f <= j < f + sink
or j > p - window (the window includes the token itself), f the row's first real token (the first
key slot the model's mask lets it see, `windowed_attention.first_keys`; 0 without padding). So a
left-padded row's sinks are its own first tokens, never pad slots, and the row computes what its
prompt computes alone (generate() gives left-padded rows positions from their first real token);
the cache keeps, per row, that row's sinks and last `window` tokens.
"""
from __future__ import annotations

import weakref
import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from headprune.heads.adapters import get_adapter, layer_heads
from headprune.heads.latent import is_latent
from headprune.heads.layout import FULL, KV_LAYOUT_ATTR, MODES, REMOVED, WINDOW, Layout, units_of  # noqa: F401
from headprune.heads.windowed_attention import (EMPTY_SLOT, ROUTES, BandCall, HeadSplit, SplitCall, arm, disarm,
                                               first_keys, heads_flags, mask_only, per_head_mask)

KERNELS = ("eager", "sdpa")  # attention implementations that take a per-head mask
KVLayout = Layout  # the name before the one Layout type (heads/layout.py); kept until callers move


def apply_kv_layout(model: nn.Module, layout: Layout) -> KVWindows:
    """Put `layout` on `model` (`Layout.apply`): its removed heads physically removed, its windowed
    units restricted (`KVWindows`, returned so it can be detached)."""
    return layout.apply(model)


def windows_refusal(model: nn.Module, target: str) -> str | None:
    """Why `target` (an export format) cannot serve `model`'s windowed KV units (None: it has none)."""
    if not Layout.of_model(model).windowed:
        return None
    return (f"the model has windowed KV units (per-KV-group sinks + window within a layer), which {target} cannot "
            "express: it attends every kept KV head to the whole context; allowed: layouts of full and removed units "
            "(save_pruned / load_pruned keep the windows)")


def window_allowed(queries: torch.Tensor, keys: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Bool (Q, K): which key slots a windowed head at each query slot may see (causal included)."""
    q, k = queries[:, None], keys[None, :]  # (Q, 1), (1, K)
    return (k <= q) & ((k < sink) | (k > q - window))


class KVWindows:
    """The window restriction of a `Layout` on a model, by pre-hooks on its attention modules
    (module docstring). `attach` records the layout on the model (`KV_LAYOUT_ATTR`)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self._handles: list = []
        self._splits: dict = {}  # layer -> (kept heads, device, query HeadSplit, KV heads' windowed flags)
        self._checked: dict = {}  # layer -> weakref to the module found to be the model's own at that layer

    def attach(self, model: nn.Module) -> "KVWindows":
        self.layout.check(model)
        kernel = getattr(model.config, "_attn_implementation", None)
        if any(WINDOW in layer for layer in self.layout.modes) and kernel not in KERNELS:
            raise ValueError(f"windowed KV units need a per-head attention mask, which attn_implementation={kernel!r} "
                             f"does not take; allowed: {', '.join(KERNELS)}")
        adapter = get_adapter(model)
        if any(WINDOW in layer for layer in self.layout.modes) and is_latent(adapter):
            raise ValueError(f"windowed KV units: model_type={model.config.model_type!r} caches one latent per layer "
                             "shared by all its heads (multi-head latent attention, heads.latent), so a head cannot "
                             "keep a window of it (not done); allowed: every unit full or removed")
        self.detach()
        for layer, block in enumerate(adapter.blocks(model)):
            if WINDOW in self.layout.modes[layer]:
                attention = adapter.attention(block)
                hook = attention.register_forward_pre_hook(self._make_hook(model, layer), with_kwargs=True)
                self._handles += [hook, attention.register_forward_hook(disarm, always_call=True)]
        setattr(model, KV_LAYOUT_ATTR, self.layout)
        self._model = model
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        model = getattr(self, "_model", None)
        if model is not None and getattr(model, KV_LAYOUT_ATTR, None) is self.layout:
            delattr(model, KV_LAYOUT_ATTR)
        self._model = None

    def slot_windowed(self, model: nn.Module, layer: int) -> list[bool]:
        """Per query head the kernel computes (H of them): whether it belongs to a windowed unit. A
        partly kept group gets as many slots as the fullest kept group (`ArchAdapter.query_slots`)."""
        adapter = get_adapter(model)
        groups = adapter.kv_groups(model.config, layer_heads(model, layer))  # kept groups, in kernel order
        per_group = adapter.query_slots(model.config, layer_heads(model, layer))[1] // max(len(groups), 1)
        return [self.layout.modes[layer][g] == WINDOW for g in groups for _ in range(per_group)]

    def kv_windowed(self, model: nn.Module, layer: int) -> list[bool]:
        """Per KV head the layer computes (kept groups, in order): whether its unit is windowed."""
        adapter = get_adapter(model)
        groups = adapter.kv_groups(model.config, layer_heads(model, layer))
        return [self.layout.modes[layer][g] == WINDOW for g in groups]

    def split_heads(self, model: nn.Module, layer: int, device: torch.device) -> tuple[HeadSplit, list[bool]]:
        """(the kernel's query heads as full and windowed units' halves, `kv_windowed`): what the
        split attention call and the cache layer need, kept while the layer's heads stay."""
        kept = tuple(layer_heads(model, layer))
        known = self._splits.get(layer)
        if known is None or known[0] != kept or known[1] != device:
            heads = HeadSplit.of(self.slot_windowed(model, layer), device)
            known = (kept, device, heads, self.kv_windowed(model, layer))
            self._splits[layer] = known
        return known[2], known[3]

    def _make_hook(self, model: nn.Module, layer: int):
        sink, window = self.layout.sink, self.layout.window

        def hook(module, args, kwargs):
            checked = self._checked.get(layer)
            if checked is None or checked() is not module:  # the model's own module (not a copy's), once per module
                adapter = get_adapter(model)
                if adapter.attention(adapter.blocks(model)[layer]) is not module:
                    raise ValueError(f"the KV windows of layer {layer} were attached to another model (this one is a "
                                     "deep copy of it?): attach KVWindows to the copy itself, or detach before copying")
                self._checked[layer] = weakref.ref(module)
            if "attention_mask" not in kwargs:
                raise ValueError(f"{type(module).__name__} is called without an attention_mask keyword, so windowed "
                                 "KV units cannot restrict it; windows are supported where the decoder layer passes "
                                 "attention_mask by keyword (the Llama layout)")
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (B, Q, hidden)
            heads, kv_windowed = self.split_heads(model, layer, hidden.device)
            if not len(heads.window):
                return None
            cache = next((v for v in kwargs.values() if isinstance(v, Cache)), None)  # `cache`, GPT-NeoX's `layer_past`
            if cache is not None:  # the split call (heads.windowed_attention): only the kept keys are read
                index = getattr(module, "layer_idx", layer)
                cache_layer = install_cache_layer(cache, index, kv_windowed, sink, window)
                cache_layer.see(kwargs["attention_mask"])
                arm(module, SplitCall(cache_layer, heads, sink, window, model.config._attn_implementation))
                return None
            mask = kwargs["attention_mask"]  # None, or (B, 1, Q, K) additive float or boolean
            routes = False if mask_only(model) else ROUTES.get(type(module))
            per_head = None if routes else per_head_mask(mask, heads_flags(heads, len(heads.full) + len(heads.window),
                                                                           hidden.device),
                                                         hidden.shape[1], sink, window, hidden.dtype)
            if routes is False or "config" not in module.__dict__:  # its own kernel: the per-head mask alone
                return args, {**kwargs, "attention_mask": per_head}
            kv = HeadSplit.of(kv_windowed, hidden.device)
            arm(module, BandCall(heads, kv, sink, window, model.config._attn_implementation, mask, per_head))
            return (args, kwargs) if per_head is None else (args, {**kwargs, "attention_mask": per_head})

        return hook


class WindowedCacheLayer(DynamicLayer):
    """One layer's KV cache when some of its KV heads are windowed: `keys` / `values` (B, full
    heads, T, D) hold every token of the full heads, `window_keys` / `window_values` (B, windowed
    heads, <= sink + window, D) a windowed head's sinks and `window` latest tokens, per row
    (`slots` (B, n): which slot each entry holds, `EMPTY_SLOT` for an entry a row does not use;
    `window_slots` the same, ascending). A row's sinks are its first `sink` real tokens (`first`
    (B,): each row's first real token, read from the model's mask by `see`; None: slot 0).
    `length` counts every slot seen, so masks and positions go on as for a full cache.

    `update` (only in a forward its `KVWindows` hook armed: `armed`) returns the full heads'
    keys and values, what the full units' query heads attend to, and leaves in `step` the
    windowed heads' held + new keys and their slots for the split attention call (`take_step`,
    heads.windowed_attention), keeping sinks + window. Once every row's windows are full
    (`full`), a one-token step writes the new token in place of the oldest window token (which
    the new query may not see; a ring after the sinks, at the same entry in every row), so the
    held keys are exactly those the query sees and nothing is copied but the new token."""

    chunked = True  # a long prefill's windowed heads attend chunk by chunk (heads.windowed_attention)

    def __init__(self, windowed: list[bool], sink: int, window: int):
        super().__init__()
        self.windowed, self.sink, self.window = list(windowed), sink, window
        self.length = 0
        self.armed = False  # set by the KVWindows hook for one forward (heads.windowed_attention.arm)
        self.step = None  # (window keys (B, W, n, D), values, slots (B, n), new slots (Q,) or None) of this forward
        self.ring = sink  # where the oldest window token is held once the windows are full
        self.first = None  # (B,) each row's first real token (left padding), None: every row starts at slot 0
        self.full = False  # every row holds exactly its sink + window tokens: the ring may turn

    def see(self, mask: torch.Tensor | None) -> None:
        """Note each row's first real token from this forward's mask (B, 1, Q, T) over every slot
        (`first_keys`); the earliest seen is kept (a later forward's mask may see fewer keys). A
        one-token step after the first real tokens are known cannot move them: not read again."""
        if self.first is not None and mask is not None and mask.shape[-2] == 1:
            return
        first = first_keys(mask)
        if first is not None:
            self.first = first if self.first is None else torch.minimum(self.first, first)

    def split_heads(self, key_states: torch.Tensor) -> None:
        """The layer's full and windowed KV heads on the device of its first keys (B, H, T, D),
        refused when the attention gives another number of KV heads than the layout names."""
        if key_states.shape[1] != len(self.windowed):
            raise ValueError(f"the cache layer was made for {len(self.windowed)} KV heads, the attention gave "
                             f"{key_states.shape[1]}")
        self.device = key_states.device
        self.heads = HeadSplit.of(self.windowed, self.device)
        self.full_heads, self.window_heads = self.heads.full, self.heads.window

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.split_heads(key_states)
        b, _, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, len(self.full_heads), 0, d)  # (B, F, 0, D)
        self.values = value_states.new_zeros(b, len(self.full_heads), 0, value_states.shape[-1])
        self.window_keys = key_states.new_zeros(b, len(self.window_heads), 0, d)  # (B, W, 0, D)
        self.window_values = value_states.new_zeros(b, len(self.window_heads), 0, value_states.shape[-1])
        self.slots = torch.zeros(b, 0, dtype=torch.long, device=self.device)  # (B, n): the held tokens' slots
        self.is_initialized = True

    @property
    def window_slots(self) -> torch.Tensor:
        """(B, n): the slots each row's windowed heads hold, ascending (`EMPTY_SLOT` last: unused)."""
        return self.slots.sort(dim=-1).values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.armed:
            raise ValueError("a windowed KV cache layer was written outside a forward its KVWindows hook armed (the "
                             "windows detached, or the cache passed to another model): its full heads' keys alone "
                             "are not the layer's keys; attach the layout's KVWindows, or use a fresh cache")
        self.armed = False
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new, first = key_states.shape[-2], self.length
        self.length += n_new
        full, window = self.heads.full_pick, self.heads.window_pick
        if len(self.full_heads):
            self.keys = torch.cat([self.keys, key_states[:, full]], dim=-2)  # (B, F, T, D)
            self.values = torch.cat([self.values, value_states[:, full]], dim=-2)
        if n_new == 1 and self.full:  # the ring: one write in place, the same entry in every row
            at = self.ring
            self.window_keys[:, :, at] = key_states[:, window, 0]
            self.window_values[:, :, at] = value_states[:, window, 0]
            self.slots[:, at] = first
            self.ring = self.sink + (at - self.sink + 1) % self.window
            self.step = (self.window_keys, self.window_values, self.slots, None)  # every held slot visible
            return self.keys, self.values
        if self.ring != self.sink:  # the ring turned: held in ascending slots again, oldest after the sinks
            order = torch.cat([torch.arange(self.sink), self.sink + (torch.arange(self.window) + self.ring - self.sink)
                               % self.window]).to(self.device)
            self.window_keys, self.window_values = self.window_keys[:, :, order], self.window_values[:, :, order]
            self.slots, self.ring = self.slots[:, order], self.sink
        b = key_states.shape[0]
        new = torch.arange(first, self.length, device=self.device)  # (Q,)
        window_keys = torch.cat([self.window_keys, key_states[:, window]], dim=-2)  # (B, W, n, D)
        window_values = torch.cat([self.window_values, value_states[:, window]], dim=-2)
        slots = torch.cat([self.slots, new.expand(b, -1)], dim=1)  # (B, n): each row's held slots ascending, then new
        self.step = (window_keys, window_values, slots, new)
        start = 0 if self.first is None else self.first[:, None]  # (B, 1)
        keep = (slots >= start) & (slots < EMPTY_SLOT) & ((slots < start + self.sink) | (slots >= self.length - self.window))
        counts = keep.sum(dim=1)  # (B,)
        least, most = (int(c) for c in torch.stack([counts.min(), counts.max()]).tolist())
        self.full = least == self.sink + self.window
        if least != slots.shape[1]:  # some row drops entries: each row's kept ones first (ascending), then unused
            order = torch.where(keep, slots, EMPTY_SLOT).argsort(dim=1, stable=True)[:, :most]  # (B, n')
            index = order[:, None, :, None]
            window_keys = window_keys.gather(2, index.expand(*window_keys.shape[:2], most, window_keys.shape[-1]))
            window_values = window_values.gather(2, index.expand(*window_values.shape[:2], most,
                                                                 window_values.shape[-1]))
            slots = torch.where(keep.gather(1, order), slots.gather(1, order), EMPTY_SLOT)
        self.window_keys, self.window_values, self.slots = window_keys, window_values, slots
        return self.keys, self.values

    def take_step(self):
        """(window keys (B, W, n, D), window values, their slots (n,), the new tokens' slots (Q,),
        None when one new query sees every held slot) of the forward that just wrote, handed
        over once."""
        if self.step is None:
            raise ValueError("the split attention of windowed KV units found no keys of this forward in its cache "
                             "layer (the layer was not written in this forward)")
        step, self.step = self.step, None
        return step

    def held_tokens(self) -> tuple[int, int]:
        """(tokens each full head holds, tokens each windowed head holds); 0 where it has none."""
        if not self.is_initialized:
            return 0, 0
        return tuple(t.shape[-2] if t.shape[1] else 0 for t in (self.keys, self.window_keys))

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a windowed KV cache cannot be cropped: the tokens its windows dropped are gone (assisted and "
                         "prompt-lookup decoding crop the cache; use plain greedy or sampled generation)")

    def reset(self) -> None:
        self.keys = self.values = self.window_keys = self.window_values = self.first = None
        self.length, self.armed, self.step, self.ring, self.full = 0, False, None, self.sink, False
        self.is_initialized = False

    def _rows(self, pick) -> None:
        if self.is_initialized:
            self.keys, self.values = pick(self.keys), pick(self.values)
            self.window_keys, self.window_values = pick(self.window_keys), pick(self.window_values)
            self.slots = pick(self.slots)
        if self.first is not None:
            self.first = pick(self.first)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t: t[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def offload(self) -> None:
        raise ValueError("a windowed KV cache is not offloaded: it is already what the layout keeps")


def install_cache_layer(cache, index: int, windowed: list[bool], sink: int, window: int) -> WindowedCacheLayer:
    """Give layer `index` of a transformers cache a `WindowedCacheLayer` before its first write
    (a DynamicCache's own layer, still empty, is replaced; one already windowed is kept), and
    return it. A
    cache of another kind, or a layer that already holds tokens, is refused: it would keep
    every token of the windowed heads."""
    cache = getattr(cache, "self_attention_cache", cache)
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"windowed KV units need a transformers Cache with per-layer storage, got "
                         f"{type(cache).__name__}")
    if len(layers) <= index and getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        while len(layers) <= index:
            layers.append(DynamicLayer())
    layer = layers[index] if index < len(layers) else None
    if isinstance(layer, WindowedCacheLayer):
        return layer
    if type(layer) is not DynamicLayer or layer.is_initialized:
        raise ValueError(f"layer {index} has windowed KV units but its cache layer is "
                         f"{type(layer).__name__ if layer is not None else 'missing'}"
                         f"{' holding tokens' if layer is not None and layer.is_initialized else ''}; windowed units "
                         "need an empty DynamicCache (generate()'s default) so that it keeps only sinks + window")
    layers[index] = WindowedCacheLayer(windowed, sink, window)
    return layers[index]
