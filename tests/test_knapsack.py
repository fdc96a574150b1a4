"""The budget allocation is exact: it matches brute force on small problems."""
import itertools
import random

import pytest

from headprune.costs.knapsack import best_allocation


def _brute(choices, value, cost, limit):
    best = None
    for picks in itertools.product(*choices):
        c = sum(cost[l][k] for l, k in enumerate(picks))
        v = sum(value[l][k] for l, k in enumerate(picks))
        if c <= limit + 1e-9 and (best is None or (v, -c) > (best[1], -best[2])):
            best = (list(picks), v, c)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    layers, heads = rng.randint(1, 4), rng.randint(1, 5)
    choices = [list(range(rng.randint(0, 1), heads + 1)) for _ in range(layers)]
    value, cost = [], []
    for _ in range(layers):
        gains = sorted((rng.random() for _ in range(heads)), reverse=True)
        value.append({k: sum(gains[:k]) for k in range(heads + 1)})
        fixed = rng.random()  # a layer with heads pays a fixed part; with none it saves it
        cost.append({k: (fixed + sum(rng.random() for _ in range(k)) if k else 0.0) for k in range(heads + 1)})
    full = sum(cost[l][max(choices[l])] for l in range(layers))
    limit = rng.uniform(0.3, 1.0) * full
    try:
        got = best_allocation(choices, value, cost, limit)
    except ValueError:
        assert _brute(choices, value, cost, limit) is None
        return
    want = _brute(choices, value, cost, limit)
    assert got[1] == pytest.approx(want[1]) and got[2] <= limit + 1e-9


def test_a_nonlinear_cost_beats_the_greedy_sort():
    """Two layers of two heads; a layer that keeps any head pays a fixed 5. Limit 7: keeping the
    two best heads of one layer (5 + 1 + 1) is worth more than one head in each (5 + 1 + 5 + 1 > 7)."""
    value = [{0: 0.0, 1: 3.0, 2: 5.0}, {0: 0.0, 1: 4.0, 2: 4.5}]
    cost = [{0: 0.0, 1: 6.0, 2: 7.0}, {0: 0.0, 1: 6.0, 2: 7.0}]
    picks, v, c = best_allocation([[0, 1, 2], [0, 1, 2]], value, cost, limit=7.0)
    assert picks == [2, 0] and v == 5.0 and c == 7.0
    with pytest.raises(ValueError, match=r"no allocation of heads costs at most 3.*cheapest one .* costs 6"):
        best_allocation([[1, 2], [0, 1, 2]], value, cost, limit=3.0)
