"""Head-importance metrics. Every metric is a plain function
`fn(model, mask, dataloader, **options) -> (layers, heads) tensor`, higher = more important,
with pruned heads scored 0 (selection never ranks them again)."""
from __future__ import annotations

from typing import Callable

import torch

from headprune.scoring.taylor import taylor_importance

METRICS: dict[str, Callable[..., torch.Tensor]] = {
    "taylor": taylor_importance,
}


def get_metric(name: str) -> Callable[..., torch.Tensor]:
    if name not in METRICS:
        raise ValueError(f"metric={name!r} is not a known metric; allowed: {', '.join(sorted(METRICS))}")
    return METRICS[name]


def score_heads(model, dataloader, metric: str = "taylor", mask=None, **options) -> torch.Tensor:
    """Score every head of `model` on `dataloader` with the metric called `metric`.

    `mask` is the model's HeadMask if it has one; otherwise a temporary all-ones mask is
    attached for the duration of the call.
    """
    from headprune.heads.mask import HeadMask

    fn = get_metric(metric)
    if mask is not None:
        return fn(model, mask, dataloader, **options)
    device = next(model.parameters()).device
    temp = HeadMask.for_model(model).to(device)
    try:
        return fn(model, temp, dataloader, **options)
    finally:
        temp.detach()
