"""Physical head removal: whole heads leave the model (saving / loading pruned layouts: `deploy.hf`).

`prune_heads` slices each layer's Q, K, V output rows and O input columns (with biases) and
updates the attributes the attention forward reads, so the pruned model computes what the
HeadMask'ed model computes, with fewer parameters, fewer FLOPs and a smaller KV cache. Head
ids are always the ORIGINAL model's: the heads each layer still has are recorded on the model
(`model.headprune_layout`), so repeated calls, HeadMask and saving agree. `model.config` keeps
describing the original model.

Grouped-query attention (Llama family): a KV head goes only when every query head sharing it
goes. The attention kernel repeats each KV head `num_key_value_groups` times, so a layer that
keeps different numbers of query heads per KV group gets zero queries padded in by hooks (and
their outputs dropped before the output projection). Pruning whole groups
(`heads_of_kv_groups`) avoids that and shrinks the KV cache.

A layer that loses every head gets a `HeadlessAttention` (headless.py) in place of its
attention core: it returns the output projection's bias, as masking all its heads does.

Parameter shapes change: mid-fit, the optimizer must be given the new parameters (with their
state sliced, `heads.optimizer_state.carry_optimizer_state`), as the Lightning callback does.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from torch import nn

from headprune.heads.adapters import (LAYOUT_ATTR, ArchAdapter, feature_dim, get_adapter, head_layout, layer_heads,
                                      set_num_features)
from headprune.heads.headless import HeadlessAttention
from headprune.heads.stacks import StackedAdapter, to_rows
from headprune.heads.verify import SurgeryProbe, wanted

log = logging.getLogger(__name__)

HeadSpec = Mapping[int, Iterable[int]] | Iterable[tuple[int, int]]


class Sliced(NamedTuple):
    """A parameter `prune_heads` replaced: `new` is `old.index_select(dim, index)`."""

    old: nn.Parameter
    new: nn.Parameter
    dim: int
    index: torch.Tensor


def prune_heads(model: nn.Module, heads: HeadSpec, sliced: list[Sliced] | None = None,
                verify: bool | None = None) -> nn.Module:
    """Remove `heads` from `model` in place and return it.

    `heads` maps layer -> head ids, or is an iterable of (layer, head) pairs (as
    `HeadMask.pruned()` gives), always in the original model's numbering. A model with several
    attention stacks (encoder-decoders, `heads.stacks`) also takes them by name:
    {"encoder": {layer: heads}, "decoder": ..., "cross": ...}; its layer ids are its sites'. Heads already
    removed are skipped, so applying the same request twice is harmless. A layer may lose
    every head: its attention then returns only the output projection's bias.

    Every sliced parameter is replaced by a new, smaller one. Pass a list as `sliced` to get a
    `Sliced(old, new, dim, index)` entry per replaced parameter, e.g. to carry optimizer state
    over (`heads.optimizer_state.carry_optimizer_state`).

    The surgery verifies itself (`heads.verify`): one tiny forward of the pruned model must give
    what the model with the same heads masked gave, else `SurgeryError` names the module and any
    parameter left unsliced. `verify=False` skips it (None: the model's `set_verify` setting, by
    default on).
    """
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    n_heads = adapter.num_heads(model.config)
    request = _validated(to_rows(model, heads), len(blocks), n_heads)
    layout = head_layout(model)
    removing = {layer: remove & set(layout[layer]) for layer, remove in request.items()}
    probe = SurgeryProbe(model, adapter, removing) if any(removing.values()) and wanted(model, verify) else None
    if probe is not None:
        probe.before(model)
    for layer, remove in request.items():
        kept = [h for h in layout[layer] if h not in remove]
        if kept != layout[layer]:
            _prune_layer(model, adapter, layer, kept, sliced)
            layout[layer] = kept
    setattr(model, LAYOUT_ATTR, layout)
    if isinstance(adapter, StackedAdapter):
        adapter.settle(model, sliced)  # what a stack shares across its layers (T5's position bias)
    if probe is not None:
        probe.after(model)
    return model


def apply_layout(model: nn.Module, layout: list[list[int]], verify: bool | None = None) -> nn.Module:
    """Prune `model` down to `layout` (original ids of the heads each layer keeps); `verify` as
    `prune_heads`' (a saved layout loaded onto weights about to be replaced: False)."""
    current = head_layout(model)
    if len(layout) != len(current):
        raise ValueError(f"layout has {len(layout)} layers, the model has {len(current)}")
    heads = {}
    for layer, (now, target) in enumerate(zip(current, layout)):
        missing = sorted(set(target) - set(now))
        if missing:
            raise ValueError(f"layout keeps heads {missing} of layer {layer}, which the model does not have "
                             f"(it has {now})")
        heads[layer] = [h for h in now if h not in set(target)]
    return prune_heads(model, heads, verify=verify)


def kv_group_heads(model: nn.Module) -> list[list[int]]:
    """Original query head ids sharing each KV head, in KV head order (one group per head without
    GQA): the adapter's `kv_groups` over every head."""
    adapter = get_adapter(model)
    return list(adapter.kv_groups(model.config, range(adapter.num_heads(model.config))).values())


def heads_of_kv_groups(model: nn.Module, groups: Mapping[int, Iterable[int]]) -> dict[int, list[int]]:
    """Expand layer -> KV group ids into layer -> query head ids, for `prune_heads` (several attention
    stacks: {stack: {layer: groups}} too, heads.stacks)."""
    table = kv_group_heads(model)
    groups = to_rows(model, groups)
    n_layers = len(get_adapter(model).blocks(model))
    heads = {}
    for layer, ids in groups.items():
        layer = integer_id(layer, "layer")
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
        heads[layer] = []
        for g in _ids(ids, f"groups[{layer}]"):
            g = integer_id(g, f"KV group (layer {layer})")
            if not 0 <= g < len(table):
                raise ValueError(f"KV group {g} of layer {layer} is out of range: allowed 0..{len(table) - 1}")
            heads[layer] += table[g]
    return heads


def count_params(model: nn.Module) -> dict[str, int]:
    """{"attention": parameters of every Q/K/V/O projection (and per-head position projection,
    DeBERTa-v2's), "total": all parameters}."""
    adapter = get_adapter(model)
    attention = {}
    for block in adapter.blocks(model):
        attn = adapter.attention(block)
        projections = [attn.get_submodule(path) for path in (adapter.q, adapter.k, adapter.v, adapter.o)]
        for module in projections + list(adapter.present_position_projections(attn).values()):
            attention.update({id(p): p.numel() for p in module.parameters()})
    return {"attention": sum(attention.values()), "total": sum(p.numel() for p in model.parameters())}


@torch.no_grad()
def scale_heads(model: nn.Module, factors: torch.Tensor) -> nn.Module:
    """Multiply each head's output by `factors[layer, head]` (original numbering, shape
    (layers, heads)) by scaling that head's output-projection input columns in place: the model
    then computes what a HeadMask with those gate values computes, with no hook. Heads already
    removed are ignored."""
    adapter = get_adapter(model)
    layout = head_layout(model)
    if tuple(factors.shape) != (len(layout), adapter.num_heads(model.config)):
        raise ValueError(f"factors of shape {tuple(factors.shape)} do not match the model's (layers, heads) = "
                         f"({len(layout)}, {adapter.num_heads(model.config)})")
    head_dim = adapter.head_dim(model.config)
    for layer, block in enumerate(adapter.blocks(model)):
        if not layout[layer]:
            continue
        o = adapter.out_proj(block)
        scale = factors[layer, layout[layer]].to(o.weight).repeat_interleave(head_dim)  # (h * D,)
        shape = [1, 1]
        shape[feature_dim(o, outputs=False)] = -1  # along the input features, in either weight layout
        o.weight.mul_(scale.view(shape))
    return model


# -- internals --------------------------------------------------------------------------------
def _validated(heads: HeadSpec, n_layers: int, n_heads: int) -> dict[int, set[int]]:
    if isinstance(heads, Mapping):
        pairs = [(layer, h) for layer, ids in heads.items() for h in _ids(ids, f"heads[{layer!r}]")]
    else:
        pairs = []
        for item in heads:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"heads: {item!r} is not a (layer, head) pair; allowed: a mapping layer -> head ids "
                                 "({0: [1, 5]}) or (layer, head) pairs ([(0, 1), (0, 5)])")
            pairs.append(tuple(item))
    request: dict[int, set[int]] = {}
    for layer, head in pairs:
        layer, head = integer_id(layer, "layer"), integer_id(head, f"head (layer {layer})")
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
        if not 0 <= head < n_heads:
            raise ValueError(f"head {head} (layer {layer}) is out of range: allowed head ids 0..{n_heads - 1}")
        request.setdefault(layer, set()).add(head)
    return request


def _ids(ids, what: str) -> list:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{what}={ids!r} is not a list of head ids")
    return list(ids)


def integer_id(value, what: str) -> int:
    """A layer, head or KV group id `value` as an int if it is one (1, 1.0 from JSON, a 0-d integer
    tensor), else a ValueError naming `what` (e.g. "head (layer 3)"): every id read from a request
    or a saved layout goes through it."""
    if isinstance(value, bool):
        raise ValueError(f"{what} id {value!r} is not an integer")
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) and not (hasattr(value, "__index__") and not isinstance(value, float)):
        raise ValueError(f"{what} id {value!r} is not an integer")
    return int(value)


def _prune_layer(model: nn.Module, adapter: ArchAdapter, layer: int, after: list[int],
                 sliced: list[Sliced] | None = None) -> None:
    """Slice one layer down to heads `after` (sorted original ids): every projection keeps the
    features that the adapter's `head_rows` give the kept heads (but Q and K under
    whole-projection norms, which keep every row: `ArchAdapter.projection_norms`)."""
    d = adapter.head_dim(model.config)
    block = adapter.blocks(model)[layer]
    attn = adapter.attention(block)
    core = attn.get_submodule(adapter.core) if adapter.core else attn
    q, o = attn.get_submodule(adapter.q), attn.get_submodule(adapter.o)
    whole = {id(attn.get_submodule(adapter.q)), id(attn.get_submodule(adapter.k))} if adapter.projection_norms else set()
    keep: dict[tuple[int, bool], tuple[nn.Module, bool, set[int]]] = {}
    for head, parts in adapter.head_rows(model, layer).items():  # in the current layout
        for r in parts.values():  # every projection gets an entry, even one that keeps nothing
            if r.outputs and id(r.module) in whole:
                continue
            kept = keep.setdefault((id(r.module), r.outputs), (r.module, r.outputs, set()))[2]
            if head in after:
                kept.update(r.index)
    with torch.no_grad():
        for module, outputs, index in keep.values():
            _keep(module, torch.tensor(sorted(index), dtype=torch.long), outputs, sliced)
        if adapter.head_params:
            _keep_head_params(model, adapter, core, layer_heads(model, layer), after, sliced)
        if adapter.head_norms:
            _keep_head_norms(model, adapter, core, layer_heads(model, layer), after, sliced)
        if adapter.head_vectors:
            _keep_head_vectors(adapter, core, layer_heads(model, layer), after, d, sliced)
        if adapter.head_columns and after:  # a layer left without heads keeps its tables (BEiT's block reads them)
            _keep_head_columns(adapter, block, layer_heads(model, layer), after, sliced)

    groups = adapter.kv_groups(model.config, after)
    kv_after, per_group = list(groups), max((len(heads) for heads in groups.values()), default=0)
    at, slots = adapter.query_slots(model.config, after)  # slots: query heads the kernel computes
    sizes = {"heads": slots, "width": slots * d, "groups": per_group, "kv_heads": len(kv_after)}
    for name, quantity in adapter.size_attrs:
        setattr(core, name, sizes[quantity])
    if adapter.config_attrs:
        base = core.config.base if isinstance(core.config, LayerConfig) else core.config
        core.config = LayerConfig(base, {name: sizes[quantity] for name, quantity in adapter.config_attrs})

    for handle in getattr(core, "_headprune_hooks", []):
        handle.remove()
    core._headprune_hooks = []
    queries = q  # the module whose output holds the kept heads' queries (first, side by side)
    if adapter.projection_norms and after:
        q_norm, k_norm = (attn.get_submodule(path) for path in adapter.projection_norms)
        q_rows = [h * d + j for h in after for j in range(d)]
        k_rows = [g * d + j for g in kv_after for j in range(d)]
        core._headprune_hooks += [_select_features(q_norm, q_rows), _select_features(k_norm, k_rows)]
        queries = q_norm
    if not after:
        if isinstance(adapter, StackedAdapter):
            adapter.make_headless(model, layer, core, d)
        else:
            _make_headless(adapter, block, core, d, getattr(core, "layer_idx", layer))
    elif len(after) != slots:
        gates = [attn.get_submodule(g) for g in adapter.gates]
        width = adapter.query_width(model.config) if queries is q else d  # a gated q_proj: [q_h | gate_h]
        core._headprune_hooks += _pad_queries([(queries, width), *((g, d) for g in gates)], o, at, slots, d)


def _slot_index(model: nn.Module, adapter: ArchAdapter, before: list[int], after: list[int]) -> torch.Tensor:
    """(query slots of `after`,) the position, among the query slots of `before`, of the head each slot
    reads its per-head entries from: a kept head's own, and for a padded slot the first kept head of
    its group."""
    held, _ = adapter.query_slots(model.config, before)  # where each head of `before` sits now
    at, n_slots = adapter.query_slots(model.config, after)
    groups = adapter.kv_groups(model.config, after)
    per_group = n_slots // max(len(groups), 1)
    source = [members[0] for members in groups.values() for _ in range(per_group)]  # padded slots
    for pos, head in enumerate(after):
        source[at[pos]] = head
    return torch.tensor([held[before.index(head)] for head in source], dtype=torch.long)


def _keep_rows(owner: nn.Module, name: str, index: torch.Tensor, sliced: list[Sliced] | None) -> None:
    """Replace parameter `owner.<name>` by its rows `index` (dim 0)."""
    old = getattr(owner, name)
    new = nn.Parameter(old.detach().index_select(0, index.to(old.device)), requires_grad=old.requires_grad)
    setattr(owner, name, new)
    if sliced is not None:
        sliced.append(Sliced(old, new, 0, index))


def _keep_head_params(model: nn.Module, adapter: ArchAdapter, core: nn.Module, before: list[int], after: list[int],
                      sliced: list[Sliced] | None) -> None:
    """Keep the entries of the core's per-head parameters (`ArchAdapter.head_params`) that the query
    slots of `after` read (`_slot_index`)."""
    index = _slot_index(model, adapter, before, after)
    for name in adapter.head_params:
        if getattr(core, name, None) is None:  # a layer without it (MiMo-V2-Flash's sinks: some layers only)
            continue
        _keep_rows(core, name, index, sliced)


def _keep_head_norms(model: nn.Module, adapter: ArchAdapter, core: nn.Module, before: list[int], after: list[int],
                     sliced: list[Sliced] | None) -> None:
    """Keep the rows of per-head norm weights and biases (`ArchAdapter.head_norms`, Cohere's (heads,
    head_dim) q_norm / k_norm) that the query slots of `after` ("q") or its kept KV heads ("k") read; a
    norm shared by every head (a vector over head_dim) is left alone."""
    kv_before = list(adapter.kv_groups(model.config, before))
    index = {"q": _slot_index(model, adapter, before, after),
             "k": torch.tensor([kv_before.index(g) for g in adapter.kv_groups(model.config, after)], dtype=torch.long)}
    for path, part in adapter.head_norms:
        try:
            norm = core.get_submodule(path)
        except AttributeError:  # a layer or a config without it (Cohere without use_qk_norm)
            continue
        for name in ("weight", "bias"):
            param = getattr(norm, name, None)
            if isinstance(param, nn.Parameter) and param.dim() >= 2:  # (heads, head_dim): a row per head
                _keep_rows(norm, name, index[part], sliced)


def _keep_head_vectors(adapter: ArchAdapter, core: nn.Module, before: list[int], after: list[int], d: int,
                       sliced: list[Sliced] | None) -> None:
    """Keep the kept heads' head_dim entries of the core's per-head vectors (`ArchAdapter.head_vectors`,
    DeBERTa's q_bias / v_bias), which hold the heads of `before` side by side."""
    index = torch.tensor([before.index(h) * d + j for h in after for j in range(d)], dtype=torch.long)
    for name in adapter.head_vectors:
        old = getattr(core, name)
        kept = old.detach().index_select(0, index.to(old.device))
        new = nn.Parameter(kept, requires_grad=old.requires_grad and kept.numel() > 0)
        setattr(core, name, new)
        if sliced is not None:
            sliced.append(Sliced(old, new, 0, index))


def _keep_head_columns(adapter: ArchAdapter, block: nn.Module, before: list[int], after: list[int],
                       sliced: list[Sliced] | None) -> None:
    """Keep the kept heads' columns of the block's per-head bias tables (`ArchAdapter.head_columns`: UMT5's
    relative_attention_bias Embedding, BEiT's relative_position_bias_table), whose columns are the heads
    of `before`."""
    index = torch.tensor([before.index(h) for h in after], dtype=torch.long)
    for path in adapter.head_columns:
        parent_path, _, name = path.rpartition(".")
        try:
            parent = block.get_submodule(parent_path) if parent_path else block
        except AttributeError:
            continue
        found = getattr(parent, name, None)
        if found is None:  # a block without it (cross-attention, BEiT without relative position bias)
            continue
        owner, attr = (found, "weight") if isinstance(found, nn.Module) else (parent, name)
        old = getattr(owner, attr)
        new = nn.Parameter(old.detach().index_select(1, index.to(old.device)), requires_grad=old.requires_grad)
        setattr(owner, attr, new)
        if hasattr(owner, "embedding_dim"):
            owner.embedding_dim = len(after)
        if sliced is not None:
            sliced.append(Sliced(old, new, 1, index))


class LayerConfig:
    """One layer's view of the model's config: the head counts in `overrides` (the layer's own,
    after pruning) are answered here, every other attribute is the model's config's (read live,
    so e.g. a later `set_attn_implementation` reaches the layer). For attention forwards that read
    head counts from `self.config` (`ArchAdapter.config_attrs`)."""

    def __init__(self, base, overrides: dict):
        self.__dict__.update(base=base, overrides=dict(overrides))

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("base", "overrides"):
            raise AttributeError(name)
        if name in self.overrides:
            return self.overrides[name]
        return getattr(self.base, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self.overrides:
            self.overrides[name] = value
        else:
            setattr(self.base, name, value)

    def __repr__(self) -> str:
        return f"LayerConfig({self.overrides}, base={type(self.base).__name__})"


def _select_features(norm: nn.Module, rows: list[int]):
    """A hook keeping only output features `rows` of a whole-projection norm (OLMo 2's q_norm /
    k_norm): the norm's statistic has read every head, attention gets the kept heads."""
    index = torch.tensor(rows, dtype=torch.long, device="cpu")  # not meta, even inside from_pretrained

    def select(module, args, out):
        return out.index_select(-1, index.to(out.device))

    return norm.register_forward_hook(select)


def _make_headless(adapter: ArchAdapter, block: nn.Module, core: nn.Module, head_dim: int, layer_idx: int) -> None:
    """Put a HeadlessAttention where `core` was in `block`."""
    if not adapter.core:
        out = adapter.o
    elif adapter.o.startswith(adapter.core + "."):
        out = adapter.o[len(adapter.core) + 1:]
    else:
        out = None  # the output projection sits outside the core (BERT)
    path = adapter.attn_path + (f".{adapter.core}" if adapter.core else "")
    parent, _, name = path.rpartition(".")
    setattr(block.get_submodule(parent) if parent else block, name, HeadlessAttention(core, out, head_dim, layer_idx))


def _keep(module: nn.Module, index: torch.Tensor, outputs: bool, sliced: list[Sliced] | None) -> None:
    """Keep only the output (or input) features `index` of a projection (the adapter's weight layout)."""
    dim = feature_dim(module, outputs)
    index = index.to(module.weight.device)
    for name, param_dim in (("weight", dim), ("bias", 0)):
        old = getattr(module, name, None)
        if old is None or (name == "bias" and not outputs):
            continue
        # nothing to train in an empty slice (a layer with no heads); DDP must not wait for its gradient
        kept = old.detach().index_select(param_dim, index)
        new = nn.Parameter(kept, requires_grad=old.requires_grad and kept.numel() > 0)
        setattr(module, name, new)
        if sliced is not None:
            sliced.append(Sliced(old, new, param_dim, index))
    set_num_features(module, outputs, len(index))


def _pad_queries(queries: list[tuple[nn.Module, int]], o: nn.Module, slots: list[int], n_slots: int,
                 head_dim: int) -> list:
    """Hooks giving the kernel `n_slots` query heads (kept heads at `slots`, zeros elsewhere)
    and handing only the kept heads' contexts to the output projection. Each (module, features per
    head) of `queries` (the query projection, output gates) returns the kept heads' features first;
    whatever follows them (a fused projection's K and V) passes unchanged."""
    index = torch.tensor(slots, dtype=torch.long, device="cpu")  # not meta, even inside from_pretrained

    def spreader(per_head: int):
        width = len(slots) * per_head

        def spread(module, args, out):
            heads = out[..., :width].unflatten(-1, (-1, per_head))  # (B, T, h, W)
            padded = heads.new_zeros(*heads.shape[:-2], n_slots, per_head)  # (B, T, S, W)
            padded = padded.index_copy(-2, index.to(out.device), heads).flatten(-2)  # (B, T, S*W)
            return padded if out.shape[-1] == width else torch.cat([padded, out[..., width:]], dim=-1)

        return spread

    def gather(module, args):
        slots_ctx = args[0].unflatten(-1, (n_slots, head_dim))  # (B, T, S, D)
        return (slots_ctx.index_select(-2, index.to(args[0].device)).flatten(-2), *args[1:])  # (B, T, h*D)

    return [*(q.register_forward_hook(spreader(per_head)) for q, per_head in queries),
            o.register_forward_pre_hook(gather, prepend=True)]
