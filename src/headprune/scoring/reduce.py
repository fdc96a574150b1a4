"""Helpers every metric shares: evaluation mode for scoring and the final score clean-up."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from headprune.heads.mask import HeadMask
from headprune.tasks import Task, batch_size, task_for, to_device


@contextmanager
def scoring_mode(model: nn.Module):
    """Eval mode (no dropout) with gradients enabled; restores the previous mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            yield
    finally:
        model.train(was_training)


def finish_scores(scores: torch.Tensor, mask: HeadMask, normalize: bool = False) -> torch.Tensor:
    """float32 (layers, heads) scores with pruned heads set to 0, optionally L2-normalised per layer
    over the heads still alive."""
    alive = mask.alive()
    scores = torch.where(alive, scores.to(alive.device).double(), torch.zeros((), dtype=torch.float64,
                                                                              device=alive.device))
    if normalize:
        norm = scores.pow(2).sum(dim=1, keepdim=True).sqrt()
        scores = scores / norm.clamp_min(1e-20)
    return scores.float().cpu()


def mean_over_ranks(total: torch.Tensor, count: int) -> torch.Tensor:
    """`total / count` over the union of every rank's examples: both are summed across ranks
    first (no-op in a single process), so data-parallel scoring equals scoring all the data."""
    from headprune.distributed import all_reduce_sum

    total = all_reduce_sum(total)
    n = all_reduce_sum(torch.tensor(float(count), dtype=torch.float64, device=total.device))
    if float(n) == 0:
        raise ValueError("no scoring examples on any rank (data.score_samples=0?)")
    return total / n.to(total.dtype)


def per_example_gate_grads(model: nn.Module, mask: HeadMask, dataloader, max_batches: int | None = None,
                           task: Task | None = None):
    """Yield, per batch, every example's d loss / d gate, shape (B, layers, heads), in float64,
    the loss being `task`'s (the run's Task; None: the model's head's, read once here).

    One backward pass per batch: with the loss summed over the batch, example b's gates only
    see example b's loss (HeadMask.differentiable_gates). Runs in `scoring_mode`.
    """
    task = task_for(model, task)
    with scoring_mode(model):
        for i, batch in enumerate(dataloader):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(batch, mask.mask.device)
            with mask.differentiable_gates(batch_size(batch)) as gates:  # (B, L, H)
                loss = task.model_loss(model, batch).sum()
                (grad,) = torch.autograd.grad(loss, gates)
            yield grad.detach().double()
