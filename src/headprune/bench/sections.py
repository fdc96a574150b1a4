"""What a bench section is, the registry of them, and what a run hands each one.

A section (encoder, training step, ONNX Runtime, decoders) is one module that builds a
`Section` and `register`s it. Its name is its key everywhere: the `bench.<name>` config block
(typed by its `settings` dataclass), its rows and its summary block in bench.json, its wandb
table. apps/bench.py runs the enabled sections in registry order; report.py renders each one's
summary lines, table and plot panel. Adding a section is one module, imported in
bench/__init__.py (which fixes the order of bench.json and bench.md), plus its block in
conf/bench.yaml.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List

import torch
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf
from torch import nn

from headprune.bench.origin import load_dense, origin_of
from headprune.bench.variants import KINDS, Variant, build_variants, exported_variants
from headprune.costs.timing import Clock
from headprune.tasks import CAUSAL_LM, task_for


@dataclass(frozen=True)
class Section:
    """One part of the bench: how it runs, checks its settings and renders its rows."""

    name: str
    settings: type  # dataclass: the schema of the `bench.<name>` block
    run: Callable[[SectionInputs], list[dict]]  # the rows of bench.json's `<name>` list
    table: Callable[[list[dict]], list[str]]  # markdown lines of its bench.md table
    summary: Callable[[list[dict], dict], dict]  # (rows, all results) -> its block of the summary
    summary_lines: Callable[[dict], list[str]]  # that block as markdown bullets
    check: Callable[[DictConfig, DictConfig], None] = lambda settings, bench: None  # raise ValueError
    applies: Callable[[SectionInputs], bool] = lambda inputs: True  # beyond `enabled` (ONNX Runtime: CPU only)
    plot: Callable[[Any, list[dict], dict], None] | None = None  # (axes, rows, summary block)
    panel: int | None = None  # its panel of bench.png, left to right

    def enabled(self, inputs: SectionInputs) -> bool:
        return bool(inputs.bench[self.name].enabled) and self.applies(inputs)


SECTIONS: dict[str, Section] = {}


def register(section: Section) -> Section:
    """Add `section` to the registry (once per name); returns it."""
    if SECTIONS.get(section.name, section) is not section:
        raise ValueError(f"bench section {section.name!r} is registered twice")
    SECTIONS[section.name] = section
    return section


@dataclass
class SectionInputs:
    """What every section's run reads: the composed config, where and how to time, and the model
    loaded from `bench.pruned_dir` when one is given."""

    cfg: DictConfig
    device: torch.device
    dtype: torch.dtype
    clock: Clock
    exported: nn.Module | None = None

    @property
    def bench(self) -> DictConfig:
        return self.cfg.bench

    @property
    def rounds(self) -> dict:
        return {"warmup": self.bench.warmup, "repeats": self.bench.repeats, "seed": self.cfg.seed}

    @property
    def exported_is_lm(self) -> bool:
        return self.exported is not None and task_for(self.exported) is CAUSAL_LM  # the loaded export's head

    def exported_variants(self, kinds) -> tuple[str, list[Variant]]:
        """(model name, variants) around the exported model, against the dense model it was pruned
        from (bench/origin.py: bench.dense_model, else the one the export records)."""
        pruned_dir = self.bench.pruned_dir
        origin = origin_of(pruned_dir, self.bench.dense_model)
        dense = load_dense(origin, self.exported, pruned_dir, self.device, self.dtype)
        exported = self.exported.eval().to(self.device, self.dtype)
        return f"exported:{pruned_dir} (dense: {origin})", exported_variants(dense, exported, list(kinds))

    def encoder_variants(self, kinds: dict[str, list[float]], layouts: list[str]) -> tuple[str, list[Variant]]:
        """(model name, variants) of the encoder: the exported model when it is one, else `model`."""
        if self.exported is not None and not self.exported_is_lm:
            return self.exported_variants(kinds)
        dense = instantiate(self.cfg.model)(num_labels=2).eval().to(self.device, self.dtype)
        return _model_name(self.cfg.model), build_variants(dense, kinds, layouts)


def _model_name(model_cfg: DictConfig) -> str:
    if not model_cfg.get("random_init"):
        return model_cfg.pretrained
    overrides = OmegaConf.to_container(model_cfg.get("config_overrides") or {}, resolve=True)
    return f"{model_cfg.pretrained} (random init {overrides})"


def kinds(settings: DictConfig) -> dict[str, list[float]]:
    """kind -> sparsities of a section's `variants`, kinds with no sparsity left out."""
    return {kind: list(s) for kind, s in OmegaConf.to_container(settings.variants, resolve=True).items() if s}


@dataclass
class GridSettings:
    """A section timed over batches x seqs, with the variant kinds it runs (encoder, train_step)."""

    enabled: bool = MISSING
    batches: List[int] = MISSING
    seqs: List[int] = MISSING
    variants: Dict[str, List[float]] = MISSING


def check_grid(name: str, settings: DictConfig) -> None:
    """`bench.<name>.batches` and `.seqs`: non-empty lists of positive integers."""
    for key in ("batches", "seqs"):
        if not settings[key] or min(settings[key]) < 1:
            raise ValueError(f"bench.{name}.{key}={list(settings[key])} is not allowed; "
                             "allowed: a non-empty list of positive integers")


def check_variants(name: str, settings: DictConfig, allowed: tuple = KINDS[1:]) -> None:
    """`bench.<name>.variants`: known kinds, each with sparsities strictly between 0 and 1."""
    for kind, sparsities in settings.variants.items():
        one_of(f"bench.{name}.variants", kind, allowed)
        check_sparsities(f"bench.{name}.variants.{kind}", sparsities)


def check_sparsities(name: str, sparsities) -> None:
    for s in sparsities:
        if not 0 < s < 1:
            raise ValueError(f"{name} contains {s}; allowed: 0 < sparsity < 1")


def one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")
