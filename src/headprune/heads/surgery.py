"""Physical head removal, and saving / loading models whose layers kept different heads.

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

import json
import logging
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from torch import nn
from transformers import AutoConfig
from transformers.pytorch_utils import Conv1D

from headprune.heads.adapters import LAYOUT_ATTR, ArchAdapter, _get, get_adapter, head_layout
from headprune.heads.headless import HeadlessAttention
from headprune.atomic import write_json_atomic

log = logging.getLogger(__name__)

LAYOUT_FILE = "headprune_layout.json"
HeadSpec = Mapping[int, Iterable[int]] | Iterable[tuple[int, int]]


class Sliced(NamedTuple):
    """A parameter `prune_heads` replaced: `new` is `old.index_select(dim, index)`."""

    old: nn.Parameter
    new: nn.Parameter
    dim: int
    index: torch.Tensor


def prune_heads(model: nn.Module, heads: HeadSpec, sliced: list[Sliced] | None = None) -> nn.Module:
    """Remove `heads` from `model` in place and return it.

    `heads` maps layer -> head ids, or is an iterable of (layer, head) pairs (as
    `HeadMask.pruned()` gives), always in the original model's numbering. Heads already
    removed are skipped, so applying the same request twice is harmless. A layer may lose
    every head: its attention then returns only the output projection's bias.

    Every sliced parameter is replaced by a new, smaller one. Pass a list as `sliced` to get a
    `Sliced(old, new, dim, index)` entry per replaced parameter, e.g. to carry optimizer state
    over (`heads.optimizer_state.carry_optimizer_state`).
    """
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    n_heads = adapter.num_heads(model.config)
    request = _validated(heads, len(blocks), n_heads)
    layout = head_layout(model)
    for layer, remove in request.items():
        kept = [h for h in layout[layer] if h not in remove]
        if kept != layout[layer]:
            _prune_layer(model, adapter, layer, kept, sliced)
            layout[layer] = kept
    setattr(model, LAYOUT_ATTR, layout)
    return model


def apply_layout(model: nn.Module, layout: list[list[int]]) -> nn.Module:
    """Prune `model` down to `layout` (original ids of the heads each layer keeps)."""
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
    return prune_heads(model, heads)


def kv_group_heads(model: nn.Module) -> list[list[int]]:
    """Original query head ids sharing each KV head (one group per head without GQA)."""
    adapter = get_adapter(model)
    n_heads, n_kv = adapter.num_heads(model.config), adapter.num_kv_heads(model.config)
    size = n_heads // n_kv
    return [list(range(g * size, (g + 1) * size)) for g in range(n_kv)]


def heads_of_kv_groups(model: nn.Module, groups: Mapping[int, Iterable[int]]) -> dict[int, list[int]]:
    """Expand layer -> KV group ids into layer -> query head ids, for `prune_heads`."""
    table = kv_group_heads(model)
    n_layers = len(get_adapter(model).blocks(model))
    heads = {}
    for layer, ids in groups.items():
        layer = _integer(layer, "layer")
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
        heads[layer] = []
        for g in _ids(ids, f"groups[{layer}]"):
            g = _integer(g, f"KV group (layer {layer})")
            if not 0 <= g < len(table):
                raise ValueError(f"KV group {g} of layer {layer} is out of range: allowed 0..{len(table) - 1}")
            heads[layer] += table[g]
    return heads


def count_params(model: nn.Module) -> dict[str, int]:
    """{"attention": parameters of every Q/K/V/O projection, "total": all parameters}."""
    adapter = get_adapter(model)
    attention = {}
    for block in adapter.blocks(model):
        attn = adapter.attention(block)
        for path in (adapter.q, adapter.k, adapter.v, adapter.o):
            attention.update({id(p): p.numel() for p in _get(attn, path).parameters()})
    return {"attention": sum(attention.values()), "total": sum(p.numel() for p in model.parameters())}


@dataclass(frozen=True)
class Saved:
    """Where `save_pruned` wrote the model and whether plain `from_pretrained` loads it (`plain_hf`)
    or `load_pruned` is needed; `why` says which. Usable as the folder's path."""

    path: Path
    plain_hf: bool
    why: str

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def save_pruned(model: nn.Module, directory: str | Path, tokenizer=None, overwrite: bool = False) -> Saved:
    """`save_pretrained` folder the model loads from, with its tokenizer if given.

    When every layer keeps the same numbers of query heads and KV heads (whole KV groups, none
    left empty) and the family's config carries `head_dim` (Llama, Mistral, Qwen2), the folder is a
    standard checkpoint whose config says those numbers: plain `AutoModel*.from_pretrained` loads
    it with no headprune code (`headprune_export.json` beside it records the original ids of the
    heads kept). Otherwise the folder holds the original config plus `headprune_layout.json`, and
    `load_pruned` rebuilds the uneven shapes. The return value and the log say which.

    A folder that already holds files is refused (old tokenizers or weights would be left beside
    the new model) unless `overwrite=True`, which empties it first."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save_pruned: {directory} exists and is not a folder")
    if directory.is_dir() and any(directory.iterdir()):
        if not overwrite:
            raise FileExistsError(f"save_pruned: {directory} is not empty ({sorted(p.name for p in directory.iterdir())[:5]}"
                                  "...); pass overwrite=True to replace its contents, or choose an empty folder")
        shutil.rmtree(directory)
    adapter, layout = get_adapter(model), head_layout(model)
    counts, why = plain_counts(model)
    if counts is None:
        model.save_pretrained(directory)
        write_json_atomic(directory / LAYOUT_FILE, {"model_type": model.config.model_type,
                                                    "num_heads": adapter.num_heads(model.config), "layout": layout})
    else:
        config, head_dim = model.config, adapter.head_dim(model.config)
        names = (adapter.heads_attr, adapter.kv_heads_attr, "head_dim")
        saved = {k: config.__dict__[k] for k in names if k in config.__dict__}  # absent ones are removed again
        try:
            setattr(config, adapter.heads_attr, counts[0])
            setattr(config, adapter.kv_heads_attr, counts[1])
            config.head_dim = head_dim
            model.save_pretrained(directory)
        finally:
            for k in names:
                if k in saved:
                    setattr(config, k, saved[k])
                elif k in config.__dict__:
                    delattr(config, k)
        write_json_atomic(directory / "headprune_export.json", {
            "plain_hf": True, "model_type": config.model_type, "original": saved,
            "kept_heads": layout})
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    result = Saved(directory, counts is not None, why)
    log.info("save_pruned: %s is %s (%s)", directory,
             "a plain transformers checkpoint" if result.plain_hf else "loadable with headprune.load_pruned", why)
    return result


def plain_counts(model: nn.Module) -> tuple[tuple[int, int] | None, str]:
    """((query heads, KV heads) per layer, why) when the pruned model is a plain model of a config
    with those numbers; (None, why not) otherwise."""
    adapter, layout = get_adapter(model), head_layout(model)
    if not adapter.config_head_dim:
        return None, f"the {adapter.name} family's config has no head_dim of its own"
    group = adapter.group_size(model.config)
    per_layer = set()
    for kept in layout:
        groups = {h // group for h in kept}
        sizes = {sum(1 for h in kept if h // group == g) for g in groups}
        if not kept or len(sizes) != 1:
            return None, "a layer has no heads or a KV group partly kept"
        per_layer.add((len(kept), len(groups)))
    if len(per_layer) != 1:
        return None, f"layers keep different numbers of heads ({sorted(per_layer)})"
    return per_layer.pop(), "the same query and KV heads in every layer"


def load_pruned(directory: str | Path, device: str | torch.device | None = None,
                **from_pretrained_kwargs) -> nn.Module:
    """Load a `save_pruned` folder onto `device`; kwargs (dtype, attn_implementation, device_map
    with `accelerate` installed, ...) go to `from_pretrained`.

    Plain `from_pretrained` fails on uneven heads (size mismatches), so the model class named
    in `config.architectures` is built from the config, pruned to the saved layout, and only
    then given the weights. A folder without a layout file loads as a plain HF model.
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"load_pruned: {directory} holds no model (no config.json)")
    cls = _model_class(AutoConfig.from_pretrained(directory))
    if not (directory / LAYOUT_FILE).is_file():
        try:
            model = cls.from_pretrained(directory, **from_pretrained_kwargs)
        except RuntimeError as err:
            if "ignore_mismatched_sizes" not in str(err) and "size mismatch" not in str(err):
                raise
            raise ValueError(f"load_pruned: {directory} holds weights of a pruned model but no {LAYOUT_FILE} saying "
                             "which heads each layer kept; save it with headprune.save_pruned") from err
        return model.to(device) if device is not None else model
    layout = read_layout(directory)

    class Pruned(cls):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            apply_layout(self, layout)

    Pruned.__name__ = Pruned.__qualname__ = cls.__name__
    model = Pruned.from_pretrained(directory, **from_pretrained_kwargs)
    model.__class__ = cls
    return model.to(device) if device is not None else model


def read_layout(directory: str | Path) -> list[list[int]]:
    """The `layout` of a folder's headprune_layout.json, checked: a list of lists of head ids."""
    path = Path(directory) / LAYOUT_FILE
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON (truncated or edited?): {err}") from None
    if not isinstance(saved, dict) or "layout" not in saved:
        raise ValueError(f"{path} has no 'layout' entry (the original ids of the heads each layer kept)")
    layout = saved["layout"]
    if not isinstance(layout, list) or not all(isinstance(kept, list) for kept in layout):
        raise ValueError(f"{path}: 'layout' must be a list with one list of kept head ids per layer; got {layout!r}")
    return [[_integer(h, f"{LAYOUT_FILE} layer {i} head") for h in kept] for i, kept in enumerate(layout)]


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
        if isinstance(o, Conv1D):  # weight (in, out)
            o.weight.mul_(scale.view(-1, 1))
        else:  # Linear: weight (out, in)
            o.weight.mul_(scale.view(1, -1))
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
        layer, head = _integer(layer, "layer"), _integer(head, f"head (layer {layer})")
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


def _integer(value, what: str) -> int:
    """`value` as an int if it is one (1, 1.0 from JSON, a 0-d integer tensor), else a ValueError."""
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
    features that the adapter's `head_rows` give the kept heads."""
    d = adapter.head_dim(model.config)
    group = adapter.group_size(model.config)
    block = adapter.blocks(model)[layer]
    attn = adapter.attention(block)
    core = _get(attn, adapter.core) if adapter.core else attn
    q, o = _get(attn, adapter.q), _get(attn, adapter.o)
    keep: dict[tuple[int, bool], tuple[nn.Module, bool, set[int]]] = {}
    for head, parts in adapter.head_rows(model, layer).items():  # in the current layout
        for r in parts.values():  # every projection gets an entry, even one that keeps nothing
            kept = keep.setdefault((id(r.module), r.outputs), (r.module, r.outputs, set()))[2]
            if head in after:
                kept.update(r.index)
    with torch.no_grad():
        for module, outputs, index in keep.values():
            _keep(module, torch.tensor(sorted(index), dtype=torch.long), outputs, sliced)

    kv_after = sorted({h // group for h in after})
    counts = [sum(1 for h in after if h // group == g) for g in kv_after]
    per_group = max(counts, default=0)
    sizes = {"heads": len(after), "width": len(after) * d, "groups": per_group}
    for name, quantity in adapter.size_attrs:
        setattr(core, name, sizes[quantity])

    for handle in getattr(core, "_headprune_hooks", []):
        handle.remove()
    core._headprune_hooks = []
    if not after:
        _make_headless(adapter, block, core, d, getattr(core, "layer_idx", layer))
    elif len(after) != len(kv_after) * per_group:
        slots = [i * per_group + t for i, c in enumerate(counts) for t in range(c)]
        core._headprune_hooks = _pad_queries(q, o, slots, len(kv_after) * per_group, d)


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
    setattr(_get(block, parent) if parent else block, name, HeadlessAttention(core, out, head_dim, layer_idx))


def _keep(module: nn.Module, index: torch.Tensor, outputs: bool, sliced: list[Sliced] | None) -> None:
    """Keep only the output (or input) features `index` of a Linear or a Conv1D (weight (in, out))."""
    conv = isinstance(module, Conv1D)
    dim = int(conv) if outputs else int(not conv)
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
    attr = ("nf" if conv else "out_features") if outputs else ("nx" if conv else "in_features")
    setattr(module, attr, len(index))


def _pad_queries(q: nn.Module, o: nn.Module, slots: list[int], n_slots: int, head_dim: int) -> list:
    """Hooks giving the kernel `n_slots` query heads (kept heads at `slots`, zeros elsewhere)
    and handing only the kept heads' contexts to the output projection."""
    index = torch.tensor(slots, dtype=torch.long, device="cpu")  # not meta, even inside from_pretrained

    def spread(module, args, out):
        heads = out.unflatten(-1, (-1, head_dim))  # (B, T, h, D)
        padded = heads.new_zeros(*heads.shape[:-2], n_slots, head_dim)  # (B, T, S, D)
        return padded.index_copy(-2, index.to(out.device), heads).flatten(-2)

    def gather(module, args):
        slots_ctx = args[0].unflatten(-1, (n_slots, head_dim))  # (B, T, S, D)
        return (slots_ctx.index_select(-2, index.to(args[0].device)).flatten(-2), *args[1:])  # (B, T, h*D)

    return [q.register_forward_hook(spread), o.register_forward_pre_hook(gather, prepend=True)]


def _model_class(config) -> type:
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    raise ValueError(f"config.architectures={config.architectures} names no transformers model class; "
                     "cannot tell which model head to load")
