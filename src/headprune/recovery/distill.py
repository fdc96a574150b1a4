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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from headprune.tasks import MODEL_INPUTS, real_tokens, target_weights


@dataclass
class Distill:
    """`recovery=distill` settings. `teacher`: a model folder to distil from; None = the model
    itself at the end of the baseline epochs (a frozen copy)."""

    alpha: float = 0.9
    temperature: float = 2.0
    hidden_weight: float = 0.0
    teacher: Optional[str] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"recovery.alpha={self.alpha!r} must be in [0, 1]: the weight of the distillation term")
        if not self.temperature > 0:
            raise ValueError(f"recovery.temperature={self.temperature!r} must be > 0")
        if self.hidden_weight < 0:
            raise ValueError(f"recovery.hidden_weight={self.hidden_weight!r} must be >= 0")


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
