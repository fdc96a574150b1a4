"""Typed settings of headprune-bench (the `bench:` block of conf/bench.yaml) and their checks.

The schema only declares fields and types: a misspelt key (`bench.repeat=3`) or a wrong type
fails when Hydra composes the config. Each section's block is typed, and checked, by the section
itself (bench/sections.py); here are the fields they share. Values live in conf/bench.yaml;
`check` rejects values outside their allowed set, naming the field. Quick mode: values written `${quick:A,B}` resolve to
B when bench.quick is true (so command-line overrides still win), and the yaml's `quick_model:`
block is merged over `model` (a tiny random-init encoder).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Dict, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from headprune.bench.origin import origin_of
from headprune.bench.sections import SECTIONS, one_of
from headprune.bench.variants import LAYOUTS

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class BenchSettings:
    """The fields every section reads; `schema()` adds one `<name>:` block per section."""

    quick: bool = MISSING
    device: str = MISSING
    threads: int = MISSING
    dtype: str = MISSING
    pruned_dir: Optional[str] = None
    dense_model: Optional[str] = None
    sparsities: List[float] = MISSING
    layouts: List[str] = MISSING
    warmup: int = MISSING
    repeats: int = MISSING


def schema() -> type:
    """BenchSettings, every registered section's settings block in registry order, then the
    decoders' `decoder_configs` table (random-init causal LMs by name)."""
    blocks = [(s.name, s.settings, field(default_factory=s.settings)) for s in SECTIONS.values()]
    blocks.append(("decoder_configs", Dict[str, Any], field(default=MISSING)))
    return make_dataclass("BenchSettings", blocks, bases=(BenchSettings,))


def register_bench_schema() -> None:
    """Store the schema as `schema/bench/settings` and the `quick` resolver (both idempotent)."""
    ConfigStore.instance().store(group="schema/bench", name="settings", node=schema())
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
    one_of("bench.device", bench.device, DEVICES)
    if bench.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench.device='cuda' but no CUDA device is available; allowed here: auto, cpu")
    one_of("bench.dtype", bench.dtype, DTYPES)
    for name, low in (("threads", 1), ("warmup", 0), ("repeats", 1)):
        if bench[name] < low:
            raise ValueError(f"bench.{name}={bench[name]} is not allowed; allowed: an integer >= {low}")
    for s in bench.sparsities:
        if not 0 < s < 1:
            raise ValueError(f"bench.sparsities contains {s}; allowed: values with 0 < sparsity < 1")
    for layout in bench.layouts:
        one_of("bench.layouts", layout, LAYOUTS)
    if bench.pruned_dir:  # its dense origin must be known before any work (bench/origin.py)
        origin_of(bench.pruned_dir, bench.dense_model)
    for section in SECTIONS.values():
        section.check(bench[section.name], bench)
