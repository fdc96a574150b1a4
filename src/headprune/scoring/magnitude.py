"""Weight magnitude: the L2 (Frobenius) norm of the weights that belong to a head.

A head owns D rows of the query projection, D rows of the key and value projections (under
grouped-query attention, the rows of the key/value head its group shares, so the heads of a
group share that part of their score) and D columns of the output projection. The score is
the square root of the summed squared entries of the chosen `parts`. Raw HIGH = KEEP (a head with small weights contributes little); the score is the
raw value. No data is used. Works on physically pruned models: the slices are found from
the heads each layer still holds, in each family's weight layout (the adapter's `head_rows`:
GPT-2's fused `c_attn`, Conv1D weight stored (in, out), included).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from headprune.heads.adapters import PARTS, get_adapter
from headprune.heads.mask import HeadMask
from headprune.scoring.reduce import finish_scores


def head_weight_slices(model: nn.Module, layer: int) -> dict[int, dict[str, torch.Tensor]]:
    """{original head id: {"q"|"k"|"v"|"o": its weight slice}} for the heads `layer` holds
    (Q/K/V as (head_dim, hidden) rows, O as (head_dim, hidden) transposed columns)."""
    rows = get_adapter(model).head_rows(model, layer)
    return {head: {part: r.weight() for part, r in parts.items()} for head, parts in rows.items()}


def magnitude_importance(model: nn.Module, mask: HeadMask, dataloader=None,
                         parts: Sequence[str] = PARTS, max_batches: int | None = None) -> torch.Tensor:
    """(layers, heads) norm of each head's weight slices over `parts`; pruned heads score 0.
    `dataloader` and `max_batches` are accepted for the common signature and ignored."""
    parts = list(parts)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"metric.parts={parts!r} is not allowed; allowed: a non-empty subset of {list(PARTS)}")
    scores = torch.zeros_like(mask.mask, dtype=torch.float64)
    with torch.no_grad():
        for layer in range(mask.num_layers):
            for head, owned in head_weight_slices(model, layer).items():
                scores[layer, head] = sum(owned[p].double().pow(2).sum() for p in parts).sqrt()
    return finish_scores(scores, mask)
