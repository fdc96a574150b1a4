"""Weight magnitude: the L2 (Frobenius) norm of the weights that belong to a head.

A head owns D rows of the query projection, D rows of the key and value projections (under
grouped-query attention, the rows of the key/value head its group shares, so the heads of a
group share that part of their score) and D columns of the output projection. The score is
the square root of the summed squared entries of the chosen `parts`. Raw HIGH = KEEP (a head with small weights contributes little); the score is the
raw value. No data is used. Works on physically pruned models: the slices are found from
the heads each layer still holds (`head_layout`), and GPT-2's fused `c_attn` ([Q | K | V],
Conv1D weight stored (in, out)) is split in thirds.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from headprune.heads.adapters import get_adapter, head_layout
from headprune.heads.mask import HeadMask
from headprune.scoring.reduce import finish_scores

PARTS = ("q", "k", "v", "o")


def _out_major(module: nn.Module) -> torch.Tensor:
    """The module's weight as (out_features, in_features); Conv1D stores (in, out)."""
    return module.weight if isinstance(module, nn.Linear) else module.weight.t()


def head_weight_slices(model: nn.Module, layer: int) -> dict[int, dict[str, torch.Tensor]]:
    """{original head id: {"q"|"k"|"v"|"o": its weight slice}} for the heads `layer` holds."""
    adapter = get_adapter(model)
    attn = adapter.attention(adapter.blocks(model)[layer])
    kept = head_layout(model)[layer]
    if not kept:
        return {}
    n, d = len(kept), adapter.head_dim(model.config)
    q_mod, k_mod, v_mod = (attn.get_submodule(p) for p in (adapter.q, adapter.k, adapter.v))
    o = _out_major(attn.get_submodule(adapter.o))  # (E, n * D)
    slices = {}
    if q_mod is k_mod:  # fused [Q | K | V]
        qkv = _out_major(q_mod)  # (3 * n * D, E)
        for pos, head in enumerate(kept):
            rows = [qkv[part * n * d + pos * d: part * n * d + (pos + 1) * d] for part in range(3)]
            slices[head] = dict(zip("qkv", rows), o=o[:, pos * d:(pos + 1) * d])
        return slices
    q, k, v = _out_major(q_mod), _out_major(k_mod), _out_major(v_mod)
    group = adapter.num_heads(model.config) // adapter.num_kv_heads(model.config)  # query heads per KV head
    kv_kept = sorted({h // group for h in kept})  # KV heads the layer holds, in order
    for pos, head in enumerate(kept):
        kv = kv_kept.index(head // group)
        slices[head] = {"q": q[pos * d:(pos + 1) * d], "k": k[kv * d:(kv + 1) * d],
                        "v": v[kv * d:(kv + 1) * d], "o": o[:, pos * d:(pos + 1) * d]}
    return slices


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
