"""First-order Taylor head importance ("masking confidence", Michel et al. 2019).

For head h with context c_h (the head's slice of the output projection's input), the change
in loss from masking it is approximated to first order by
    I_h = E_x | sum_t c_h(x)_t . dL(x)/dc_h(x)_t |,
the absolute gradient of the loss w.r.t. a gate on h, per example, averaged over examples.
Per-example gates (HeadMask.differentiable_gates) give the per-example gradients in one
backward pass per batch: with the loss summed over the batch, each example's gates only see
that example's loss. Higher = more important.
"""
from __future__ import annotations

import torch
from torch import nn

from headprune.heads.mask import HeadMask
from headprune.tasks import Task
from headprune.scoring.reduce import finish_scores, mean_over_ranks, per_example_gate_grads


def taylor_importance(model: nn.Module, mask: HeadMask, dataloader, normalize: bool = True,
                      max_batches: int | None = None, task: Task | None = None) -> torch.Tensor:
    """(layers, heads) Taylor importance over `dataloader` of `task`'s loss (the run's Task; None:
    the model's head's); pruned heads score 0.

    `normalize`: divide each layer's scores by their L2 norm, as Michel et al. do before
    ranking heads globally across layers.
    """
    total = torch.zeros_like(mask.mask, dtype=torch.float64)
    count = 0
    for grad in per_example_gate_grads(model, mask, dataloader, max_batches, task):  # (B, L, H)
        total += grad.abs().sum(0)
        count += grad.shape[0]
    return finish_scores(mean_over_ranks(total, count), mask, normalize=normalize)
