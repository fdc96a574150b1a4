"""The LightningModule: an HF model with a HeadMask, trained with a per-example loss.

Validation is the run's Task's (headprune.tasks): each batch's `Task.batch_sums`, summed over the
epoch and the data-parallel ranks, then `Task.metrics`, logged as `val/<metric>`: accuracy and
loss for sequence classification, the per-token loss and the perplexity for a causal LM, the same
numbers `Task.evaluate` reports.
"""
from __future__ import annotations

from typing import Callable

import lightning as L
import torch
from torch import nn

from headprune.heads.adapters import LAYOUT_ATTR, head_layout
from headprune.heads.hard_concrete import HardConcreteGates
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import apply_layout
from headprune.recovery.base import Recovery
from headprune.tasks import CLASSIFICATION, Task, checked_task, forward_logits


class HeadPruneModule(L.LightningModule):
    """Wraps `model` and owns its HeadMask (saved in checkpoints as `head_mask.mask`).

    `optimizer` is a partial taking the parameters; `scheduler` a partial taking
    (optimizer, total_steps) and returning a per-step LR scheduler, or None.
    `l0_penalty` > 0 learns Hard-Concrete head gates with the model (Voita et al. 2019;
    `metric=l0_gates metric.finetune=true` sets it to `metric.penalty`): gates are sampled in
    training, deterministic at evaluation, `l0_penalty` x the expected number of open heads is
    added to the loss, and the gates train at learning rate `l0_lr` (`metric.lr`).
    `task`: the run's Task, or its name (model.task: "classification", which needs `num_labels`, or
    "causal_lm"), checked against the model's head; None: the head's, read once here.
    `recovery`: its `training_loss` is every training step's loss (the task loss, or under
    `recovery=distill` the mix with the teacher's, once the Pruner gave it a teacher).
    """

    def __init__(self, model: nn.Module, num_labels: int | None, optimizer: Callable | None = None,
                 scheduler: Callable | None = None, l0_penalty: float = 0.0, l0_lr: float = 0.1,
                 task: Task | str | None = None, recovery: Recovery | None = None):
        super().__init__()
        self.task = checked_task(model, task, "model.task")  # a Task (tasks.py): loss, weights, metrics
        if self.task is CLASSIFICATION and not num_labels:
            raise ValueError(f"model.task=classification needs the number of classes, got num_labels={num_labels!r}")
        self.recovery = recovery if recovery is not None else Recovery()
        self.nonfinite_loss: float | None = None
        self.model = model.train()  # from_pretrained returns eval mode; fine-tuning wants dropout
        self.head_mask = HeadMask.for_model(model)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        if l0_penalty < 0:
            raise ValueError(f"metric.penalty={l0_penalty!r} must be >= 0 (the L0 penalty on the head gates)")
        self.l0_penalty, self.l0_lr = l0_penalty, l0_lr
        if l0_penalty > 0:
            self.head_mask.stochastic = HardConcreteGates(self.head_mask.num_layers, self.head_mask.num_heads)
        self._val_sums: torch.Tensor | None = None  # (3,) this rank's epoch so far: Task.batch_sums

    def forward(self, batch: dict) -> torch.Tensor:
        return forward_logits(self.model, batch)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Record the physical head layout, if heads were removed, so loading can rebuild the shapes."""
        if getattr(self.model, LAYOUT_ATTR, None) is not None:
            checkpoint[LAYOUT_ATTR] = head_layout(self.model)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Remove the checkpoint's missing heads before its state dict loads (Lightning calls this first)."""
        if checkpoint.get(LAYOUT_ATTR) is not None:
            apply_layout(self.model, checkpoint[LAYOUT_ATTR])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits, losses = self.recovery.training_loss(self.model, batch, self.task)
        loss = losses.mean()
        if self._any_rank(not bool(torch.isfinite(loss))):
            # the pruning callback stops the run on every rank, rolls the weights back and says where
            self.nonfinite_loss = float(loss.detach()) if not torch.isfinite(loss) else float("nan")
            if self._trainer is None or self._trainer.world_size == 1:
                return None  # automatic optimisation skips the step
            # DDP cannot skip a step: every rank sends zero gradients instead (the step's effect on
            # the weights is undone by the rollback)
            return sum((p * 0).sum() for p in self.parameters() if p.requires_grad)
        if self.l0_penalty > 0:
            expected_heads = self.head_mask.stochastic.expected_l0()
            loss = loss + self.l0_penalty * expected_heads
            self.log("train/expected_heads", expected_heads, batch_size=logits.shape[0])
        self.log("train/loss", loss, prog_bar=True, batch_size=logits.shape[0])
        if self.task is CLASSIFICATION:
            # a plain tensor (this rank's batch accuracy, averaged over the epoch), not a torchmetrics
            # object: the progress bar computes epoch metrics on rank 0 alone before the other ranks
            # do, and a metric object's compute is a collective (Lightning issue 21264: DDP hangs)
            batch_acc = (logits.detach().argmax(-1) == batch["labels"]).float().mean()
            self.log("train/acc", batch_acc, on_step=False, on_epoch=True, batch_size=logits.shape[0])
        return loss

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any data-parallel rank (a collective under DDP)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return flag
        return bool(trainer.strategy.reduce_boolean_decision(flag, all=False))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Accumulates only. `on_validation_epoch_end` reduces across ranks, on every rank at the same
        point, and logs plain tensors: nothing the progress bar reads (on rank 0 alone) can start a
        collective that the other ranks never join (Lightning issue 21264: DDP hangs)."""
        logits = forward_logits(self.model, batch, **self.task.forward_options)
        sums = self.task.batch_sums(logits, batch).double()  # (3,) loss sum, count, correct
        self._val_sums = sums if self._val_sums is None else self._val_sums + sums

    def on_validation_epoch_end(self) -> None:
        """Every rank computes the epoch's metrics here (the collectives run on all ranks together) and
        logs the results, identical on every rank, as plain tensors without sync_dist."""
        import warnings

        from lightning.pytorch.utilities.warnings import PossibleUserWarning

        warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('(val|train)/",
                                category=PossibleUserWarning)  # val/* are reduced already; train/acc is
        # this rank's on purpose (sync_dist would make it a collective the progress bar starts alone)
        sums, self._val_sums = self._val_sums, None
        if sums is None:  # no validation batch on this run
            return
        if self._trainer is not None and self._trainer.world_size > 1:
            sums = self._trainer.strategy.reduce(sums, reduce_op="sum")
        for name, value in self.task.metrics(*sums.tolist()).items():  # the Task's val_metrics
            self.log(f"val/{name}", value, prog_bar=True)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            return torch.optim.AdamW(self._param_groups(), lr=5e-5)
        optimizer = self.optimizer_factory(params=self._param_groups())
        if self.scheduler_factory is None:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = self.scheduler_factory(optimizer=optimizer, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _param_groups(self):
        """The model's parameters, plus the L0 gates (own learning rate, no weight decay) when learned."""
        if self.head_mask.stochastic is None:
            return self.model.parameters()
        return [{"params": list(self.model.parameters())},
                {"params": list(self.head_mask.stochastic.parameters()), "lr": self.l0_lr, "weight_decay": 0.0}]
