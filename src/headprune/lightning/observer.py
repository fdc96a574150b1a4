"""What a headprune-train run adds to the Pruner at fixed points of its loop, with or without a
Trainer (`selection.pruner.RunObserver`): right after a round masks its heads, the heads leave the
model (physical removal; under a Trainer with their optimizer state sliced and DDP re-wrapped) and
the kept-heads heatmap is logged; when a round's result is in, it goes to the loggers; at the end,
the summary. `run_untrained` is the whole run when nothing trains: the Pruner's own loop, no
Trainer built.
"""
from __future__ import annotations

import logging

from pathlib import Path

import lightning as L
import torch

from headprune.distributed import check_ranks
from headprune.engine.runtime import Runtime
from headprune.engine.step_fit import RUN_STATE
from headprune.heads.optimizer_state import reset_optimizer_state
from headprune.lightning import loggers
from headprune.lightning.diagnose import diagnose
from headprune.lightning.shrink import shrink, shrink_supported
from headprune.selection.pruner import Loaders, Pruner, RunObserver

log = logging.getLogger(__name__)


class PruningObserver(RunObserver):
    """Physical removal and logging of one run. `physical`: the heads leave the model after each
    round (a schedule that may reject a round removes them when the next round starts);
    `trainer`: the Trainer of a fit (None: a run with no training)."""

    def __init__(self, pruner: Pruner, pl_module: L.LightningModule, sink: loggers.LogSink, physical: bool,
                 trainer: L.Trainer | None = None, check_consistency: bool = False):
        self.pruner, self.pl_module, self.sink = pruner, pl_module, sink
        self.physical, self.trainer, self.check_consistency = physical, trainer, check_consistency

    def baseline(self, baseline: dict) -> None:
        loggers.log_baseline(self.sink, baseline)

    def before_round(self, k: int) -> None:
        if self.physical and self.pruner.schedule.can_reject and k > 0:  # the previous round was accepted
            shrink(self.pl_module, self.pl_module.head_mask.pruned(), self.trainer)

    def pruned(self, result) -> None:
        schedule = self.pruner.schedule
        if schedule.reset_optimizer_state and self.trainer is not None:
            reset_optimizer_state(self.trainer.optimizers, self.pl_module.model, result.pruned)
        if self.physical and not schedule.can_reject:
            shrink(self.pl_module, result.pruned, self.trainer)
        loggers.log_head_mask(self.sink, self.pl_module.head_mask, result.round)

    def recorded(self, record: dict) -> None:
        if self.check_consistency:  # every rank holds the same mask and weights after the round's recovery
            check_ranks(self.pl_module.model, self.pl_module.head_mask, f"round {record['round']}")
        loggers.log_round(self.sink, record)
        if self.pruner.stop_reason is not None and self.trainer is not None:
            self.trainer.should_stop = True

    def finished(self, data: dict) -> None:
        loggers.log_run_summary(self.sink, data)


def describe_model(pruner: Pruner, pl_module: L.LightningModule, physical: bool,
                   trainer: L.Trainer | None = None) -> bool:
    """results.json `model` (layers, heads) and `pruning` (physical removal asked for and done);
    returns whether heads leave the model during the run (some strategies cannot re-wrap it)."""
    mask = pl_module.head_mask
    supported, why = shrink_supported(trainer)
    if physical and not supported:
        log.warning("pruning.physical=true, but %s: pruned heads stay in the model, masked, until the export "
                    "(pruning.physical_effective=false)", why)
    effective = physical and supported
    pruner.describe(model={"layers": mask.num_layers, "heads": mask.num_heads},
                    pruning={"physical": physical, "physical_effective": effective,
                             **({"why_not": why} if physical and not supported else {})})
    return effective


def run_untrained(pruner: Pruner, pl_module: L.LightningModule, datamodule, sink: loggers.LogSink,
                  physical: bool = True, diagnostics: dict | None = None, runtime: Runtime | None = None,
                  ckpt_path: str | None = None, check_consistency: bool = False) -> dict:
    """A run whose schedule trains nothing (every retraining-free and LLM run): baseline, every
    round back to back, `final`, in the Pruner's loop; each round logged to `sink` as a trained
    run's rounds are. Under data parallelism (`runtime.world_size` > 1, processes already launched)
    every rank scores its shard of the calibration slice, the accumulators are summed and rank 0's
    choice is broadcast; rank 0 alone writes. `ckpt_path`: a recovery's step-budget checkpoint of
    this run to continue from (the round it was taken in resumes at its step). `check_consistency`:
    assert after each round that every rank holds the same mask and weights."""
    rank, world = (runtime.rank, runtime.world_size) if runtime is not None else (0, 1)
    effective = describe_model(pruner, pl_module, physical)
    pruner.attach(PruningObserver(pruner, pl_module, sink, effective, check_consistency=check_consistency and world > 1),
                  writer=rank == 0)
    select = bool(pruner.schedule.selection_samples())
    loaders = Loaders.of(datamodule, rank, world, select=select, train=pruner.recovery.needs_train_data)
    sync = _broadcast if world > 1 else None
    if ckpt_path is not None:
        state = torch.load(ckpt_path, map_location="cpu", weights_only=True)[RUN_STATE]
        pruner.resume_in_round(state, Path(ckpt_path), loaders)
    data = pruner.run(loaders, sync=sync)
    if diagnostics is not None:
        diagnose(sink, pl_module, datamodule, pruner, diagnostics)
    return data


def _broadcast(value):
    """Rank 0's `value` on every rank (a collective)."""
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]
