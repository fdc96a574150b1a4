"""How many heads each layer keeps under a cost budget: a multiple-choice knapsack, solved exactly
(and, for per-unit KV modes, how many of its units stay full and how many windowed: `best_modes`).

Every layer l picks one option k in `choices[l]` (how many units it keeps), worth `value[l][k]`
(the retained importance: the sum of its k most important units) and costing `cost[l][k]` (its
attention FLOPs, measured latency, KV bytes, ...). Maximise the total value with total cost <=
`limit` (the part of a budget that head choices control; it may be below zero when the fixed
part of a forward alone exceeds the budget, and then no allocation fits). Per-layer cost is not linear in k (a layer's latency has a fixed part, and a layer with
no heads left saves it), so a greedy sort is not enough; the dynamic programme below keeps, after
each layer, the Pareto frontier of (cost, value) pairs of the layers so far: no pair on it is both
dearer and worth less than another, and the optimum extends a frontier pair. Exact, and small for
transformer shapes (tens of layers, tens of choices each).
"""
from __future__ import annotations

from collections.abc import Sequence


def best_allocation(choices: Sequence[Sequence[int]], value: Sequence[dict], cost: Sequence[dict],
                    limit: float) -> tuple[list[int], float, float]:
    """(k per layer, total value, total cost) of the most valuable allocation costing <= `limit`
    (ties: the cheaper one). Raises ValueError when even the cheapest allocation is too dear."""
    frontier: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]  # (cost, value, picks)
    for layer, options in enumerate(choices):
        if not options:
            raise ValueError(f"layer {layer} has no allowed number of heads")
        grown = [(c + cost[layer][k], v + value[layer][k], picks + (k,))
                 for c, v, picks in frontier for k in options]
        frontier = _pareto(grown, limit)
        if not frontier:
            cheapest = sum(min(cost[l][k] for k in choices[l]) for l in range(len(choices)))
            raise ValueError(f"no allocation of heads costs at most {limit:.6g}: the cheapest one the constraints "
                             f"allow costs {cheapest:.6g}")
    total_cost, total_value, picks = max(frontier, key=lambda t: (t[1], -t[0]))
    return list(picks), total_value, total_cost


def _pareto(points: list[tuple[float, float, tuple[int, ...]]], limit: float) -> list:
    """The pairs within `limit` that no other pair beats in both cost and value (ascending cost)."""
    eps = 1e-12 * max(1.0, abs(limit))
    out = []
    best_value = float("-inf")
    for point in sorted(points, key=lambda t: (t[0], -t[1])):
        if point[0] > limit + eps:
            break
        if point[1] > best_value:
            out.append(point)
            best_value = point[1]
    return out


def mode_values(full: Sequence[float], window: Sequence[float]) -> dict[tuple[int, int], tuple[float, tuple[str, ...]]]:
    """{(units full, units windowed): (value, modes)} of one layer: the most valuable assignment of
    that many of its units to `full` and `window` (the rest `removed`, worth 0), unit u worth
    `full[u]` kept full and `window[u]` windowed. A dynamic programme over the units (an
    assignment problem; sorting by one value alone is wrong when the two rankings differ)."""
    if len(full) != len(window):
        raise ValueError(f"{len(full)} full values but {len(window)} window values: one of each per unit")
    best: dict[tuple[int, int], tuple[float, tuple[str, ...]]] = {(0, 0): (0.0, ())}
    for f_u, w_u in zip(full, window):
        grown: dict[tuple[int, int], tuple[float, tuple[str, ...]]] = {}
        for (nf, nw), (v, modes) in best.items():
            for key, value, mode in (((nf + 1, nw), v + f_u, "full"), ((nf, nw + 1), v + w_u, "window"),
                                     ((nf, nw), v, "removed")):
                if key not in grown or value > grown[key][0]:
                    grown[key] = (value, modes + (mode,))
        best = grown
    return best


def best_modes(full: Sequence[Sequence[float]], window: Sequence[Sequence[float]], cost: Sequence[dict],
               limit: float, choices: Sequence[Sequence[tuple[int, int]]] | None = None
               ) -> tuple[list[tuple[str, ...]], float, float]:
    """(modes per layer, total value, total cost) of the most valuable per-unit KV modes costing
    <= `limit`: each layer picks an option (units full, units windowed) among `choices[l]` (every
    option of `cost[l]` by default) at `cost[l][option]`, worth its best assignment
    (`mode_values`), by the multiple-choice knapsack above. Raises ValueError when nothing fits."""
    values = [mode_values(f, w) for f, w in zip(full, window, strict=True)]
    if len(cost) != len(values):
        raise ValueError(f"{len(values)} layers of unit values but {len(cost)} layers of costs")
    choices = choices if choices is not None else [sorted(c) for c in cost]
    value = [{option: values[l][option][0] for option in choices[l]} for l in range(len(values))]
    picks, total_value, total_cost = best_allocation(choices, value, cost, limit)
    return [values[l][option][1] for l, option in enumerate(picks)], total_value, total_cost
