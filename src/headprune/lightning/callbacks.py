"""HeadPruning: the Lightning callback that adapts the Pruner's loop to a Trainer's fit.

What a run's pruning does and remembers is the trainer-free `selection.pruner.Pruner`, and its
`advance` decides what is due after each epoch; this class calls it at every epoch end of a fit
and adds what only a Trainer has: physical removal of the pruned heads mid-fit with the optimizer
state sliced and DDP re-wrapped (`observer.PruningObserver`, `lightning/shrink.py`), the wall
time and throughput of each round's training, a roll back to the epoch's start after a
non-finite loss, the RNG state for an exact resume, and the Trainer's loggers. A schedule that
may reject a round (`until_threshold`) keeps the newest round's heads masked until the next round
accepts it. A run that trains nothing never builds a Trainer (`observer.run_untrained`).
"""
from __future__ import annotations

import logging
import random

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from headprune.distributed import check_ranks
from headprune.lightning import loggers
from headprune.lightning.diagnose import diagnose
from headprune.lightning.observer import PruningObserver, describe_model
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
        if self._pending_rng is not None:
            torch.set_rng_state(self._pending_rng["torch"])
            random.setstate(self._pending_rng["python"])
            self._pending_rng = None
        self._physical = describe_model(self.pruner, pl_module, self.physical, trainer)
        self.pruner.attach(PruningObserver(self.pruner, pl_module, loggers.LogSink.of_trainer(trainer),
                                           self._physical, trainer),
                           writer=trainer.is_global_zero)
        self.pruner.limit_batches(1 if trainer.fast_dev_run else None)
        if self.pruner.rounds:  # resumed after the first round
            self.pruner.resume()
        self._advance(pl_module, trainer, completed_epochs=trainer.current_epoch)

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
        self._advance(pl_module, trainer, completed_epochs=trainer.current_epoch + 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.clock.samples += int(batch["input_ids"].shape[0])
        bad = getattr(pl_module, "nonfinite_loss", None)
        if bad is None or self.pruner.stop_reason is not None:
            return
        rounds = self.pruner.rounds
        after = f"after round {len(rounds)}" if rounds else "before the first round"
        self.pruner.stop(f"non-finite loss ({bad}) while fine-tuning {after} (epoch {trainer.current_epoch}, "
                         f"step {trainer.global_step}); the step was skipped, training stopped and the model "
                         f"rolled back to the start of epoch {self._rollback_epoch}")
        log.error("%s. The last checkpoint and results.json hold the last good state.", self.pruner.stop_reason)
        trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.finish(pl_module, trainer.datamodule, trainer)

    # -- when --------------------------------------------------------------------------------
    def finish(self, pl_module, datamodule, trainer: L.Trainer) -> dict:
        """Fill in anything not yet evaluated (e.g. a fit stopped early) and write `final`."""
        p = self.pruner
        if getattr(pl_module, "nonfinite_loss", None) is not None and self._rollback is not None:
            pl_module.load_state_dict(self._rollback)  # the weights the last checkpoint holds, not blown-up ones
        loaders = self._loaders(datamodule, trainer)
        if p.rounds and p.results.data["baseline"] and p.awaiting_finetune:
            p.record_finetuned(loaders, **self.clock.take(p.recovery.take_train_stats()))
        data = p.finish(loaders)
        if self.diagnostics is not None:
            diagnose(loggers.LogSink.of_trainer(trainer), pl_module, datamodule, p, self.diagnostics)
        return data

    # -- internals ---------------------------------------------------------------------------
    def _advance(self, pl_module, trainer: L.Trainer, completed_epochs: int) -> None:
        p = self.pruner
        if not p.due(completed_epochs):
            return
        stats = self.clock.take({})
        world = trainer.world_size
        sync = (lambda value: trainer.strategy.broadcast(value, src=0)) if world > 1 else None
        rounds_before = len(p.rounds)
        p.advance(completed_epochs, lambda: self._loaders(trainer.datamodule, trainer), sync=sync, **stats)
        if self.check_consistency and len(p.rounds) > rounds_before:
            check_ranks(pl_module.model, pl_module.head_mask, f"round {len(p.rounds)}")
        if p.stop_reason is not None:
            trainer.should_stop = True

    def _loaders(self, datamodule, trainer: L.Trainer) -> Loaders:
        world = trainer.world_size
        return Loaders.of(datamodule, trainer.global_rank if world > 1 else 0, world,
                          select=bool(self.schedule.selection_samples()), train=self.pruner.recovery.needs_train_data)
