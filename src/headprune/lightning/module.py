"""The LightningModule: an HF model with a HeadMask, trained with a per-example loss."""
from __future__ import annotations

from typing import Callable

import lightning as L
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from headprune.heads.mask import HeadMask
from headprune.objectives import forward_logits, per_example_loss


class HeadPruneModule(L.LightningModule):
    """Wraps `model` and owns its HeadMask (saved in checkpoints as `head_mask.mask`).

    `optimizer` is a partial taking the parameters; `scheduler` a partial taking
    (optimizer, total_steps) and returning a per-step LR scheduler, or None.
    """

    def __init__(self, model: nn.Module, num_labels: int, optimizer: Callable | None = None,
                 scheduler: Callable | None = None):
        super().__init__()
        self.model = model.train()  # from_pretrained returns eval mode; fine-tuning wants dropout
        self.head_mask = HeadMask.for_model(model)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.train_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")

    def forward(self, batch: dict) -> torch.Tensor:
        return forward_logits(self.model, batch)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        loss = per_example_loss(logits, batch).mean()
        self.train_acc(logits.argmax(-1), batch["labels"])
        self.log("train/loss", loss, prog_bar=True, batch_size=logits.shape[0])
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, batch_size=logits.shape[0])
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        logits = self(batch)
        loss = per_example_loss(logits, batch).mean()
        self.val_acc(logits.argmax(-1), batch["labels"])
        self.log("val/loss", loss, prog_bar=True, batch_size=logits.shape[0])
        self.log("val/acc", self.val_acc, prog_bar=True, batch_size=logits.shape[0])

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            return torch.optim.AdamW(self.model.parameters(), lr=5e-5)
        optimizer = self.optimizer_factory(params=self.model.parameters())
        if self.scheduler_factory is None:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = self.scheduler_factory(optimizer=optimizer, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
