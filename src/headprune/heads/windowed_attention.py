"""The attention call of a layer with windowed KV units: with a cache (generation), and without
one (scoring, training, evaluation), where the windowed heads attend chunk by chunk.

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
run even when the forward raises) puts the model's config back.

Without a cache (`BandCall`) the same split runs over the layer's own keys: the full units'
heads under the model's mask (sdpa's causal path when it has none), the windowed units' heads
in chunks of max(window, `MIN_CHUNK`) queries, each chunk over only the key slots its queries
may see (the sinks and the band from window - 1 before its first query to its last), so a
windowed head costs about T x (sink + window + chunk) scores instead of T x T and no (B, H, T, T)
mask is built. Why: at 4096 tokens with a 64 + 448 window the per-head-masked kernel spent most
of a SmolLM2 forward on scores a window throws away. A module class not yet seen to look its
kernel up also gets the per-head mask in its `attention_mask` (what the kernel reads if the call
never comes here), and one seen not to keeps it (`ROUTES`). Prefill with a cache (more queries
than a chunk) is chunked the same way. When the model records attention weights nothing is
chunked (the weights are the whole (Q, K) map).

A key at slot k is visible to a windowed head's query at slot q iff k <= q and (k < sink or
k > q - window) (`heads.windows.window_allowed`); the model's own mask (padding, causality) is
read at the held slots, so a padded row keeps what the masked full-sequence forward gives it.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

SPLIT_KERNEL = "headprune_windowed_split"  # the AttentionInterface name an armed module's forward looks up
SPLIT_ATTR = "headprune_split"  # the SplitCall an armed attention module carries for one forward
VIEW_ATTR = "headprune_kernel_config"  # the module's KernelConfig, kept between forwards
SHARED_TENSOR_KWARGS = ("position_ids", "cache_position")  # tensors a kernel may get that are not per head
MIN_CHUNK = 128  # queries per chunk of windowed heads, at least (the window, when larger)
ROUTES: dict[type, bool] = {}  # attention module class -> whether its forward looked its kernel up (BandCall)
EMPTY_SLOT = 2 ** 62  # the slot of an unused entry of a fixed-size window buffer (deploy/onnx_ring.py): no query sees it
MASK_ONLY_ATTR = "headprune_mask_only"  # on a model inside per_head_masks(model): how many such contexts are open


def pick(indices: torch.Tensor) -> slice | torch.Tensor:
    """What `t[:, pick]` selects `indices` (ascending) of dim 1 with: a slice (a view, no copy)
    when they are contiguous, else the indices."""
    if len(indices) and int(indices[-1]) - int(indices[0]) + 1 == len(indices):
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return indices


def pick_listed(indices: list[int], device) -> slice | torch.Tensor:
    """`pick` of indices given as Python ints (no step reads a tensor's values), on `device`."""
    if indices and indices[-1] - indices[0] + 1 == len(indices):
        return slice(indices[0], indices[-1] + 1)
    return torch.tensor(indices, dtype=torch.long, device=device)


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
    def of(cls, windowed: list[bool], device) -> "HeadSplit":
        """From per head, whether it belongs to a windowed unit (Python bools, so that no step
        depends on a tensor's values: torch.export traces it)."""
        full = [h for h, w in enumerate(windowed) if not w]
        window = [h for h, w in enumerate(windowed) if w]
        picks = pick_listed(full, device), pick_listed(window, device)
        order = None
        if all(isinstance(p, slice) or not i for p, i in zip(picks, (full, window))):  # two adjacent blocks
            order = ("window", "full") if full and window and window[0] < full[0] else ("full", "window")
        return cls(torch.tensor(full, dtype=torch.long, device=device),
                   torch.tensor(window, dtype=torch.long, device=device), *picks, order)


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

    def begin(self) -> None:
        self.layer.armed = True

    def end(self, module: nn.Module, output) -> None:
        """After the forward: refused when it never called the split kernel (module docstring)."""
        unused = self.layer.armed or self.layer.step is not None
        self.layer.armed, self.layer.step = False, None
        if unused and output is not None:
            raise ValueError(f"{type(module).__name__} ran its attention without the split call of windowed KV units "
                             "(it does not look its kernel up in transformers' AttentionInterface by "
                             "config._attn_implementation), so its kernel saw only the full units' keys; windowed units "
                             "at generation are not supported for this family (forwards without a cache are)")


@dataclass
class BandCall:
    """One forward without a cache: the layer's query heads (`heads`) and KV heads (`kv`) split
    into full and windowed units' halves, the model's own `mask` (None, or (B, 1, Q, K)) and the
    per-head mask the module was also handed (`per_head`, None when its class is known to look
    its kernel up); `used`: the split kernel ran."""

    heads: HeadSplit
    kv: HeadSplit
    sink: int
    window: int
    kernel: str
    mask: torch.Tensor | None
    per_head: torch.Tensor | None
    used: bool = False

    def begin(self) -> None:
        self.used = False

    def end(self, module: nn.Module, output) -> None:
        """After the forward: record whether the module's class looks its kernel up; one that did
        not computed with the per-head mask it was handed, which is correct."""
        if output is not None:
            ROUTES[type(module)] = self.used


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
    call.begin()
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
    call.end(module, output)


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
                window: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor | None:
    """The windowed heads' mask over their held slots: (B or 1, 1, Q, n), boolean where the
    model's mask is boolean, else additive; the model's mask (B, 1, Q, K) read at `slots` (its
    column 0 is slot `offset`: a sliding cache layer's first held token). In a layer with its own
    sliding window that mask bars what that window bars, so the two windows intersect.
    `queries` None: one query that may see every held slot (the cache layer's steady state),
    so only the model's mask applies (None if it has none). A slot `EMPTY_SLOT` (an unused entry
    of a fixed-size buffer) is after every query, so no query sees it."""
    columns = (slots - offset).clamp(min=0) if offset else slots  # below offset: out of the layer's own window
    if queries is None:
        return None if mask is None else mask.index_select(-1, columns)
    q, k = queries[:, None], slots[None, :]  # (Q, 1), (1, n)
    allowed = (k <= q) & ((k < sink) | (k > q - window))  # (Q, n)
    if mask is None:  # sdpa's causal shortcut: the window mask carries causality
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[None, None]
    held = mask.index_select(-1, torch.where(slots < EMPTY_SLOT, columns, 0))  # (B, 1, Q, n); unused: barred below
    if held.dtype == torch.bool:
        return held & allowed
    return held.masked_fill(~allowed, torch.finfo(held.dtype).min)


def per_head_mask(mask: torch.Tensor | None, windowed: torch.Tensor, n_q: int, sink: int, window: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The model's mask (None: causal; or (B, 1, Q, K) additive or boolean) widened to every query
    head, (B or 1, H, Q, K), the heads of windowed units (`windowed`, (H,) bool) also barred from
    keys outside their sinks and window: what one kernel call over all heads needs. Queries are
    the last `n_q` key slots."""
    device = windowed.device
    n_k = mask.shape[-1] if mask is not None else n_q
    queries = torch.arange(n_k - n_q, n_k, device=device)[:, None]  # (Q, 1)
    keys = torch.arange(n_k, device=device)[None, :]  # (1, K)
    allowed = (keys <= queries) & ((keys < sink) | (keys > queries - window))  # (Q, K)
    allowed = allowed[None] | ~windowed[:, None, None]  # (H, Q, K): full heads unrestricted here
    if mask is None:  # sdpa's causal shortcut: causality is ours to add
        allowed = allowed & (keys <= queries)[None]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None]
    if mask.dtype == torch.bool:
        return mask & allowed[None]  # (B, H, Q, K)
    return mask.masked_fill(~allowed[None], torch.finfo(mask.dtype).min)  # (B, H, Q, K)


@contextmanager
def per_head_masks(model: nn.Module):
    """Within it, `model`'s windowed layers attend under one per-head mask over all their heads (the
    model's own kernel, `per_head_mask`) instead of the banded chunks (`BandCall`), whose loop over
    the sequence torch.export cannot trace with a dynamic length: for exporting the forward graph.
    A count on the model (`MASK_ONLY_ATTR`), so other models and nested uses are unaffected."""
    setattr(model, MASK_ONLY_ATTR, mask_only(model) + 1)
    try:
        yield
    finally:
        depth = mask_only(model) - 1
        if depth:
            setattr(model, MASK_ONLY_ATTR, depth)
        else:
            delattr(model, MASK_ONLY_ATTR)


def mask_only(model: nn.Module) -> int:
    """How many `per_head_masks(model)` contexts are open (0: the banded chunks where they route)."""
    return model.__dict__.get(MASK_ONLY_ATTR, 0)


def recording_attentions() -> bool:
    """Whether the running forward collects attention weights (output_attentions)."""
    from transformers.utils.output_capturing import _active_collector  # private; read here only

    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def windowed_chunks(kernel, module: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | None, queries: torch.Tensor, slots: torch.Tensor, sink: int, window: int,
                    offset: int = 0, **kwargs) -> torch.Tensor:
    """The windowed heads' output (B, Q, Hw, Dv), chunk by chunk of max(window, MIN_CHUNK)
    queries: query (B, Hw, Q, D) at slots `queries` (ascending), keys / values (B, W, n, D) at
    `slots` (ascending), the model's mask (B, 1, Q, T) or None; each chunk's kernel call reads
    the key slots below `sink` and those from window - 1 before its first query to its last."""
    chunk = max(window, MIN_CHUNK)
    outs = []
    for start in range(0, query.shape[2], chunk):
        end = min(start + chunk, query.shape[2])
        first, last = int(queries[start]), int(queries[end - 1])
        seen = ((slots < sink) | ((slots > first - window) & (slots <= last))).nonzero().flatten()  # (n',)
        take = pick(seen)
        rows = mask[..., start:end, :] if mask is not None and mask.shape[-2] > 1 else mask
        part = window_mask(rows, queries[start:end], slots[seen], sink, window, query.dtype, offset)
        out, _ = kernel(module, query[:, :, start:end], keys[:, :, take], values[:, :, take], part, **kwargs)
        outs.append(out)  # (B, q, Hw, Dv)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def joined(heads: HeadSplit, parts: dict, n_heads: int) -> torch.Tensor:
    """The halves' outputs (B, Q, h, Dv) back in head order, (B, Q, H, Dv)."""
    if heads.order is not None:  # two blocks (or one): the outputs concatenate
        outs = [parts[half][1] for half in heads.order if half in parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    first = parts["full"][1]
    output = first.new_empty(*first.shape[:2], n_heads, first.shape[-1])  # (B, Q, H, Dv)
    for index, out, *_ in parts.values():
        output.index_copy_(2, index, out)
    return output


def band_attention(module: nn.Module, call: BandCall, kernel, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, **kwargs):
    """A forward without a cache (module docstring): query (B, H, Q, D), key / value (B, KV, T, D)
    every KV head the layer computes. Returns ((B, Q, H, Dv), weights or None)."""
    heads, kv = call.heads, call.kv
    if recording_attentions():  # the whole (Q, K) map is asked for: one call under the per-head mask
        mask = call.per_head if call.per_head is not None else per_head_mask(
            call.mask, heads_flags(heads, query.shape[1], query.device), query.shape[2], call.sink, call.window,
            query.dtype)
        return kernel(module, query, key, value, mask, **kwargs)
    parts = {}
    if len(heads.full):
        out, _ = kernel(module, query[:, heads.full_pick], key[:, kv.full_pick], value[:, kv.full_pick], call.mask,
                        **kwargs)
        parts["full"] = (heads.full, out)
    if len(heads.window):
        n_q, n_k = query.shape[2], key.shape[2]
        slots = torch.arange(n_k, device=query.device)
        out = windowed_chunks(kernel, module, query[:, heads.window_pick], key[:, kv.window_pick],
                              value[:, kv.window_pick], call.mask, slots[n_k - n_q:], slots, call.sink, call.window,
                              **kwargs)
        parts["window"] = (heads.window, out)
    return joined(heads, parts, query.shape[1]), None


def heads_flags(heads: HeadSplit, n_heads: int, device) -> torch.Tensor:
    """(H,) bool: which query heads are windowed units'."""
    flags = torch.zeros(n_heads, dtype=torch.bool, device=device)
    flags[heads.window] = True
    return flags


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
    if isinstance(call, BandCall):
        call.used = True
        group = getattr(module, "num_key_value_groups", 1)
        if len(heads.full) != len(call.kv.full) * group or len(heads.window) != len(call.kv.window) * group:
            raise ValueError(f"{type(module).__name__}: {len(heads.full)} + {len(heads.window)} query heads for "
                             f"{len(call.kv.full)} full + {len(call.kv.window)} windowed KV heads are not groups of "
                             f"num_key_value_groups={group}")
        return band_attention(module, call, kernel, query, key, value, **kwargs)
    window_keys, window_values, slots, queries = call.layer.take_step()  # (B, W, n, D) x2, (n,), (Q,) or None
    offset = getattr(call.layer, "mask_offset", 0)  # the slot of the model's mask's first column (sliding layers)
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
        if (call.layer.chunked and queries is not None and query.shape[2] > max(call.window, MIN_CHUNK)
                and not recording_attentions()):
            out, weights = windowed_chunks(kernel, module, query[:, heads.window_pick], window_keys, window_values,
                                           attention_mask, queries, slots, call.sink, call.window, offset,
                                           **kwargs), None
        else:
            mask = window_mask(attention_mask, queries, slots, call.sink, call.window, query.dtype, offset=offset)
            out, weights = kernel(module, query[:, heads.window_pick], window_keys, window_values, mask, **kwargs)
        parts["window"] = (heads.window, out, weights, slots)
    output = joined(heads, parts, query.shape[1])  # (B, Q, H, Dv)
    return output, assembled_weights(list(parts.values()), query, call.layer.length - offset, offset)


def assembled_weights(parts, query: torch.Tensor, n_keys: int, offset: int = 0) -> torch.Tensor | None:
    """The attention weights (B, H, Q, K) of both halves, when the model records attentions: over
    the key slots offset .. offset + K - 1 (a sliding layer's held tokens; offset 0 otherwise)."""
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
            seen = slots >= offset  # older slots: outside the layer's own window, weight zero
            part = part.new_zeros(*part.shape[:3], n_keys).index_copy_(3, slots[seen] - offset, part[..., seen])
        weights.index_copy_(1, heads, part)
    return weights


AttentionInterface.register(SPLIT_KERNEL, split_attention)
