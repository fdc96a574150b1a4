"""Layer policies: given importance scores and a number of heads to prune, pick which heads.

Pure functions `policy(scores, alive, n_prune, **options) -> list[(layer, head)]`:
`scores` is (layers, heads), higher = more important; `alive` is the bool keep-mask. Heads
already pruned are never chosen again. Each policy prunes exactly `n_prune` heads, or raises
a ValueError that explains why the constraints make that impossible.
"""
from __future__ import annotations

import torch


def _check(scores: torch.Tensor, alive: torch.Tensor, n_prune: int, min_heads_per_layer: int) -> None:
    if scores.shape != alive.shape:
        raise ValueError(f"scores shape {tuple(scores.shape)} != mask shape {tuple(alive.shape)}")
    if min_heads_per_layer < 0:
        raise ValueError(f"layer_policy.min_heads_per_layer={min_heads_per_layer} must be >= 0")
    available = int((alive.sum(dim=1) - min_heads_per_layer).clamp_min(0).sum())
    if n_prune > available:
        raise ValueError(
            f"cannot prune {n_prune} heads: only {available} can go while keeping "
            f"layer_policy.min_heads_per_layer={min_heads_per_layer} heads in every layer "
            f"(alive per layer: {alive.sum(dim=1).tolist()})"
        )


def layer_normalized(scores: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """Scores divided by the L2 norm of their layer's alive heads."""
    s = torch.where(alive, scores, torch.zeros_like(scores))
    return s / s.norm(dim=1, keepdim=True).clamp_min(1e-20)


def global_policy(scores: torch.Tensor, alive: torch.Tensor, n_prune: int,
                  min_heads_per_layer: int = 1, normalize: bool = False) -> list[tuple[int, int]]:
    """Rank all alive heads together and prune the lowest, skipping layers at their minimum."""
    _check(scores, alive, n_prune, min_heads_per_layer)
    if normalize:
        scores = layer_normalized(scores, alive)
    left = alive.sum(dim=1).tolist()
    order = sorted(((float(scores[l, h]), l, h) for l, h in alive.nonzero().tolist()))
    chosen = []
    for _, layer, head in order:
        if len(chosen) == n_prune:
            break
        if left[layer] > min_heads_per_layer:
            chosen.append((layer, head))
            left[layer] -= 1
    return chosen


def uniform_policy(scores: torch.Tensor, alive: torch.Tensor, n_prune: int,
                   min_heads_per_layer: int = 1) -> list[tuple[int, int]]:
    """Keep the same share of heads in every layer: each pick goes to the layer that has lost the
    fewest heads so far (ties: the layer whose weakest head scores lowest), and takes that
    layer's lowest-scoring alive head."""
    _check(scores, alive, n_prune, min_heads_per_layer)
    n_heads = alive.shape[1]
    alive = alive.clone()
    chosen = []
    for _ in range(n_prune):
        best = None
        for layer in range(alive.shape[0]):
            left = int(alive[layer].sum())
            if left <= min_heads_per_layer:
                continue
            heads = alive[layer].nonzero().flatten().tolist()
            head = min(heads, key=lambda h: (float(scores[layer, h]), h))
            key = (n_heads - left, float(scores[layer, head]), layer)
            if best is None or key < best[0]:
                best = (key, layer, head)
        _, layer, head = best
        alive[layer, head] = False
        chosen.append((layer, head))
    return chosen


LAYER_POLICIES = {"global": global_policy, "uniform": uniform_policy}
