"""A run as typed settings: `RunSpec` and its parts, built once from the composed Hydra config at
the app's entry (`RunSpec.from_config`) or written in Python, and checked when built: a bad value
is refused there, naming the field and what is allowed, before any data or model loads
(`preflight.check_settings`). Nothing below the entry reads the Hydra config: the science objects
(metric, schedule, layer policy, recovery, budget, KV modes) are built here, and what a run builds
only when it needs it (model, data module, Trainer, loggers, callbacks) is a factory here.

`config` is the record of what was asked (results.json `config`, a checkpoint's settings, the
loggers' hyperparameters): the resolved composed config of a Hydra run, or the typed settings of a
spec written in Python (`RunSpec.record`).
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from headprune.evaluation.llm_suite import EvaluationSettings
from headprune.models.build import build_model
from headprune.recovery.finetune import Finetune
from headprune.runs.components import Factory, GroupFactory, build
from headprune.runs.preflight import check_settings
from headprune.scoring.diagnostics import check_options
from headprune.selection.budgets import Budget
from headprune.selection.kv_modes import KVModes
from headprune.selection.layer_policies import GlobalPolicy
from headprune.tasks import Task, get_task


@dataclass(frozen=True)
class OutputSpec:
    """Where the run writes (`paths.output_dir`) and what it does with what is there."""

    output_dir: Path
    ckpt_path: Optional[str] = None  # resume from this checkpoint (the run's checkpoints/last.ckpt)
    overwrite: bool = False  # a new run may replace the results.json already in output_dir
    export: bool = True  # fold the mask and save the pruned model to output_dir/export

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_dir", Path(self.output_dir))
        _check_types(self, "", {"output_dir"})


@dataclass(frozen=True)
class PruningSpec:
    """`pruning:` how pruned heads leave the model, whether each layer's choice is re-made by the
    mask's Fisher, where the frozen dense copy lives and where the pruned model's blocks live in a
    run without training (conf/train.yaml says more)."""

    physical: bool = True
    rearrange: bool = False
    dense_device: str = "run"  # run or cpu (engine.offload.DENSE_DEVICES); checked with the budget
    model_device: str = "run"  # run or cpu (engine.offload.MODEL_DEVICES); checked with the budget and training
    verify_surgery: bool = True  # each physical removal checked by one tiny forward against the masked model

    def __post_init__(self) -> None:
        _check_types(self, "pruning.")


@dataclass(frozen=True)
class DiagnosticsSpec:
    """`diagnostics:` head diagnostics of the final model (scoring.diagnostics.head_diagnostics)."""

    enabled: bool = True
    metrics: Sequence[str] = ("entropy", "confidence", "magnitude")
    duplicate_threshold: float = 0.2
    special_threshold: float = 0.8

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", tuple(self.metrics))
        _check_types(self, "diagnostics.", {"metrics"})
        check_options(self.metrics, self.duplicate_threshold, self.special_threshold)

    def options(self) -> dict | None:
        """head_diagnostics' options, or None when the diagnostics are off."""
        if not self.enabled:
            return None
        return {"metrics": list(self.metrics), "duplicate_threshold": self.duplicate_threshold,
                "special_threshold": self.special_threshold}


@dataclass(frozen=True)
class ModelSpec:
    """`model:` what the run prunes. `load(num_labels=...)` builds it (None:
    `models.build.build_model` of `pretrained`, `task`, `random_init`); `pretrained` also names the
    tokenizer and the export's origin."""

    pretrained: str
    task: str = "classification"  # the run's Task (tasks.TASKS): classification or causal_lm
    random_init: bool = False
    load: Optional[Callable[..., torch.nn.Module]] = None

    def __post_init__(self) -> None:
        _check_types(self, "model.", {"load"})
        get_task(self.task)  # an unknown task: refused naming model.task and the allowed ones

    def build(self, num_labels: int | None) -> torch.nn.Module:
        load = self.load or partial(build_model, self.pretrained, task=self.task, random_init=self.random_init)
        return load(num_labels=num_labels)


@dataclass(frozen=True)
class DataSpec:
    """`data:` `load(tokenizer=..., [select_samples=...])` builds the data module; the facts the run
    checks before loading it are stated beside it (from the data config: its class's `task`, the
    block size, the data folder, the scoring and training sample counts)."""

    load: Callable[..., Any]
    task: str = "classification"  # the data it holds (a data module class's `task`)
    name: Optional[str] = None
    data_dir: Optional[str] = None
    block_size: Optional[int] = None
    score_samples: Optional[int] = None
    max_train_samples: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.data_dir, Path):
            object.__setattr__(self, "data_dir", str(self.data_dir))
        _check_types(self, "data.", {"load"})


@dataclass(frozen=True)
class OptimSpec:
    """`optim:` the optimizer (params -> optimizer) and the learning-rate schedule (optimizer,
    steps -> scheduler; None: constant) of the fine-tuning epochs and step budgets."""

    optimizer: Callable[..., torch.optim.Optimizer] = partial(torch.optim.AdamW, lr=5.0e-5, weight_decay=0.01)
    scheduler: Optional[Callable[..., Any]] = None


@dataclass(frozen=True)
class TrainerSpec:
    """`trainer:` the Lightning Trainer's `settings` (what `engine.Runtime.of` reads: accelerator,
    devices, precision, strategy...; the schedule sets the epochs), and `load`, which builds the
    Trainer of a run that trains epochs (None: `lightning.Trainer(**settings, ...)`)."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    load: Optional[Callable[..., Any]] = None

    def __post_init__(self) -> None:
        for name in ("max_epochs", "min_epochs", "max_steps"):
            if self.settings.get(name) not in (None, -1):
                raise ValueError(f"trainer.{name}={self.settings.get(name)} is not allowed: the schedule sets the number "
                                 "of epochs (schedule.baseline_epochs + rounds x schedule.epochs_per_round + "
                                 "schedule.recover_epochs); set those instead")

    @property
    def fast_dev_run(self) -> bool:
        return bool(self.settings.get("fast_dev_run", False))

    def build(self, **kwargs):
        if self.load is not None:
            return self.load(**kwargs)
        import lightning as L

        return L.Trainer(**{k: v for k, v in self.settings.items() if k != "_target_"}, **kwargs)


def _no_objects() -> list:
    return []


@dataclass(frozen=True)
class RunSpec:
    """One run: what is pruned, on which data, how, and where it writes. Built once, checked when
    built (`preflight.check_settings`); `runs.run(spec)` runs it. The science objects are used by
    this one run (a recovery and a budget keep state): build a new spec for another run."""

    output: OutputSpec
    model: ModelSpec
    data: DataSpec
    metric: Callable  # a scoring function with its options bound (scoring.get_metric, a partial)
    schedule: Any  # selection.schedules
    layer_policy: Any = field(default_factory=GlobalPolicy)  # selection.layer_policies
    recovery: Any = field(default_factory=Finetune)  # recovery.RECOVERIES
    budget: Budget = field(default_factory=Budget)  # selection.budgets
    kv_modes: KVModes = field(default_factory=KVModes)
    pruning: PruningSpec = field(default_factory=PruningSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    diagnostics: DiagnosticsSpec = field(default_factory=DiagnosticsSpec)
    evaluation: EvaluationSettings = field(default_factory=EvaluationSettings)
    loggers: Callable[[], list] = _no_objects  # () -> Lightning loggers
    callbacks: Callable[[], list] = _no_objects  # () -> Lightning callbacks beside the pruning one
    seed: int = 0
    objectives: Sequence[str] = ("headline",)  # what a sweep optimises (runs.objectives)
    check_consistency: bool = False  # assert all data-parallel ranks hold the same mask and weights
    config: Mapping[str, Any] = field(default_factory=dict)  # the settings as asked (see `record`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objectives", tuple(self.objectives))
        _check_types(self, "", {"output", "model", "data", "metric", "schedule", "layer_policy", "recovery", "budget",
                                "kv_modes", "pruning", "optim", "trainer", "diagnostics", "evaluation", "loggers",
                                "callbacks", "objectives", "config"})
        check_settings(self)

    @property
    def task(self) -> Task:
        """The run's Task (model.task), handed to everything the run builds."""
        return get_task(self.model.task)

    @property
    def trains(self) -> bool:
        """Whether the run trains epochs under a Trainer (else it builds none)."""
        return self.schedule.total_epochs() > 0 or self.trainer.fast_dev_run

    def record(self) -> dict:
        """results.json `config`: the composed config of a Hydra run, else the spec's typed settings
        in the same shape (each object as its `_target_` and fields), so a resume compares them."""
        if self.config:
            return dict(self.config)
        return _plain({"model": {"pretrained": self.model.pretrained, "task": self.model.task,
                                 "random_init": self.model.random_init},
                       "data": {k: getattr(self.data, k) for k in ("name", "data_dir", "block_size", "score_samples",
                                                                   "max_train_samples")},
                       "metric": {"_target_": _target(getattr(self.metric, "func", self.metric)),
                                  **dict(getattr(self.metric, "keywords", None) or {})},
                       **{name: {"_target_": _target(type(getattr(self, name))), **dataclasses.asdict(getattr(self, name))}
                          for name in ("schedule", "layer_policy", "recovery", "budget", "kv_modes")
                          if dataclasses.is_dataclass(getattr(self, name))},
                       "pruning": dataclasses.asdict(self.pruning), "diagnostics": dataclasses.asdict(self.diagnostics),
                       "evaluation": dataclasses.asdict(self.evaluation), "seed": self.seed,
                       "objectives": list(self.objectives), "export": self.output.export})

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "RunSpec":
        """The spec of a composed `conf/train.yaml` (what `headprune-train` runs); the one place the
        Hydra config is read."""
        data = cfg.data
        return cls(
            output=OutputSpec(output_dir=Path(cfg.paths.output_dir), ckpt_path=cfg.get("ckpt_path"),
                              overwrite=cfg.get("overwrite", False), export=cfg.get("export", True)),
            model=ModelSpec(pretrained=cfg.model.pretrained, task=cfg.model.get("task", "classification"),
                            random_init=cfg.model.get("random_init", False), load=instantiate(cfg.model)),
            data=DataSpec(load=Factory(data), task=getattr(get_class(data._target_), "task", "classification"),
                          name=data.get("name"), data_dir=data.get("data_dir"), block_size=data.get("block_size"),
                          score_samples=data.get("score_samples"), max_train_samples=data.get("max_train_samples")),
            metric=build(cfg.metric), schedule=build(cfg.schedule), layer_policy=build(cfg.layer_policy),
            recovery=build(cfg.recovery), budget=build(cfg.budget),
            kv_modes=build(cfg.kv_modes) if cfg.get("kv_modes") else KVModes(),
            pruning=_part(PruningSpec, cfg.get("pruning"), "pruning"),
            optim=OptimSpec(optimizer=instantiate(cfg.optim.optimizer),
                            scheduler=instantiate(cfg.optim.scheduler) if cfg.optim.get("scheduler") else None),
            trainer=TrainerSpec(settings=OmegaConf.to_container(cfg.trainer, resolve=True), load=Factory(cfg.trainer)),
            diagnostics=_part(DiagnosticsSpec, cfg.get("diagnostics"), "diagnostics") if cfg.get("diagnostics")
            else DiagnosticsSpec(enabled=False),
            evaluation=_part(EvaluationSettings, cfg.get("evaluation"), "evaluation"),
            loggers=GroupFactory(cfg.get("logger")), callbacks=GroupFactory(cfg.get("callbacks")),
            seed=cfg.seed, objectives=tuple(cfg.get("objectives") or ["headline"]),
            check_consistency=cfg.get("check_consistency", False),
            config=OmegaConf.to_container(cfg, resolve=True))


def _target(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _plain(record: dict) -> dict:
    """JSON values only (what results.json and a checkpoint hold): anything else as its text."""
    return json.loads(json.dumps(record, default=str))


def _part(cls, block: DictConfig | None, group: str):
    """A typed part from its config block; a key the part has no field for is refused, naming it."""
    values = OmegaConf.to_container(block, resolve=True) if block is not None else {}
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{group}.{unknown[0]} is not a setting of {group}; allowed: {', '.join(names)}")
    return cls(**values)


def _check_types(part, prefix: str, skip: set = frozenset()) -> None:
    """Plain fields (bool, int, float, str, optionally None) hold values of their type: `pruning.physical=yes`
    is refused, naming the field, rather than read as true."""
    hints = typing.get_type_hints(type(part))
    for f in dataclasses.fields(part):
        if f.name in skip:
            continue
        value, kind = getattr(part, f.name), hints[f.name]
        optional = typing.get_origin(kind) is typing.Union and type(None) in typing.get_args(kind)
        if optional:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if value is None and optional:
            continue
        ok = {bool: lambda v: isinstance(v, bool),
              int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              str: lambda v: isinstance(v, str)}.get(kind)
        if ok is not None and not ok(value):
            allowed = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
            raise ValueError(f"{prefix}{f.name}={value!r} is not allowed; allowed: {allowed}"
                             f"{' or null' if optional else ''}")
