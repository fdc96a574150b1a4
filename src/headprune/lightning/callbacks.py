"""HeadPruning: the Lightning callback that decides WHEN to prune.

What a run's pruning does and remembers is the trainer-free `selection.pruner.Pruner`; this class
calls it at the epoch boundaries the schedule names (`Schedule.round_epoch`) and adds what only a
Trainer has: physical removal of the pruned heads mid-fit with the optimizer state sliced and DDP
re-wrapped (`lightning/shrink.py`), the wall time and throughput of each round's training, a roll
back to the epoch's start after a non-finite loss, the RNG state for an exact resume, and logging.
A schedule that may reject a round (`until_threshold`) keeps the newest round's heads masked
until the next round accepts it.
"""
from __future__ import annotations

import logging
import random

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from headprune.distributed import check_ranks
from headprune.heads.optimizer_state import reset_optimizer_state
from headprune.lightning import loggers
from headprune.lightning.diagnose import diagnose
from headprune.lightning.shrink import shrink, shrink_supported
from headprune.lightning.train_clock import TrainClock
from headprune.selection.pruner import Loaders, Pruner

log = logging.getLogger(__name__)


class HeadPruning(Callback):
    """`pruner`: the run's Pruner (its mask is the module's `head_mask`). `diagnostics`:
    head_diagnostics options, run on the final model (None = off). `check_consistency`: assert
    identical masks (and weights) on every rank after each epoch and round. `physical`: remove
    pruned heads from the model after each round where the strategy allows (results.json
    `pruning.physical_effective` says what happened)."""

    def __init__(self, pruner: Pruner, diagnostics: dict | None = None, check_consistency: bool = False,
                 physical: bool = True):
        self.pruner = pruner
        self.schedule = pruner.schedule
        self.diagnostics = diagnostics
        self.check_consistency = check_consistency
        self.physical = self._physical = physical
        self._pending_rng: dict | None = None
        self.clock = TrainClock()  # training since the last record
        self._rollback: dict | None = None
        self._rollback_epoch = 0

    # -- state (so a resumed fit knows which rounds are done) --------------------------------
    def state_dict(self) -> dict:
        return {**self.pruner.state_dict(), "train": self.clock.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.pruner.load_state_dict(state_dict)
        if "train" in state_dict:
            self.clock.load_state_dict(state_dict["train"])
        self._pending_rng = state_dict.get("rng")  # restored when training restarts, for exact resume

    # -- Lightning hooks ---------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.pruner.results.writer = trainer.is_global_zero
        if self._pending_rng is not None:
            torch.set_rng_state(self._pending_rng["torch"])
            random.setstate(self._pending_rng["python"])
            self._pending_rng = None
        if self.pruner.rounds:  # resumed after the first round
            self.pruner.resume()
        self._describe_model(pl_module, trainer)
        self.step(pl_module, trainer.datamodule, completed_epochs=trainer.current_epoch, trainer=trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # what a non-finite loss rolls back to: the state the epoch starts from, which is also what
        # the last checkpoint holds (pruning and checkpointing happen at epoch ends)
        self._rollback = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()}
        self._rollback_epoch = trainer.current_epoch
        self.clock.start()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.clock.stop()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.clock.stop()
        if self.check_consistency:
            check_ranks(pl_module.model, pl_module.head_mask, f"epoch {trainer.current_epoch + 1}")
        self.step(pl_module, trainer.datamodule, completed_epochs=trainer.current_epoch + 1, trainer=trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.clock.samples += int(batch["input_ids"].shape[0])
        bad = getattr(pl_module, "nonfinite_loss", None)
        if bad is None or self.pruner.stop_reason is not None:
            return
        rounds = self.pruner.rounds
        after = f"after round {len(rounds)}" if rounds else "before the first round"
        self.pruner.stop_reason = (f"non-finite loss ({bad}) while fine-tuning {after} (epoch {trainer.current_epoch}, "
                                   f"step {trainer.global_step}); the step was skipped, training stopped and the model "
                                   f"rolled back to the start of epoch {self._rollback_epoch}")
        log.error("%s. The last checkpoint and results.json hold the last good state.", self.pruner.stop_reason)
        trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.finish(pl_module, trainer.datamodule, trainer=trainer)

    # -- when --------------------------------------------------------------------------------
    def run_without_training(self, pl_module: L.LightningModule, datamodule) -> dict:
        """Score and prune the model as given, every round back to back (no fine-tuning)."""
        self._describe_model(pl_module, None)
        self.step(pl_module, datamodule, completed_epochs=0)
        return self.finish(pl_module, datamodule)

    def step(self, pl_module, datamodule, completed_epochs: int, trainer: L.Trainer | None = None) -> None:
        """Do whatever is due after `completed_epochs` training epochs."""
        p = self.pruner
        p.max_batches = 1 if trainer is not None and trainer.fast_dev_run else None
        while p.stop_reason is None:
            k = len(p.rounds)
            if k > p.num_rounds or completed_epochs != self.schedule.round_epoch(k):
                return
            loaders = self._loaders(datamodule, trainer)
            if not p.results.data["baseline"]:
                p.record_baseline(loaders, **self.clock.take(self.pruner.recovery.take_train_stats()))
            elif "val" not in p.rounds[-1]:
                if self._record_finetuned(loaders, trainer):
                    return
            if k == p.num_rounds:
                return
            self._prune(pl_module, k, loaders, trainer)

    def finish(self, pl_module, datamodule, trainer: L.Trainer | None = None) -> dict:
        """Fill in anything not yet evaluated (e.g. a fit stopped early) and write `final`."""
        p = self.pruner
        if getattr(pl_module, "nonfinite_loss", None) is not None and self._rollback is not None:
            pl_module.load_state_dict(self._rollback)  # the weights the last checkpoint holds, not blown-up ones
        loaders = self._loaders(datamodule, trainer)
        if p.rounds and p.results.data["baseline"] and "val" not in p.rounds[-1]:
            self._record_finetuned(loaders, trainer)
        data = p.finish(loaders)
        if self.diagnostics is not None:
            diagnose(trainer, pl_module, datamodule, p, self.diagnostics)
        loggers.log_run_summary(trainer, data)
        return data

    # -- internals ---------------------------------------------------------------------------
    def _loaders(self, datamodule, trainer) -> Loaders:
        world = trainer.world_size if trainer is not None else 1
        self.pruner.sync = (lambda value: trainer.strategy.broadcast(value, src=0)) if world > 1 else None
        return Loaders.of(datamodule, trainer.global_rank if world > 1 else 0, world,
                          select=bool(self.schedule.selection_samples()), train=self.pruner.recovery.needs_train_data)

    def _record_finetuned(self, loaders: Loaders, trainer) -> bool:
        stopped = self.pruner.record_finetuned(loaders, **self.clock.take(self.pruner.recovery.take_train_stats()))
        loggers.log_round(trainer, self.pruner.rounds[-1])
        if stopped and trainer is not None:
            trainer.should_stop = True
        return stopped

    def _prune(self, pl_module, k: int, loaders: Loaders, trainer) -> None:
        mask = pl_module.head_mask
        if self._physical and self.schedule.can_reject:  # the previous round was accepted: its heads go now
            shrink(pl_module, mask.pruned(), trainer)
        self.pruner.on_pruned = lambda result: self._after_mask(pl_module, result.pruned, trainer)
        record = self.pruner.step(k, loaders)
        if self.check_consistency:
            check_ranks(pl_module.model, pl_module.head_mask, f"round {k + 1}")
        if "val" in record:  # no fine-tuning follows: the round's result is in
            loggers.log_round(trainer, record)
            if self.pruner.stop_reason is not None and trainer is not None:
                trainer.should_stop = True
        loggers.log_head_mask(trainer, mask, record["round"])

    def _after_mask(self, pl_module, pruned, trainer) -> None:
        """Right after a round's heads are masked: reset their optimizer state, remove them."""
        if self.schedule.reset_optimizer_state and trainer is not None:
            reset_optimizer_state(trainer.optimizers, pl_module.model, pruned)
        if self._physical and not self.schedule.can_reject:
            shrink(pl_module, pruned, trainer)

    def _describe_model(self, pl_module, trainer) -> None:
        mask = pl_module.head_mask
        data = self.pruner.results.data
        data["model"] = {"layers": mask.num_layers, "heads": mask.num_heads}
        supported, why = shrink_supported(trainer)
        if self.physical and not supported:
            log.warning("pruning.physical=true, but %s: pruned heads stay in the model, masked, until the export "
                        "(pruning.physical_effective=false)", why)
        self._physical = self.physical and supported
        data["pruning"] = {"physical": self.physical, "physical_effective": self._physical,
                           **({"why_not": why} if self.physical and not supported else {})}
