"""Per-unit KV modes: each KV group (GQA) or head (MHA) of each layer keeps its whole past
(`full`), only the first `sink` tokens plus the last `window` tokens (`window`, StreamingLLM /
DuoAttention's streaming heads), or nothing (`removed`).

`KVLayout` is the per-layer list of modes with the window sizes; `removed` units are what the
existing machinery removes (`HeadMask` gates, `heads.surgery`), `window` units are restricted here.

Where the restriction sits: a forward pre-hook on each attention module (keyword arguments)
replaces its `attention_mask` by a per-head mask of the query heads the kernel computes, the
same mask widened from (B, 1, Q, K) to (B, H, Q, K) with a windowed group's heads also barred
from keys outside its sinks and window. Both eager attention (an additive mask) and sdpa (an
additive or boolean mask, GQA packed or repeated) take a per-head mask as they take the shared
one, so the kernel, its softmax and the family's own score transforms (soft-capping, scaling)
stay the family's. A layer with no windowed unit is left alone (its hook returns None), so it
computes bit for bit what it computes without the hooks. Flash-attention kernels take no
per-head mask and are refused.

Positions are cache slots: query i of a forward that finds `past` tokens in the cache sits at
slot past + i, key j at slot j; a windowed head at slot p sees keys j <= p with j < sink or
j > p - window (the window includes the token itself). Left-padded batches therefore count
their pad slots among the sinks (as HF's own sliding-window layers count them in the window).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from headprune.heads.adapters import get_adapter, layer_heads, model_shape

FULL, WINDOW, REMOVED = "full", "window", "removed"
MODES = (FULL, WINDOW, REMOVED)
LAYOUT_ATTR = "headprune_kv_layout"  # the KVLayout a model's window hooks apply (save_pruned records it)
KERNELS = ("eager", "sdpa")  # attention implementations that take a per-head mask


@dataclass(frozen=True)
class KVLayout:
    """modes[l][u]: the mode of unit u (a KV group, original numbering) of layer l; `sink` +
    `window` tokens are what a windowed unit keeps."""

    modes: tuple[tuple[str, ...], ...]
    sink: int
    window: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", tuple(tuple(layer) for layer in self.modes))
        for name, least in (("sink", 0), ("window", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"kv_modes.{name}={value!r} must be an integer >= {least}")
        for l, layer in enumerate(self.modes):
            for u, mode in enumerate(layer):
                if mode not in MODES:
                    raise ValueError(f"kv_modes layer {l} unit {u}: mode {mode!r} is not allowed; allowed: "
                                     f"{', '.join(MODES)}")

    @classmethod
    def uniform(cls, model: nn.Module, mode: str, sink: int, window: int) -> "KVLayout":
        """Every unit of every layer in one mode."""
        n_layers, n_units = units_of(model)
        return cls(tuple((mode,) * n_units for _ in range(n_layers)), sink, window)

    @property
    def kept(self) -> int:
        """Tokens a windowed unit keeps at most."""
        return self.sink + self.window

    def check(self, model: nn.Module) -> "KVLayout":
        """Refuse a layout whose shape is not the model's (layers x units, original numbering)."""
        n_layers, n_units = units_of(model)
        shape = [len(layer) for layer in self.modes]
        if shape != [n_units] * n_layers:
            raise ValueError(f"kv_modes has {len(shape)} layers with {shape} units; the model has {n_layers} layers of "
                             f"{n_units} units (KV groups, or heads without GQA)")
        return self

    def count(self, layer: int, mode: str) -> int:
        return sum(m == mode for m in self.modes[layer])

    def removed_heads(self, model: nn.Module) -> dict[int, list[int]]:
        """{layer: query heads of its removed units}, for `HeadMask.prune` / `heads.surgery.prune_heads`."""
        adapter, config = get_adapter(model), model.config
        groups = list(adapter.kv_groups(config, range(adapter.num_heads(config))).values())
        return {l: [h for u, mode in enumerate(layer) if mode == REMOVED for h in groups[u]]
                for l, layer in enumerate(self.modes) if REMOVED in layer}

    def to_json(self) -> dict:
        return {"modes": [list(layer) for layer in self.modes], "sink": self.sink, "window": self.window}

    @classmethod
    def from_json(cls, data: dict, where: str = "kv_modes") -> "KVLayout":
        if not isinstance(data, dict) or not {"modes", "sink", "window"} <= set(data):
            raise ValueError(f"{where}: expected an object with modes, sink and window, got {data!r}")
        modes = data["modes"]
        if not isinstance(modes, list) or not all(isinstance(layer, list) for layer in modes):
            raise ValueError(f"{where}: modes must be a list (layers) of lists of modes ({', '.join(MODES)})")
        return cls(tuple(tuple(layer) for layer in modes), data["sink"], data["window"])


def units_of(model: nn.Module) -> tuple[int, int]:
    """(layers, units per layer) of the original model: a unit is a KV head."""
    n_layers, _ = model_shape(model)
    return n_layers, get_adapter(model).num_kv_heads(model.config)


def window_allowed(queries: torch.Tensor, keys: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Bool (Q, K): which key slots a windowed head at each query slot may see (causal included)."""
    q, k = queries[:, None], keys[None, :]  # (Q, 1), (1, K)
    return (k <= q) & ((k < sink) | (k > q - window))


class KVWindows:
    """The window restriction of a `KVLayout` on a model, by pre-hooks on its attention modules
    (module docstring). `attach` records the layout on the model (`LAYOUT_ATTR`)."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self._handles: list = []

    def attach(self, model: nn.Module) -> "KVWindows":
        self.layout.check(model)
        kernel = getattr(model.config, "_attn_implementation", None)
        if any(WINDOW in layer for layer in self.layout.modes) and kernel not in KERNELS:
            raise ValueError(f"windowed KV units need a per-head attention mask, which attn_implementation={kernel!r} "
                             f"does not take; allowed: {', '.join(KERNELS)}")
        self.detach()
        adapter = get_adapter(model)
        for layer, block in enumerate(adapter.blocks(model)):
            if WINDOW in self.layout.modes[layer]:
                attention = adapter.attention(block)
                hook = attention.register_forward_pre_hook(self._make_hook(model, layer), with_kwargs=True)
                self._handles.append(hook)
        setattr(model, LAYOUT_ATTR, self.layout)
        self._model = model
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        model = getattr(self, "_model", None)
        if model is not None and getattr(model, LAYOUT_ATTR, None) is self.layout:
            delattr(model, LAYOUT_ATTR)
        self._model = None

    def slot_windowed(self, model: nn.Module, layer: int) -> torch.Tensor:
        """Bool (H,): which of the query heads the kernel computes belong to windowed units. A
        partly kept group gets as many slots as the fullest kept group (`ArchAdapter.query_slots`)."""
        adapter = get_adapter(model)
        groups = adapter.kv_groups(model.config, layer_heads(model, layer))  # kept groups, in kernel order
        per_group = adapter.query_slots(model.config, layer_heads(model, layer))[1] // max(len(groups), 1)
        return torch.tensor([self.layout.modes[layer][g] == WINDOW for g in groups for _ in range(per_group)],
                            dtype=torch.bool)

    def _make_hook(self, model: nn.Module, layer: int):
        sink, window = self.layout.sink, self.layout.window

        def hook(module, args, kwargs):
            if "attention_mask" not in kwargs:
                raise ValueError(f"{type(module).__name__} is called without an attention_mask keyword, so windowed "
                                 "KV units cannot restrict it; windows are supported where the decoder layer passes "
                                 "attention_mask by keyword (the Llama layout)")
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (B, Q, hidden)
            windowed = self.slot_windowed(model, layer).to(hidden.device)  # (H,)
            if not bool(windowed.any()):
                return None
            mask = kwargs["attention_mask"]  # None, or (B, 1, Q, K) additive float or boolean
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            index = getattr(module, "layer_idx", layer)
            past = cache.get_seq_length(index) if cache is not None else 0
            n_q = hidden.shape[1]
            n_k = mask.shape[-1] if mask is not None else past + n_q
            queries = torch.arange(past, past + n_q, device=hidden.device)
            keys = torch.arange(n_k, device=hidden.device)
            allowed = window_allowed(queries, keys, sink, window)  # (Q, K)
            allowed = allowed[None] | ~windowed[:, None, None]  # (H, Q, K): full heads unrestricted here
            if mask is None:  # sdpa's causal shortcut: causality is ours to add
                allowed = allowed & (keys[None, :] <= queries[:, None])[None]
                new = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
                new = new.masked_fill(~allowed, torch.finfo(hidden.dtype).min)[None]  # (1, H, Q, K)
            elif mask.dtype == torch.bool:
                new = mask & allowed[None]  # (B, H, Q, K)
            else:
                new = mask.masked_fill(~allowed[None], torch.finfo(mask.dtype).min)  # (B, H, Q, K)
            return args, {**kwargs, "attention_mask": new}

        return hook
