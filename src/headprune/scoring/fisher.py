"""Fisher information of the head mask (Kwon et al. 2022, "A Fast Post-Training Pruning
Framework for Transformers").

With a gate m_h on each head, the empirical Fisher information of the mask is
    I_h = E_x (dL(x)/dm_h)^2,
the squared per-example gradient of the loss on the gold label, averaged over examples. It is
the diagonal of the curvature that tells how much the loss rises when the gate moves away
from 1. Raw HIGH = KEEP; the score is the raw value. Per-example gate gradients come from
one backward pass per batch (HeadMask.differentiable_gates), as for the Taylor metric.
"""
from __future__ import annotations

import torch
from torch import nn

from headprune.heads.mask import HeadMask
from headprune.objectives import forward_logits, per_example_loss, to_device
from headprune.scoring.reduce import finish_scores, mean_over_ranks, scoring_mode


def fisher_importance(model: nn.Module, mask: HeadMask, dataloader,
                      max_batches: int | None = None) -> torch.Tensor:
    """(layers, heads) mean squared per-example gate gradient; pruned heads score 0."""
    total = torch.zeros_like(mask.mask, dtype=torch.float64)
    count = 0
    with scoring_mode(model):
        for i, batch in enumerate(dataloader):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(batch, mask.mask.device)
            batch_size = batch["input_ids"].shape[0]
            with mask.differentiable_gates(batch_size) as gates:  # (B, L, H)
                loss = per_example_loss(forward_logits(model, batch), batch).sum()
                (grad,) = torch.autograd.grad(loss, gates)
            total += grad.detach().double().pow(2).sum(0)
            count += batch_size
    return finish_scores(mean_over_ranks(total, count), mask)
