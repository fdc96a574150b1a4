"""`recovery=chain`: several recoveries one after the other after each round, in one run: e.g.
a retraining-free repair, then a trained one on top of it (`stages: [refit, distill]` with
`options.distill.steps: 50`): the training starts from the repaired model, not the unrepaired one.

Each stage is the recovery its name builds (`RECOVERIES`, with `options[name]` as its settings)
and keeps its own hooks and results.json entry; a round records the validation metrics after
each stage (`val_after_<stage>`) and, as every recovery, after the last (`val_after_recovery`).
The chain needs what any stage needs (the unpruned copy, the training text); at most one stage
may train in the schedule's epochs (its loss is the training loss); a chain in a chain, an
unknown stage or options for a stage not in the chain are refused when it is built.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

from headprune.recovery.base import AFTER_RECOVERY, Recovery, RecoveryContext
from headprune.tasks import Task

DONE = "chain_done"  # a round's record while its chain runs: the stages already finished


def _plain(value: Any) -> Any:
    """Nested mappings (OmegaConf's included) as plain dicts."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


@dataclass
class Chain(Recovery):
    """`stages`: recovery names, applied in this order after each round; `options`: settings per
    stage name (the fields of that recovery's config)."""

    stages: List[str] = field(default_factory=lambda: ["refit", "distill"])
    options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from headprune.recovery import RECOVERIES

        stages, options = list(self.stages), _plain(self.options) or {}
        allowed = [name for name in RECOVERIES if name not in ("chain", "none")]
        if not stages:
            raise ValueError(f"recovery.stages=[] names no recovery; allowed: a list of {', '.join(allowed)}")
        for name in stages:
            if name not in allowed:
                raise ValueError(f"recovery.stages: {name!r} is not allowed; allowed: {', '.join(allowed)}")
        if len(set(stages)) != len(stages):
            raise ValueError(f"recovery.stages={stages} names a recovery twice; each stage once")
        extra = sorted(set(options) - set(stages))
        if extra:
            raise ValueError(f"recovery.options has settings for {extra}, which recovery.stages={stages} does not "
                             "run; allowed keys: the stage names")
        self.parts: list[Recovery] = []
        for name in stages:
            try:
                self.parts.append(RECOVERIES[name](**(options.get(name) or {})))
            except TypeError as err:
                raise ValueError(f"recovery.options.{name}: {err}") from None
        epoch_trainers = [name for name, part in zip(stages, self.parts) if part.trains]
        if len(epoch_trainers) > 1:
            raise ValueError(f"recovery.stages {epoch_trainers} all train in the schedule's epochs; at most one "
                             "may (give the others a step budget, e.g. recovery.options.distill.steps=50)")
        self.names = stages

    # -- what it needs: what any stage needs --------------------------------------------------------
    @property
    def needs_dense(self) -> bool:
        return any(part.needs_dense for part in self.parts)

    @property
    def keeps_dense(self) -> bool:
        return any(part.keeps_dense for part in self.parts)

    @property
    def trains(self) -> bool:
        return any(part.trains for part in self.parts)

    @property
    def needs_train_data(self) -> bool:
        return any(part.needs_train_data for part in self.parts)

    @property
    def steps_setting(self) -> str:
        """The step budgets of the stages that train on the training text, as settings the user
        wrote them (e.g. `recovery.options.distill.steps=50`), for messages (the chain has no
        `recovery.steps` of its own)."""
        return ", ".join(f"recovery.options.{name}.steps={getattr(part, 'steps', None)}"
                         for name, part in zip(self.names, self.parts) if part.needs_train_data)

    # -- hooks: each stage's, in order ----------------------------------------------------------------
    def check(self, schedule) -> None:
        for part in self.parts:
            part.check(schedule)

    def check_calibration(self, sequences: int) -> None:
        for part in self.parts:
            part.check_calibration(sequences)

    def check_model(self, student: nn.Module) -> None:
        for part in self.parts:
            part.check_model(student)

    def check_resume(self, run_dir: Path) -> None:
        for part in self.parts:
            part.check_resume(run_dir)

    def before_first_round(self, ctx: RecoveryContext) -> None:
        for part in self.parts:
            part.before_first_round(ctx)

    def resume(self, ctx: RecoveryContext) -> nn.Module | None:
        restored = None
        for part in self.parts:
            ctx.dense = part.resume(ctx) or ctx.dense
            restored = restored or ctx.dense
        return restored

    def after_round(self, ctx: RecoveryContext, record: dict) -> None:
        """Each stage in order. `record[DONE]` lists the stages finished so far, so a round resumed
        from a checkpoint taken during a stage's fit (the record travels in it) runs only the rest."""
        done = record.setdefault(DONE, [])
        for name, part in zip(self.names, self.parts):
            if name in done:
                continue
            record.pop(AFTER_RECOVERY, None)
            part.after_round(ctx, record)
            if AFTER_RECOVERY in record:
                record[f"val_after_{name}"] = record[AFTER_RECOVERY]
            done.append(name)
        last = f"val_after_{self.names[-1]}"
        if last in record:
            record[AFTER_RECOVERY] = record[last]
        del record[DONE]
        record["chain"] = list(self.names)

    def training_loss(self, model: nn.Module, batch: dict, task: Task) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of the stage that trains in the schedule's epochs (the task loss when none does)."""
        for part in self.parts:
            if part.trains:
                return part.training_loss(model, batch, task)
        return super().training_loss(model, batch, task)

    def take_train_stats(self) -> dict:
        stats: dict = {}
        for part in self.parts:
            stats.update(part.take_train_stats())
        return stats
