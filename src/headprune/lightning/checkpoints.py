"""`last.ckpt` that is always a real, complete checkpoint.

Lightning's `save_last: link` deletes the previous checkpoint before it re-points the link, so a
kill in between leaves `last.ckpt` pointing at nothing. `LastCheckpoint` writes the whole
checkpoint to a temporary file beside it and renames it over `last.ckpt`: a kill at any moment
leaves the previous complete file or the new one. It does not save after a non-finite loss, so
the checkpoint kept is the last one taken before the weights could have blown up.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Checkpoint

from headprune.engine.step_fit import save_checkpoint_atomic

log = logging.getLogger(__name__)

NAME = "last.ckpt"


class LastCheckpoint(Checkpoint):
    """Write `<dirpath>/last.ckpt` at the end of every training epoch. A `Checkpoint`, so Lightning
    runs it after every other callback (the pruning callback's round is in the checkpoint) and
    adds no default checkpointing of its own. Resume with `ckpt_path=<dirpath>/last.ckpt`."""

    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)

    @property
    def path(self) -> Path:
        return self.dirpath / NAME

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        if getattr(pl_module, "nonfinite_loss", None) is not None:
            log.warning("non-finite loss: %s is kept as it was (the last state before it)", self.path)
            return
        self.save(trainer)

    def save(self, trainer: L.Trainer) -> None:
        """Every rank takes part (the checkpoint is gathered); rank 0 writes and renames."""
        save_checkpoint_atomic(trainer, self.path, commit=self._commit)

    @staticmethod
    def _commit(tmp: Path, path: Path) -> None:
        """The rename that makes the new checkpoint `last.ckpt` (atomic on one filesystem)."""
        os.replace(tmp, path)
