"""Knowledge distillation from the unpruned model while fine-tuning a pruned one (Hinton et al.
2015; as CoFi, Xia et al. 2022, and block movement pruning recover pruned BERTs).

Per example, with student logits s, teacher logits t and temperature T:
    kd   = T^2 * KL(softmax(t / T) || softmax(s / T))          (summed over classes)
    loss = alpha * kd + (1 - alpha) * task_loss + hidden_weight * hidden_mse
For a causal LM the KL is taken per next-token position and averaged over each example's real
targets, exactly as the task loss is. `hidden_mse` (CoFi-style layer matching) is the mean
squared difference of every layer's output hidden states, averaged over real tokens, hidden
units and layers: head pruning keeps every layer, so student layer l is matched with teacher
layer l. The T^2 factor keeps the soft-target gradients on the scale of the hard-target ones.
The KL is the usual direction (teacher distribution first, the student's log-probabilities
scored against it), i.e. the cross-entropy of the student on the teacher's soft targets minus
the teacher's entropy.

Two ways to train: `steps=0` (default) distils during the schedule's fine-tuning epochs (the
LightningModule's training step calls `training_loss`); `steps=N` trains N optimizer steps on the
training text right after each round masks its heads (`training_steps.py`), with no Trainer: the
LLM way, usable after a retraining-free prune (`schedule.epochs_per_round=0`) and between the
rounds of an iterative one (the schedule's epochs, if it has any, then train on the same loss).
`recovery=lora` (lora.py) is the same with LoRA adapters.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from headprune.deploy.hf import load_pruned, save_pruned
from headprune.heads.adapters import model_shape
from headprune.recovery.base import Recovery, trains_after_pruning
from headprune.recovery.training_steps import train_steps, trainable
from headprune.tasks import MODEL_INPUTS, is_causal_lm, per_example_loss, real_tokens, target_weights

log = logging.getLogger(__name__)


@dataclass
class Distill(Recovery):
    """`recovery=distill` settings and behaviour. `teacher`: a model folder to distil from; None =
    the model itself at the end of the baseline epochs: the Pruner's one frozen copy of the
    unpruned model (`Pruner.dense`), saved once to `<run dir>/teacher/` so a resumed run reloads
    it. The teacher is a frozen attribute of this object, never a submodule of the student: it
    is not trained, not in the optimizer and not in checkpoints."""

    alpha: float = 0.9
    temperature: float = 2.0
    hidden_weight: float = 0.0
    teacher: Optional[str] = None
    steps: int = 0  # > 0: train this many steps after each round, no Trainer (module docstring)
    lr: float = 5e-5  # peak learning rate of those steps
    max_grad_norm: float = 1.0

    TEACHER_DIR: ClassVar[str] = "teacher"
    record_key: ClassVar[str] = "distill"  # results.json round entry of the steps' report

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"recovery.alpha={self.alpha!r} must be in [0, 1]: the weight of the distillation term")
        if not self.temperature > 0:
            raise ValueError(f"recovery.temperature={self.temperature!r} must be > 0")
        if self.hidden_weight < 0:
            raise ValueError(f"recovery.hidden_weight={self.hidden_weight!r} must be >= 0")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"recovery.steps={self.steps!r} must be an integer >= 0 (0: train in the schedule's epochs)")
        if not self.lr > 0:
            raise ValueError(f"recovery.lr={self.lr!r} must be > 0")
        if not self.max_grad_norm > 0:
            raise ValueError(f"recovery.max_grad_norm={self.max_grad_norm!r} must be > 0")
        self.teacher_model: nn.Module | None = None  # a folder teacher is loaded by the app at start
        self.seconds = 0.0  # the teacher's forward time since the last `take_train_stats`

    @property
    def needs_dense(self) -> bool:
        return self.teacher is None

    @property
    def trains(self) -> bool:  # through the schedule's epochs
        return self.steps == 0

    @property
    def needs_train_data(self) -> bool:
        return self.steps > 0

    def check(self, schedule) -> None:
        name = self.record_key
        if self.steps == 0 and schedule.num_rounds and not trains_after_pruning(schedule):
            raise ValueError(f"recovery={name} trains after each round, but the schedule has no epochs after pruning "
                             "(schedule.epochs_per_round=0, schedule.recover_epochs=0); allowed: either > 0, or "
                             f"recovery.steps > 0 (train that many steps after each round, no epochs), or "
                             "recovery=finetune")

    def check_model(self, student: nn.Module) -> None:
        """Load `teacher` as it was saved (never with the student's config overrides) and refuse one
        that cannot teach this student: another task, vocabulary or label set."""
        if self.teacher is None:
            return
        folder = Path(self.teacher).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"recovery.teacher={self.teacher!r}: {folder} holds no model (no config.json); "
                                    "allowed: a model folder, e.g. <run dir>/export")
        try:
            teacher = load_pruned(folder)
        except (OSError, ValueError, RuntimeError) as err:
            raise ValueError(f"recovery.teacher={self.teacher!r} cannot be loaded: {err}") from None
        if is_causal_lm(teacher) != is_causal_lm(student):
            raise ValueError(f"recovery.teacher={self.teacher!r} is a {type(teacher).__name__}, the model being pruned "
                             f"a {type(student).__name__}: a teacher must do the same task")
        for name in ("vocab_size", "num_labels"):
            if getattr(teacher.config, name, None) != getattr(student.config, name, None):
                raise ValueError(f"recovery.teacher={self.teacher!r} has {name}={getattr(teacher.config, name, None)}, "
                                 f"the model being pruned {getattr(student.config, name, None)}; they must match")
        layers = model_shape(teacher)[0], model_shape(student)[0]
        if self.hidden_weight > 0 and layers[0] != layers[1]:
            raise ValueError(f"recovery.teacher={self.teacher!r} has {layers[0]} layers, the model being pruned "
                             f"{layers[1]}: recovery.hidden_weight={self.hidden_weight} matches hidden states layer by "
                             "layer; allowed: a teacher with as many layers, or recovery.hidden_weight=0")
        self.teacher_model = teacher.eval().requires_grad_(False)

    def before_first_round(self, pruner) -> None:
        if self.teacher_model is not None:
            return
        self.teacher_model = pruner.dense
        folder = self._folder(pruner)
        if folder is not None and pruner.results.writer:
            save_pruned(self.teacher_model, folder, overwrite=True)
        log.info("distillation teacher: the model as round 1 found it%s", f", saved to {folder}" if folder else "")

    def resume(self, pruner) -> None:
        if self.teacher_model is not None:
            return
        folder = self._folder(pruner)
        if folder is None or not folder.is_dir():
            raise FileNotFoundError(f"resuming a recovery=distill run needs its teacher, saved when round 1 pruned, "
                                    f"at {folder}; it is missing")
        self.teacher_model = pruner.dense = load_pruned(folder).eval().requires_grad_(False)

    def after_round(self, pruner, record: dict, loaders) -> None:
        """`steps > 0`: train the whole model for `steps` steps on the training text."""
        if self.steps == 0:
            return
        with trainable(pruner.model, lambda name: True):
            self.train_and_record(pruner, record, loaders, {})

    def train_and_record(self, pruner, record: dict, loaders, extra: dict) -> None:
        """Train `steps` steps of `training_loss` on `loaders.train`; the report goes to
        `record[record_key]`, the validation metrics after it to `val_after_mask_tuning`."""
        train = training_loader(loaders, self.record_key)
        start = time.perf_counter()
        report = train_steps(pruner.model, train, lambda model, batch: self.training_loss(model, batch)[1].mean(),
                             self.steps, self.lr, self.max_grad_norm, label=f"round {record['round']}: {self.record_key}")
        report.update(extra, **self.take_train_stats(), seconds=round(time.perf_counter() - start, 3))
        record[self.record_key] = report
        if loaders.val is not None:
            record["val_after_mask_tuning"] = pruner.evaluate(loaders.val)
        log.info("round %d: %s, %d steps in %.1f s, loss %.4f -> %.4f; val %s", record["round"], self.record_key,
                 self.steps, report["seconds"], report["loss_first"], report["loss_last"],
                 record.get("val_after_mask_tuning"))

    def training_loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The task loss until a teacher is in; then the mix of the module docstring."""
        if self.teacher_model is None:
            return super().training_loss(model, batch)
        device = batch["input_ids"].device
        if next(self.teacher_model.parameters()).device != device:
            self.teacher_model.to(device)
        hidden = self.hidden_weight > 0
        logits, student_hidden = forward_outputs(model, batch, hidden)
        start = time.perf_counter()
        with torch.no_grad():
            teacher_logits, teacher_hidden = forward_outputs(self.teacher_model, batch, hidden)
        self.seconds += time.perf_counter() - start
        task = per_example_loss(logits, batch)
        return logits, distill_loss(self, task, logits, teacher_logits, batch, student_hidden, teacher_hidden)

    def take_train_stats(self) -> dict:
        seconds, self.seconds = self.seconds, 0.0
        return {"teacher_seconds": round(seconds, 3)} if seconds else {}

    def _folder(self, pruner) -> Path | None:
        return pruner.results.output_dir / self.TEACHER_DIR if pruner.results.output_dir is not None else None


def training_loader(loaders, name: str):
    """The training text a step-budget recovery reads, refused when there is none."""
    train = loaders.train
    if train is None or len(getattr(train, "dataset", [None])) == 0:
        raise ValueError(f"recovery={name} with recovery.steps > 0 trains on the training blocks, but there are none "
                         "(data.max_train_samples=0, or no training loader given); allowed: data.max_train_samples > 0 "
                         "or null")
    return train


def forward_outputs(model: nn.Module, batch: dict, hidden: bool = False):
    """(logits, hidden states or None): hidden states are every layer's output, embeddings excluded."""
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    out = model(**inputs, output_hidden_states=hidden)
    return out.logits, (out.hidden_states[1:] if hidden else None)


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, batch: dict, temperature: float) -> torch.Tensor:
    """(B,) T^2 * KL(teacher || student) at temperature T: over classes for (B, C) logits, per
    next-token position averaged over each example's real targets for (B, T, V) logits."""
    if student.dim() == 3:
        student, teacher = student[:, :-1], teacher[:, :-1]  # position t predicts token t+1
    log_s = F.log_softmax(student.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1) * temperature ** 2  # (B,) or (B, T-1)
    if kl.dim() == 1:
        return kl
    weights = target_weights(batch)  # (B, T-1)
    return (kl * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def hidden_mse(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...], batch: dict) -> torch.Tensor:
    """(B,) mean over layers of the mean squared hidden-state difference over real tokens and units."""
    real = real_tokens(batch).float()  # (B, T)
    per_layer = [((s.float() - t.float()).pow(2).mean(-1) * real).sum(1) / real.sum(1).clamp_min(1.0)
                 for s, t in zip(student, teacher)]  # each (B,)
    return torch.stack(per_layer).mean(0)


def distill_loss(settings: Distill, task_loss: torch.Tensor, student_logits: torch.Tensor,
                 teacher_logits: torch.Tensor, batch: dict, student_hidden=None, teacher_hidden=None) -> torch.Tensor:
    """(B,) the per-example recovery loss of the module docstring."""
    loss = settings.alpha * kd_loss(student_logits, teacher_logits, batch, settings.temperature)
    loss = loss + (1 - settings.alpha) * task_loss
    if settings.hidden_weight > 0:
        loss = loss + settings.hidden_weight * hidden_mse(student_hidden, teacher_hidden, batch)
    return loss
