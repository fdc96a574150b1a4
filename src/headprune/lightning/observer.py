"""What a headprune-train run adds to the Pruner at fixed points of its loop, with or without a
Trainer (`selection.pruner.RunObserver`): right after a round masks its heads, the heads leave the
model (physical removal; under a Trainer with their optimizer state sliced and DDP re-wrapped) and
the kept-heads heatmap is logged; when a round's result is in, it goes to the loggers; at the end,
the summary. `run_untrained` is the whole run when nothing trains: the Pruner's own loop, no
Trainer built.
"""
from __future__ import annotations

import logging

import lightning as L

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
                 trainer: L.Trainer | None = None):
        self.pruner, self.pl_module, self.sink = pruner, pl_module, sink
        self.physical, self.trainer = physical, trainer

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
                  physical: bool = True, diagnostics: dict | None = None) -> dict:
    """A run whose schedule trains nothing (every retraining-free and LLM run): baseline, every
    round back to back, `final`, in the Pruner's loop; each round logged to `sink` as a trained
    run's rounds are."""
    effective = describe_model(pruner, pl_module, physical)
    pruner.attach(PruningObserver(pruner, pl_module, sink, effective))
    select = bool(pruner.schedule.selection_samples())
    loaders = Loaders.of(datamodule, select=select, train=pruner.recovery.needs_train_data)
    data = pruner.run(loaders)
    if diagnostics is not None:
        diagnose(sink, pl_module, datamodule, pruner, diagnostics)
    return data
