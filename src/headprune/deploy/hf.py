"""Saving and loading pruned models as transformers checkpoints.

`save_pruned` writes a `save_pretrained` folder: a plain transformers checkpoint when every
layer keeps the same query and KV heads of a family whose config carries `head_dim` (Llama,
Mistral, Qwen2), otherwise the original config plus `headprune_layout.json`, from which
`load_pruned` rebuilds the uneven shapes before the weights load.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoConfig

from headprune.atomic import write_json_atomic
from headprune.heads.adapters import get_adapter, head_layout
from headprune.heads.surgery import _integer, apply_layout

log = logging.getLogger(__name__)

LAYOUT_FILE = "headprune_layout.json"


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


def _model_class(config) -> type:
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    raise ValueError(f"config.architectures={config.architectures} names no transformers model class; "
                     "cannot tell which model head to load")
