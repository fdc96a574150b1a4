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
from headprune.tasks import Task
from headprune.scoring.reduce import finish_scores, mean_over_ranks, per_example_gate_grads


def fisher_importance(model: nn.Module, mask: HeadMask, dataloader,
                      max_batches: int | None = None, task: Task | None = None) -> torch.Tensor:
    """(layers, heads) mean squared per-example gate gradient of `task`'s loss (the run's Task;
    None: the model's head's); pruned heads score 0."""
    total = torch.zeros_like(mask.mask, dtype=torch.float64)
    count = 0
    for grad in per_example_gate_grads(model, mask, dataloader, max_batches, task):  # (B, L, H)
        total += grad.pow(2).sum(0)
        count += grad.shape[0]
    return finish_scores(mean_over_ranks(total, count), mask)


def fisher_blocks(model: nn.Module, mask: HeadMask, dataloader, max_batches: int | None = None,
                  task: Task | None = None) -> torch.Tensor:
    """(layers, heads, heads) the block-diagonal empirical Fisher of the head mask: per layer,
    E_x g g^T with g the per-example gradient of the loss w.r.t. that layer's head gates (Kwon et
    al.'s per-layer Fisher, which lets mask rearrangement see how heads of a layer interact). Its
    diagonal is `fisher_importance`. Rows and columns of pruned heads are 0."""
    total = torch.zeros(mask.num_layers, mask.num_heads, mask.num_heads, dtype=torch.float64,
                        device=mask.mask.device)
    count = 0
    for grad in per_example_gate_grads(model, mask, dataloader, max_batches, task):  # (B, L, H)
        total += torch.einsum("blh,blg->lhg", grad, grad)
        count += grad.shape[0]
    blocks = mean_over_ranks(total, count)
    alive = mask.alive().to(blocks.device).double()  # (L, H)
    return (blocks * alive[:, :, None] * alive[:, None, :]).cpu()
