"""Measuring how much each layer suffers when some of its heads are masked.

Sensitivity of layer l = mean loss on the scoring slice with the `share` lowest-scoring alive
heads of layer l masked, minus the loss with none of them masked. Early and final layers are
usually the most sensitive; the `sensitivity` layer policy hands the budget to the others.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from headprune.evaluation import evaluate
from headprune.heads.mask import HeadMask


@torch.no_grad()
def layer_sensitivity(model: nn.Module, mask: HeadMask, scores: torch.Tensor, dataloader,
                      share: float = 0.5, max_batches: int | None = None) -> list[float]:
    """Loss rise per layer when the `share` lowest-scoring alive heads of that layer are masked."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"layer_policy.sensitivity_share={share!r} must be in (0, 1]")
    device = mask.mask.device
    base = evaluate(model, dataloader, device, max_batches=max_batches)["loss"]
    alive = mask.alive()
    profile = []
    for layer in range(mask.num_layers):
        heads = alive[layer].nonzero().flatten().tolist()
        k = math.ceil(share * len(heads)) if heads else 0
        if k == 0:
            profile.append(0.0)
            continue
        heads.sort(key=lambda h: float(scores[layer, h]))
        trial = mask.mask.clone()
        trial[layer, heads[:k]] = 0.0
        with mask.override(trial):
            loss = evaluate(model, dataloader, device, max_batches=max_batches)["loss"]
        profile.append(loss - base)
    return profile
