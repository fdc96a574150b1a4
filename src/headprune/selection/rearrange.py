"""Mask rearrangement (Kwon et al. 2022): which heads of a layer to keep, once the search has said
how many, taking the interactions between the layer's heads into account.

Near a trained model the loss rise from closing the gates of a set P of heads is, to second
order, 1/2 z^T F z with z = 1 on P and 0 elsewhere and F the layer's block of the empirical
Fisher (`scoring.fisher.fisher_blocks`): the sum of F over the pairs of removed heads. Ranking
heads by the diagonal alone ignores the off-diagonal terms (two heads that do the same job each
look dispensable, but not both). Starting from the search's choice, the best swap of a removed
and a kept unit is taken while it lowers the sum, until no swap does: a local optimum that is
never worse than the start.
"""
from __future__ import annotations

import torch


def removal_cost(block: torch.Tensor, removed: list[int]) -> float:
    """1/2 z^T F z for the units in `removed` (the second-order loss rise)."""
    if not removed:
        return 0.0
    index = torch.tensor(removed)
    return 0.5 * float(block[index][:, index].sum())


def rearrange_layer(block: torch.Tensor, candidates: list[int], removed: list[int],
                    max_swaps: int = 1000) -> list[int]:
    """A set of as many units as `removed`, drawn from `candidates` (the units that may go), whose
    removal cost under `block` (U, U) is a local minimum reached by best-improvement swaps."""
    removed, kept = list(removed), [u for u in candidates if u not in removed]
    best = removal_cost(block, removed)
    for _ in range(max_swaps):
        move = None
        for i, out in enumerate(removed):
            for stay in kept:
                trial = removed[:i] + [stay] + removed[i + 1:]
                cost = removal_cost(block, trial)
                if cost < best - 1e-12 * max(1.0, abs(best)) and (move is None or cost < move[0]):
                    move = (cost, i, stay, out)
        if move is None:
            break
        best, i, stay, out = move
        removed[i] = stay
        kept[kept.index(stay)] = out
    return sorted(removed)


def rearrange(blocks: torch.Tensor, heads: list[tuple[int, int]], alive: torch.Tensor,
              units: list[list[int]]) -> list[tuple[int, int]]:
    """`heads` (layer, head) the search chose to remove, rearranged within each layer: the same
    number of units per layer, chosen by the block Fisher. Units are lists of head ids that go
    together (KV groups under GQA); a unit's block is the sum over its heads."""
    chosen = {(l, h) for l, h in heads}
    unit_of = {h: u for u, members in enumerate(units) for h in members}
    member = torch.zeros(len(units), blocks.shape[-1], dtype=blocks.dtype)  # (U, H): which heads form a unit
    for u, members in enumerate(units):
        member[u, members] = 1.0
    out = []
    for layer in range(alive.shape[0]):
        present = [u for u, members in enumerate(units) if any(alive[layer, h] for h in members)]
        removed = sorted({unit_of[h] for l, h in chosen if l == layer})
        if not removed:
            continue
        block = member @ blocks[layer] @ member.T  # (U, U)
        for u in rearrange_layer(block, present, removed):
            out += [(layer, h) for h in units[u] if alive[layer, h]]
    return sorted(out)
