"""What every recovery is: settings (its dataclass fields) plus hooks that the Pruner (and the
LightningModule's training step) call at fixed points of a run. A recovery sees the run only
through a `RecoveryContext` (the model, its mask, the unpruned copy, the loaders, the run dir):
never the Pruner. What a recovery learns during a run (a teacher, timings) is its `state`, kept
apart from the settings. Adding one is one file here, one entry in `RECOVERIES` and one
`conf/recovery/<name>.yaml`.

Hooks, in the order a run meets them:
- `check(schedule)`: refuse, before anything runs, a schedule this recovery cannot work with;
- `check_model(student)`: the same for the model (a distillation teacher is loaded and checked);
- `check_resume(run_dir)`: refuse, before anything is written, a resume this recovery cannot do;
- `before_first_round(ctx)`: once, when round 1 is about to prune (`ctx.dense` is the unpruned
  model when `needs_dense`);
- `resume(ctx)`: instead of the above, when a run continues after round 1; returns the unpruned
  model when it restores one (a saved teacher), for the run to keep as its dense copy;
- `after_round(ctx, record)`: after each round's heads are masked (tuning, step training);
- `training_loss(model, batch, task)`: the per-example loss of every fine-tuning step, `task`
  being the run's Task (the Pruner's, the LightningModule's: one object for the run).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from headprune.engine.step_fit import FitPlan
from headprune.heads.mask import HeadMask
from headprune.tasks import Task, forward_logits, task_for

log = logging.getLogger(__name__)

# results.json round key of the validation metrics right after a recovery tuned or trained a round
# (before any fine-tuning epochs of the schedule)
AFTER_RECOVERY = "val_after_recovery"


@dataclass
class RecoveryContext:
    """The part of a run a recovery may read and change. `loaders` has `score` (calibration),
    `val`, `train` (the training text of a step-budget recovery); `dense` is the frozen unpruned
    copy when the recovery (or the budget) needs one; `run_dir` is None outside a run folder;
    `writer` is False on the data-parallel ranks that must not write files; `fit`: where and how a
    step budget trains (the run's device, precision, strategy, checkpoints, loggers; None: one process
    where the model is, no checkpoints); `task`: the run's Task, whose loss a recovery trains on and
    whose metrics `evaluate` reports (a context built by hand without one reads the model's head
    once, here)."""

    model: nn.Module
    mask: HeadMask
    loaders: Any
    dense: nn.Module | None = None
    run_dir: Path | None = None
    writer: bool = True
    max_batches: int | None = None
    fit: FitPlan | None = None
    task: Task | None = None

    def __post_init__(self) -> None:
        if self.model is not None:
            self.task = task_for(self.model, self.task)

    def evaluate(self, loader: Iterable | None) -> dict | None:
        if loader is None:
            return None
        return self.task.evaluate(self.model, loader, self.mask.mask.device, max_batches=self.max_batches)


class Recovery:
    """A recovery that trains on the task loss and has nothing else to do (subclasses add)."""

    needs_dense: bool = False  # the unpruned model is kept (one frozen copy: `RecoveryContext.dense`)
    trains: bool = False  # it works through training after pruning (nothing to do without)
    needs_train_data: bool = False  # it reads the training text itself (`Loaders.train`), checked up front
    name: str = ""  # the `recovery=` option, for messages and results.json

    @property
    def keeps_dense(self) -> bool:
        """Whether the unpruned copy is still needed once `before_first_round` ran (a recovery that
        took what it needs from it then, e.g. a cached teacher, lets the run free it)."""
        return self.needs_dense

    def trains_steps(self) -> bool:
        """Whether it trains a step budget right after the round (`recovery=distill|lora` with
        `steps > 0`), which writes a resumable checkpoint in a run without epochs."""
        return False

    def follows_kv_modes(self) -> bool:
        """Whether it may follow a KV-mode choice (`kv_modes=`): it changes nothing, or it trains
        the model with the layout's windows attached. A repair that solves against the dense
        model would have to see the windows in its targets: False (the default)."""
        return False

    def check(self, schedule) -> None:
        pass

    def check_calibration(self, sequences: int) -> None:
        """Refuse, before any work, a calibration set of `sequences` sequences (data.score_samples)
        this recovery cannot split as its settings say."""

    def check_model(self, student: nn.Module) -> None:
        """Refuse, before any training, what cannot work with this model (load what it needs)."""

    def check_resume(self, run_dir: Path) -> None:
        """Refuse, before a resumed run writes anything, a resume this recovery cannot do."""

    def before_first_round(self, ctx: RecoveryContext) -> None:
        pass

    def resume(self, ctx: RecoveryContext) -> nn.Module | None:
        return None

    def after_round(self, ctx: RecoveryContext, record: dict) -> None:
        pass

    def training_loss(self, model: nn.Module, batch: dict, task: Task) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, per-example loss (B,)) of one training batch: `task`'s loss (the run's Task)."""
        logits = forward_logits(model, batch)
        return logits, task.loss(logits, batch)

    def take_train_stats(self) -> dict:
        """Extra per-round training figures (e.g. the teacher's forward time), reset after reading."""
        return {}


class Reconstruction(Recovery):
    """A recovery that trains nothing: once a round's heads are masked it rewrites gates, weights
    or biases against the unpruned model (`ctx.dense`), records what it did under `record_key`
    and the validation metrics after it under `AFTER_RECOVERY` (the round's result when nothing
    trains). A resumed run no longer has the unpruned model: it is refused before anything is
    written."""

    needs_dense: bool = True
    record_key: str = ""  # results.json round entry of the report
    label: str = ""  # what it does, for the log
    resume_refusal: str = ""

    def reconstruct(self, ctx: RecoveryContext) -> dict:
        raise NotImplementedError

    def check_resume(self, run_dir: Path) -> None:
        raise ValueError(self.resume_refusal)

    def resume(self, ctx: RecoveryContext) -> nn.Module | None:
        raise ValueError(self.resume_refusal)

    def after_round(self, ctx: RecoveryContext, record: dict) -> None:
        start = time.perf_counter()
        report = self.reconstruct(ctx)
        record[self.record_key] = {**report, "seconds": round(time.perf_counter() - start, 3)}
        if ctx.loaders.val is not None:
            record[AFTER_RECOVERY] = ctx.evaluate(ctx.loaders.val)
            log.info("round %d: %s in %.1f s -> val %s", record["round"], self.label,
                     record[self.record_key]["seconds"], record[AFTER_RECOVERY])


def trains_after_pruning(schedule) -> bool:
    return bool(schedule.epochs_per_round or schedule.recover_epochs)
