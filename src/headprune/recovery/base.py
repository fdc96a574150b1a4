"""What every recovery is: settings plus hooks that the Pruner (and the LightningModule's training
step) call at fixed points of a run. A recovery overrides the hooks it needs; adding one is one
file here, one entry in `RECOVERIES` and one `conf/recovery/<name>.yaml`.

Hooks, in the order a run meets them:
- `check(schedule)`: refuse, before anything runs, a schedule this recovery cannot work with;
- `check_model(student)`: the same for the model (a distillation teacher is loaded and checked);
- `before_first_round(pruner)`: once, when round 1 is about to prune (`pruner.dense` is the
  unpruned model when `needs_dense`);
- `resume(pruner)`: instead of the above, when a run continues after round 1;
- `after_round(pruner, record, loaders)`: after each round's heads are masked (tuning);
- `training_loss(model, batch)`: the per-example loss of every fine-tuning step.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from headprune.tasks import forward_logits, per_example_loss

log = logging.getLogger(__name__)


class Recovery:
    """A recovery that trains on the task loss and has nothing else to do (subclasses add)."""

    needs_dense: bool = False  # the unpruned model is kept (one frozen copy: `Pruner.dense`)
    trains: bool = False  # it works through training after pruning (nothing to do without)
    needs_train_data: bool = False  # it reads the training text itself (`Loaders.train`), checked up front

    def check(self, schedule) -> None:
        pass

    def check_model(self, student: nn.Module) -> None:
        """Refuse, before any training, what cannot work with this model (load what it needs)."""

    def before_first_round(self, pruner) -> None:
        pass

    def resume(self, pruner) -> None:
        pass

    def after_round(self, pruner, record: dict, loaders) -> None:
        pass

    def training_loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, per-example loss (B,)) of one training batch."""
        logits = forward_logits(model, batch)
        return logits, per_example_loss(logits, batch)

    def take_train_stats(self) -> dict:
        """Extra per-round training figures (e.g. the teacher's forward time), reset after reading."""
        return {}


class Reconstruction(Recovery):
    """A recovery that trains nothing: once a round's heads are masked it rewrites gates or
    biases against the unpruned model (`Pruner.dense`), records what it did under `record_key`
    and the result under `val_after_mask_tuning` (the key the Pruner takes a round's result from
    when nothing trains). A resumed run no longer has the unpruned model: it is refused."""

    needs_dense: bool = True
    record_key: str = ""  # results.json round entry of the report
    label: str = ""  # what it does, for the log
    resume_refusal: str = ""

    def reconstruct(self, pruner, loaders) -> dict:
        raise NotImplementedError

    def resume(self, pruner) -> None:
        raise ValueError(self.resume_refusal)

    def after_round(self, pruner, record: dict, loaders) -> None:
        start = time.perf_counter()
        report = self.reconstruct(pruner, loaders)
        record[self.record_key] = {**report, "seconds": round(time.perf_counter() - start, 3)}
        if loaders.val is not None:
            record["val_after_mask_tuning"] = pruner.evaluate(loaders.val)
            log.info("round %d: %s in %.1f s -> val %s", record["round"], self.label,
                     record[self.record_key]["seconds"], record["val_after_mask_tuning"])


def trains_after_pruning(schedule) -> bool:
    return bool(schedule.epochs_per_round or schedule.recover_epochs)
