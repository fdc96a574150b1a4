"""Random scores: the baseline every metric must beat.

Each alive head gets an independent U(0, 1) score from a generator seeded with `seed`, so a
run is reproducible and every round of an iterative schedule ranks the survivors the same
way. A high raw value means nothing (neither keep nor prune). No data is used.
"""
from __future__ import annotations

import torch
from torch import nn

from headprune.heads.mask import HeadMask
from headprune.scoring.reduce import finish_scores


def random_importance(model: nn.Module, mask: HeadMask, dataloader=None, seed: int = 0,
                      max_batches: int | None = None) -> torch.Tensor:
    """(layers, heads) seeded uniform scores; pruned heads score 0. `dataloader` and
    `max_batches` are accepted for the common signature and ignored."""
    generator = torch.Generator().manual_seed(int(seed))
    return finish_scores(torch.rand(tuple(mask.mask.shape), generator=generator), mask)
