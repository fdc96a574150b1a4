"""Measuring how much each layer suffers when some of its heads are masked.

Sensitivity of layer l = mean loss on the scoring slice with the `share` lowest-scoring alive
heads of layer l masked, minus the loss with none of them masked. Early and final layers are
usually the most sensitive; the `sensitivity` layer policy hands the budget to the others.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from headprune.tasks import Task, task_for
from headprune.heads.mask import HeadMask


def _weakest(mask: HeadMask, scores: torch.Tensor, layer: int, share: float) -> list[int]:
    """The ceil(share x alive) lowest-scoring alive heads of `layer`."""
    heads = mask.alive()[layer].nonzero().flatten().tolist()
    heads.sort(key=lambda h: float(scores[layer, h]))
    return heads[:math.ceil(share * len(heads))] if heads else []


def check_share(share: float) -> None:
    if not 0.0 < share <= 1.0:
        raise ValueError(f"layer_policy.share={share!r} must be in (0, 1]: the share of a layer's heads masked")


@torch.no_grad()
def sensitivity_profile(model: nn.Module, mask: HeadMask, scores: torch.Tensor, dataloader,
                        shares: list[float], max_batches: int | None = None, task: Task | None = None) -> list[dict]:
    """Validation metrics with the `share` lowest-scoring alive heads of one layer masked, for
    every layer and share, plus the change of each metric against the unmasked model.

    One row per (layer, share): {"layer", "share", "heads_masked", <metric>, "<metric>_change"},
    after a first row with layer=None for the unmasked model. Rows of a layer with no alive
    head report the unmasked metrics. The metrics are `task`'s (the run's Task; None: the model's
    head's, read once here).
    """
    task = task_for(model, task)
    for share in shares:
        check_share(share)
    device = mask.mask.device
    base = task.evaluate(model, dataloader, device, max_batches=max_batches)
    rows = [{"layer": None, "share": 0.0, "heads_masked": 0, **base, **{f"{k}_change": 0.0 for k in base}}]
    for layer in range(mask.num_layers):
        for share in shares:
            heads = _weakest(mask, scores, layer, share)
            val = base
            if heads:
                trial = mask.mask.clone()
                trial[layer, heads] = 0.0
                with mask.override(trial):
                    val = task.evaluate(model, dataloader, device, max_batches=max_batches)
            rows.append({"layer": layer, "share": share, "heads_masked": len(heads), **val,
                         **{f"{k}_change": val[k] - base[k] for k in base}})
    return rows


def layer_sensitivity(model: nn.Module, mask: HeadMask, scores: torch.Tensor, dataloader,
                      share: float = 0.5, max_batches: int | None = None, task: Task | None = None) -> list[float]:
    """Loss rise per layer when the `share` lowest-scoring alive heads of that layer are masked."""
    rows = sensitivity_profile(model, mask, scores, dataloader, [share], max_batches, task)
    return [row["loss_change"] for row in rows[1:]]
