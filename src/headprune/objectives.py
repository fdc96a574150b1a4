"""Per-example losses shared by training, evaluation and gradient-based scoring."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def forward_logits(model: nn.Module, batch: dict) -> torch.Tensor:
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    return model(**inputs).logits


def per_example_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Loss of each example, shape (B,).

    Sequence classification: cross-entropy of (B, C) logits against `labels`.
    Causal LM: mean next-token cross-entropy over each example's real tokens.
    """
    if logits.dim() == 2:
        return F.cross_entropy(logits.float(), batch["labels"], reduction="none")
    targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
    logits = logits[:, :-1].float()  # (B, T-1, V)
    token_loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    weights = _target_weights(batch)  # (B, T-1)
    return (token_loss * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def target_counts(batch: dict) -> torch.Tensor:
    """(B,) number of next-token targets each causal-LM example's loss averages over, so that
    sum(per_example_loss * target_counts) / sum(target_counts) is the per-token mean loss."""
    return _target_weights(batch).sum(1)


def _target_weights(batch: dict) -> torch.Tensor:
    """(B, T-1) 1.0 where position t+1 is a real, labelled target of position t."""
    targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
    weights = (targets != -100).float()
    if "attention_mask" in batch:
        weights = weights * batch["attention_mask"][:, 1:].float()
    return weights


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
