"""Typed settings of headprune-bench (the `bench:` block of conf/bench.yaml) and their checks.

The schema only declares fields and types: a misspelt key (`bench.repeat=3`) or a wrong type
fails when Hydra composes the config. Values live in conf/bench.yaml; `check` rejects values
outside their allowed set, naming the field. Quick mode: values written `${quick:A,B}` resolve to
B when bench.quick is true (so command-line overrides still win), and the yaml's `quick_model:`
block is merged over `model` (a tiny random-init encoder).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from headprune.bench.variants import KINDS, LAYOUTS

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
ATTN = ("eager", "sdpa")


@dataclass
class GridSettings:
    """A section timed over batches x seqs, with the variant kinds it runs (encoder, train_step)."""

    enabled: bool = MISSING
    batches: List[int] = MISSING
    seqs: List[int] = MISSING
    variants: Dict[str, List[float]] = MISSING


@dataclass
class RuntimeSettings:
    enabled: bool = MISSING
    batches: List[int] = MISSING
    seqs: List[int] = MISSING
    sparsities: List[float] = MISSING


@dataclass
class DecoderSettings:
    enabled: bool = MISSING
    models: List[str] = MISSING
    batch: int = MISSING
    prompt_len: int = MISSING
    new_tokens: int = MISSING
    attn_implementation: str = MISSING
    variants: Dict[str, List[float]] = MISSING


@dataclass
class BenchSettings:
    quick: bool = MISSING
    device: str = MISSING
    threads: int = MISSING
    dtype: str = MISSING
    pruned_dir: Optional[str] = None
    sparsities: List[float] = MISSING
    layouts: List[str] = MISSING
    warmup: int = MISSING
    repeats: int = MISSING
    encoder: GridSettings = field(default_factory=GridSettings)
    train_step: GridSettings = field(default_factory=GridSettings)
    onnxruntime: RuntimeSettings = field(default_factory=RuntimeSettings)
    decoder: DecoderSettings = field(default_factory=DecoderSettings)
    decoder_configs: Dict[str, Any] = MISSING


def register_bench_schema() -> None:
    """Store the schema as `schema/bench/settings` and the `quick` resolver (both idempotent)."""
    ConfigStore.instance().store(group="schema/bench", name="settings", node=BenchSettings)
    OmegaConf.register_new_resolver("quick", _quick, replace=True)


def _quick(normal: Any, quick: Any, *, _root_: DictConfig) -> Any:
    return quick if _root_.bench.quick else normal


def apply_quick(cfg: DictConfig) -> DictConfig:
    """`cfg` with its `quick_model:` block merged over `model` when bench.quick is true."""
    if not cfg.bench.quick:
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):  # the block may add keys to free-form ones (model.config_overrides)
        cfg.model = OmegaConf.merge(cfg.model, cfg.get("quick_model") or {})
    return cfg


def check(bench: DictConfig) -> None:
    """Raise ValueError naming the first field whose value is not allowed."""
    _one_of("bench.device", bench.device, DEVICES)
    if bench.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench.device='cuda' but no CUDA device is available; allowed here: auto, cpu")
    _one_of("bench.dtype", bench.dtype, DTYPES)
    _one_of("bench.decoder.attn_implementation", bench.decoder.attn_implementation, ATTN)
    for name, low in (("threads", 1), ("warmup", 0), ("repeats", 1)):
        if bench[name] < low:
            raise ValueError(f"bench.{name}={bench[name]} is not allowed; allowed: an integer >= {low}")
    for s in bench.sparsities:
        if not 0 < s < 1:
            raise ValueError(f"bench.sparsities contains {s}; allowed: values with 0 < sparsity < 1")
    for layout in bench.layouts:
        _one_of("bench.layouts", layout, LAYOUTS)
    for section in ("encoder", "train_step", "decoder"):
        for kind, sparsities in bench[section].variants.items():
            _one_of(f"bench.{section}.variants", kind, KINDS[1:])
            for s in sparsities:
                if not 0 < s < 1:
                    raise ValueError(f"bench.{section}.variants.{kind} contains {s}; allowed: 0 < sparsity < 1")
    for section in ("encoder", "train_step", "onnxruntime"):
        for name in ("batches", "seqs"):
            if not bench[section][name] or min(bench[section][name]) < 1:
                raise ValueError(f"bench.{section}.{name}={list(bench[section][name])} is not allowed; "
                                 "allowed: a non-empty list of positive integers")
    for s in bench.onnxruntime.sparsities:
        if not 0 < s < 1:
            raise ValueError(f"bench.onnxruntime.sparsities contains {s}; allowed: 0 < sparsity < 1")
    unknown = set(bench.train_step.variants) - {"masked", "pruned"}
    if unknown:
        raise ValueError(f"bench.train_step.variants: {sorted(unknown)} are not allowed; allowed: masked, pruned")
    for name in ("batch", "prompt_len", "new_tokens"):
        if bench.decoder[name] < 1:
            raise ValueError(f"bench.decoder.{name}={bench.decoder[name]} is not allowed; allowed: an integer >= 1")
    for model in bench.decoder.models:
        _one_of("bench.decoder.models", model, tuple(bench.decoder_configs))


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")
