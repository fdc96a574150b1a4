"""Refit error: a unit's importance is the error that refitting the layer's output projection
without it still leaves (SlimGPT, NeurIPS 2024: grouped optimal brain surgeon on the output
projection; the repair is `recovery=refit`).

A layer's attention output is C W + b, with C (tokens x F) the alive heads' concatenated contexts
and W (F x E) their output-projection columns. With H = C^T C centred (the refit fits an
intercept) plus lambda I, lambda = `damp` x mean(diag), removing a block b of columns (a head's
head_dim columns, or under grouped-query attention a KV group's heads at once: `unit=kv_group`)
and refitting the others optimally costs

    err_b = tr(W_b^T (Hinv_bb)^-1 W_b),   Hinv = H^-1,

after which the others' weights move by -Hinv_rb (Hinv_bb)^-1 W_b and Hinv loses b's rows and
columns (Schur complement). Per layer, units are removed greedily one at a time, the cheapest
first, each with the error of removing it after those before it. A unit's score is the largest
such step error up to its own (so scores rise along the greedy order): a layer keeping k units
keeps the last k, a global threshold removes units while their refit error is below it, and under
a cost budget the knapsack's retained value is the greedy path's. A unit's score goes to each of
its alive heads in equal parts (the allocation sums them back). Higher = keep; pruned heads 0.

One forward pass per batch without gradients; memory is one F x F Gram matrix per layer (float64).
The errors are in each layer's output units, as the refit's are.
"""
from __future__ import annotations

import torch
from torch import nn

from headprune.distributed import all_reduce_sum
from headprune.heads.adapters import get_adapter, layer_heads
from headprune.heads.contexts import stream_contexts
from headprune.heads.mask import HeadMask
from headprune.heads.stacks import refuse_several_stacks
from headprune.scoring.reduce import finish_scores

UNITS = ("kv_group", "head")


def refit_error_importance(model: nn.Module, mask: HeadMask, dataloader, unit: str = "kv_group", damp: float = 0.01,
                           max_batches: int | None = None) -> torch.Tensor:
    """(layers, heads) refit error of removing each unit (module docstring); pruned heads 0.
    `unit`: kv_group (under grouped-query attention all query heads of a KV head go together;
    without it a group is one head) or head."""
    if unit not in UNITS:
        raise ValueError(f"metric.unit={unit!r} is not allowed; allowed: {', '.join(UNITS)}")
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp >= 0:
        raise ValueError(f"metric.damp={damp!r} must be a number >= 0")
    from headprune.scoring import stacked_metrics  # the registry imports this module

    refuse_several_stacks(model, "refit_error", "weights each layer's contexts by one sequence's attention mask",
                          stacked_metrics())
    sums = context_grams(model, mask, dataloader, max_batches)
    adapter = get_adapter(model)
    scores = torch.zeros(mask.num_layers, mask.num_heads, dtype=torch.float64)
    for layer, (heads, gram, total, tokens) in enumerate(sums):
        if not heads:
            continue
        rows = adapter.head_rows(model, layer)
        weight = torch.cat([rows[h]["o"].weight().detach().double() for h in heads]).to(gram)  # (F, E)
        groups = adapter.kv_groups(model.config, heads) if unit == "kv_group" else {h: [h] for h in heads}
        d = weight.shape[0] // len(heads)
        blocks = [[heads.index(h) * d + i for h in members for i in range(d)] for members in groups.values()]
        centred = gram - torch.outer(total, total) / max(tokens, 1.0)
        for members, score in zip(groups.values(), greedy_errors(centred, weight, blocks, damp)):
            scores[layer, members] = score / len(members)
    return finish_scores(scores, mask)


def greedy_errors(gram: torch.Tensor, weight: torch.Tensor, blocks: list[list[int]], damp: float) -> list[float]:
    """Per block of columns (indices into gram's F), its score (module docstring): blocks removed
    greedily by err_b = tr(W_b^T (Hinv_bb)^-1 W_b), each score the running maximum of the step
    errors along that order. `gram` (F, F), `weight` (F, E)."""
    f = gram.shape[0]
    lam = damp * float(gram.diagonal().mean()) if f else 0.0
    eye = torch.eye(f, dtype=gram.dtype, device=gram.device)
    inverse = torch.cholesky_inverse(_cholesky(gram + lam * eye))
    w, live = weight.clone(), list(range(len(blocks)))
    where = _positions(f, blocks, live)  # column -> its position in the current (shrinking) system
    out, worst = [0.0] * len(blocks), 0.0
    while live:
        best = None
        for b in live:
            idx = where[blocks[b]]
            sub = inverse[idx][:, idx]
            err = float((w[idx] * torch.linalg.solve(sub, w[idx])).sum())
            if best is None or err < best[1]:
                best = (b, err, idx, sub)
        b, err, idx, sub = best
        worst = max(worst, err)
        out[b] = worst
        live.remove(b)
        keep = torch.ones(inverse.shape[0], dtype=torch.bool)
        keep[idx] = False
        step = inverse[keep][:, idx] @ torch.linalg.inv(sub)  # (r, |b|)
        w = w[keep] - step @ w[idx]
        inverse = inverse[keep][:, keep] - step @ inverse[idx][:, keep]
        where = _positions(f, blocks, live)
    return out


def _positions(f: int, blocks: list[list[int]], live: list[int]) -> torch.Tensor:
    """Column -> position among the columns of the blocks still live (in column order)."""
    alive_cols = sorted(c for b in live for c in blocks[b])
    where = torch.full((f,), -1, dtype=torch.long)
    where[alive_cols] = torch.arange(len(alive_cols))
    return where


def _cholesky(matrix: torch.Tensor) -> torch.Tensor:
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) != 0:  # singular at damp = 0: the smallest jitter that makes it positive definite
        scale = max(float(matrix.diagonal().mean()), 1e-30)
        factor = torch.linalg.cholesky(matrix + 1e-10 * scale * torch.eye(matrix.shape[0], dtype=matrix.dtype))
    return factor


@torch.no_grad()
def context_grams(model: nn.Module, mask: HeadMask, dataloader, max_batches: int | None = None) -> list:
    """Per layer (alive heads in the layer's order, C^T C (F, F), the context sum (F,), tokens):
    the gated contexts of the alive heads over the real tokens of `dataloader`, one forward pass
    per batch ended after the last layer's output-projection input."""
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    device = mask.mask.device
    layouts = [layer_heads(model, layer) for layer in range(len(blocks))]
    alive = [[h for h in kept if float(mask.mask[layer, h]) > 0] for layer, kept in enumerate(layouts)]
    grams = [torch.zeros(len(a) * _width(model), len(a) * _width(model), dtype=torch.float64, device=device)
             for a in alive]
    totals = [torch.zeros(g.shape[0], dtype=torch.float64, device=device) for g in grams]
    last = max((layer for layer, a in enumerate(alive) if a), default=-1)

    def add(layer: int, x: torch.Tensor) -> None:  # x (N, k * D), gated
        positions = [layouts[layer].index(h) for h in alive[layer]]
        x = x.view(x.shape[0], len(layouts[layer]), -1)[:, positions, :].flatten(-2).double()  # (N, F)
        grams[layer].add_(x.T @ x)
        totals[layer].add_(x.sum(0))

    tokens = stream_contexts(model, dataloader, [layer for layer, a in enumerate(alive) if a], add, device,
                             max_batches)
    if last >= 0:
        total = all_reduce_sum(torch.cat([*(g.flatten() for g in grams), *totals, tokens.view(1)]))
        offset = 0
        for part in [*grams, *totals]:
            part.copy_(total[offset:offset + part.numel()].view_as(part))
            offset += part.numel()
        tokens = total[-1]
    if float(tokens) == 0:
        raise ValueError("metric=refit_error got no scoring tokens (data.score_samples=0?)")
    return [(alive[l], grams[l], totals[l], float(tokens)) for l in range(len(blocks))]


def _width(model: nn.Module) -> int:
    return get_adapter(model).head_dim(model.config)


__all__ = ["UNITS", "context_grams", "greedy_errors", "refit_error_importance"]
