"""The attention call of a layer with windowed KV units when it runs with a cache (generation).

Why: with one kernel call per layer, every query head attends over every key slot of the layer,
so a windowed unit's heads would read the whole context (a per-head mask only hides it) and the
cache would have to hand the kernel one (B, all KV heads, T, D) tensor per step. Here the layer's
query heads are split in two: the full units' heads attend to the full KV heads' keys (B, F, T,
D) under the model's own mask, the windowed units' heads to their compact keys (B, W, n, D: the
sinks and window the cache layer holds, plus this forward's new tokens) under a mask built from
their slots (at a one-token step with full windows the held keys are exactly those the query
sees, so only the model's own mask, if any, is applied), and the two outputs go back in head
order. Each half is computed by the family's own attention function (eager, or transformers'
sdpa), so its scaling, soft-capping, dropout and GQA handling stay the family's; at a decode
step the windowed half reads sink + window keys.

How the call gets here without touching each family: the `KVWindows` pre-hook arms the module
(`arm`: a `SplitCall` on it, its `config` replaced, for this one forward, by a `KernelConfig`
that names `SPLIT_KERNEL`, registered with transformers' AttentionInterface), so the module's
forward looks up `split_attention` where it looks up its kernel; a forward hook (`disarm`,
run even when the forward raises) puts the model's config back. Forwards without a cache never
come here (they keep the per-head mask of `heads.windows`).

A key at slot k is visible to a windowed head's query at slot q iff k <= q and (k < sink or
k > q - window) (`heads.windows.window_allowed`); the model's own mask (padding, causality) is
read at the held slots, so a padded row keeps what the masked full-sequence forward gives it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

SPLIT_KERNEL = "headprune_windowed_split"  # the AttentionInterface name an armed module's forward looks up
SPLIT_ATTR = "headprune_split"  # the SplitCall an armed attention module carries for one forward
VIEW_ATTR = "headprune_kernel_config"  # the module's KernelConfig, kept between forwards
SHARED_TENSOR_KWARGS = ("position_ids", "cache_position")  # tensors a kernel may get that are not per head


def pick(indices: torch.Tensor) -> slice | torch.Tensor:
    """What `t[:, pick]` selects `indices` (ascending) of dim 1 with: a slice (a view, no copy)
    when they are contiguous, else the indices."""
    if len(indices) and int(indices[-1]) - int(indices[0]) + 1 == len(indices):
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return indices


@dataclass(frozen=True)
class HeadSplit:
    """A layer's heads (query heads of the kernel, or KV heads) in two halves: `full` and
    `window` (ascending indices), the `full_pick` / `window_pick` that select them (`pick`), and
    `order`: the halves' order when each is one contiguous block (their outputs concatenate),
    else None."""

    full: torch.Tensor  # (Hf,) long
    window: torch.Tensor  # (Hw,) long
    full_pick: slice | torch.Tensor
    window_pick: slice | torch.Tensor
    order: tuple[str, str] | None

    @classmethod
    def of(cls, windowed: torch.Tensor) -> "HeadSplit":
        """From (H,) bool: which heads belong to windowed units."""
        full, window = (~windowed).nonzero().flatten(), windowed.nonzero().flatten()
        picks = pick(full), pick(window)
        order = None
        if all(isinstance(p, slice) or not len(i) for p, i in zip(picks, (full, window))):  # two adjacent blocks
            order = ("window", "full") if len(full) and len(window) and window[0] < full[0] else ("full", "window")
        return cls(full, window, *picks, order)


@dataclass
class SplitCall:
    """One forward's split of a layer's query heads (`heads`, kernel order): the full units'
    attend to the full KV heads' keys, the windowed units' to the compact keys held by `layer`
    (a `heads.windows.WindowedCacheLayer`); `kernel` is the implementation the model is
    configured with (eager or sdpa)."""

    layer: object
    heads: HeadSplit
    sink: int
    window: int
    kernel: str


class KernelConfig:
    """The attention module's config during an armed forward: every field the model's config
    has, except `_attn_implementation`, which names the split kernel."""

    _attn_implementation = SPLIT_KERNEL

    def __init__(self, base):
        self.__dict__["base"] = base

    def __getattr__(self, name: str):
        if name == "base" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["base"], name)


def arm(module: nn.Module, call: SplitCall) -> None:
    """Route `module`'s next forward's attention through `split_attention` with `call`. The
    module's plain attributes are written in its __dict__ directly (what nn.Module.__setattr__
    does for them after its checks: this runs per layer at every decode step); its KernelConfig
    is kept while the model's config stays the same object."""
    state = module.__dict__
    config = state.get("config")
    if config is None:
        raise ValueError(f"windowed KV units at generation route the attention call through the module's config "
                         f"(_attn_implementation), and {type(module).__name__} has no config attribute; allowed: "
                         "families whose attention module looks its kernel up in transformers' AttentionInterface")
    if isinstance(config, KernelConfig):
        config = config.base
    view = state.get(VIEW_ATTR)
    if view is None or view.base is not config:
        view = state[VIEW_ATTR] = KernelConfig(config)
    state[SPLIT_ATTR] = call
    call.layer.armed = True
    state["config"] = view


def disarm(module: nn.Module, args, output) -> None:
    """Undo `arm` after the forward (a forward hook run even when it raised); a no-op otherwise.
    A forward that returned without calling `split_attention` (its family does not look its
    kernel up by `config._attn_implementation`) handed its kernel the full heads' keys alone:
    refused."""
    state = module.__dict__
    config = state.get("config")
    if isinstance(config, KernelConfig):
        state["config"] = config.base
    call = state.get(SPLIT_ATTR)
    if call is None:
        return
    state[SPLIT_ATTR] = None
    unused = call.layer.armed or call.layer.step is not None
    call.layer.armed, call.layer.step = False, None
    if unused and output is not None:
        raise ValueError(f"{type(module).__name__} ran its attention without the split call of windowed KV units "
                         "(it does not look its kernel up in transformers' AttentionInterface by "
                         "config._attn_implementation), so its kernel saw only the full units' keys; windowed units "
                         "at generation are not supported for this family (forwards without a cache are)")


def family_kernel(module: nn.Module, kernel: str):
    """The attention function the module runs under `kernel` unarmed: its family's own eager
    function (what transformers falls back to for "eager"), or the registered sdpa."""
    if kernel == "eager":
        function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if function is None:
            raise ValueError(f"windowed KV units at generation under eager attention call the family's own "
                             f"eager_attention_forward, which {type(module).__module__} does not define; allowed: "
                             "attn_implementation=sdpa, or a family whose modeling file defines it (Llama layout)")
        return function
    if kernel != "sdpa":
        raise ValueError(f"windowed KV units at generation split the attention call by head, which "
                         f"attn_implementation={kernel!r} cannot take; allowed: eager, sdpa")
    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def window_mask(mask: torch.Tensor | None, queries: torch.Tensor | None, slots: torch.Tensor, sink: int,
                window: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The windowed heads' mask over their held slots: (B or 1, 1, Q, n), boolean where the
    model's mask is boolean, else additive; the model's mask (B, 1, Q, T) read at `slots`.
    `queries` None: one query that may see every held slot (the cache layer's steady state),
    so only the model's mask applies (None if it has none)."""
    if queries is None:
        return None if mask is None else mask.index_select(-1, slots)
    q, k = queries[:, None], slots[None, :]  # (Q, 1), (1, n)
    allowed = (k <= q) & ((k < sink) | (k > q - window))  # (Q, n)
    if mask is None:  # sdpa's causal shortcut: the window mask carries causality
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[None, None]
    held = mask.index_select(-1, slots)  # (B, 1, Q, n)
    if held.dtype == torch.bool:
        return held & allowed
    return held.masked_fill(~allowed, torch.finfo(held.dtype).min)


def split_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs):
    """`module`'s attention with its query heads split (module docstring). query (B, H, Q, D);
    key / value (B, F, T, D): the full KV heads only. Returns ((B, Q, H, Dv), weights): the
    weights (B, H, Q, T), zero where a windowed head holds no key, only when the kernel gives
    them and the model records attentions (output_attentions), else None."""
    call = getattr(module, SPLIT_ATTR, None)
    if call is None:
        raise ValueError(f"{type(module).__name__} ran the split attention of windowed KV units without being armed "
                         "by its KVWindows hook")
    for name, item in kwargs.items():
        if isinstance(item, torch.Tensor) and name not in SHARED_TENSOR_KWARGS:
            raise ValueError(f"windowed KV units at generation split the attention call by head, and "
                             f"{type(module).__name__} passes its kernel the tensor {name!r}, which may be per head "
                             f"(not done); allowed tensor arguments: {', '.join(SHARED_TENSOR_KWARGS)}")
    kernel, heads = family_kernel(module, call.kernel), call.heads
    window_keys, window_values, slots, queries = call.layer.take_step()  # (B, W, n, D) x2, (n,), (Q,) or None
    group = getattr(module, "num_key_value_groups", 1)  # query heads per KV head, as the kernel repeats them
    if len(heads.full) != key.shape[1] * group or len(heads.window) != window_keys.shape[1] * group:
        raise ValueError(f"{type(module).__name__}: {len(heads.full)} + {len(heads.window)} query heads for "
                         f"{key.shape[1]} full + {window_keys.shape[1]} windowed KV heads are not groups of "
                         f"num_key_value_groups={group}")
    parts = {}  # half -> (query heads, output (B, Q, h, Dv), weights or None, key slots or None)
    if len(heads.full):
        out, weights = kernel(module, query[:, heads.full_pick], key, value, attention_mask, **kwargs)
        parts["full"] = (heads.full, out, weights, None)
    if len(heads.window):
        mask = window_mask(attention_mask, queries, slots, call.sink, call.window, query.dtype)
        out, weights = kernel(module, query[:, heads.window_pick], window_keys, window_values, mask, **kwargs)
        parts["window"] = (heads.window, out, weights, slots)
    if heads.order is not None:  # two blocks (or one): the outputs concatenate
        outs = [parts[half][1] for half in heads.order if half in parts]
        output = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, Q, H, Dv)
    else:
        first = parts["full"][1]
        output = first.new_empty(*first.shape[:2], query.shape[1], first.shape[-1])  # (B, Q, H, Dv)
        for index, out, _, _ in parts.values():
            output.index_copy_(2, index, out)
    return output, assembled_weights(list(parts.values()), query, call.layer.length)


def assembled_weights(parts, query: torch.Tensor, n_keys: int) -> torch.Tensor | None:
    """The attention weights (B, H, Q, T) of both halves, when the model records attentions."""
    # transformers' private record of what the forward collects, read here only (imported here so
    # that a transformers without it fails only this path, not every import of the package)
    from transformers.utils.output_capturing import _active_collector

    collected = _active_collector.get()
    if collected is None or "attentions" not in collected or any(w is None for _, _, w, _ in parts):
        return None
    b, h, n_q, _ = query.shape
    weights = parts[0][2].new_zeros(b, h, n_q, n_keys)
    for heads, _, part, slots in parts:
        if slots is not None:
            part = part.new_zeros(*part.shape[:3], n_keys).index_copy_(3, slots, part)
        weights.index_copy_(1, heads, part)
    return weights


AttentionInterface.register(SPLIT_KERNEL, split_attention)
