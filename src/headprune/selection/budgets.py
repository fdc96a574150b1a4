"""Budgets: how much of the dense model a pruned one may cost, in heads, attention FLOPs,
measured latency or KV-cache bytes (`budget=` config group).

`heads` is the count of heads the schedule names, placed by the layer policy (`prune_round`'s
usual path). The cost budgets keep at most `target` of the dense model's cost and choose, per
layer, how many units to keep so that the retained importance is as large as possible
(`selection.knapsack`): a unit is a head, or under grouped-query attention a whole KV group
(the query heads sharing one KV head), so the KV cache shrinks and no group is split. The
layer policy's constraints (`min_heads_per_layer`, `max_prune_per_layer`, protected layers)
bound each layer's choices; `uniform` keeps the same number of units in every layer.

Costs of a layer that keeps k units, for the configured `batch` x `seq`:
- flops: its attention FLOPs (`bench.flops.attention_flops`: Q/K/V/O products, scores, sum);
- kv: its KV-cache bytes, 2 (K and V) x kv heads x head_dim x seq x batch x bytes per value;
- latency: the measured time of one attention layer with k units (`selection.latency`); the
  budget is a share of the whole dense forward, which the layout's prediction is
  forward(dense) - sum over layers of (t(H) - t(k)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from headprune.heads.adapters import get_adapter, model_shape
from headprune.costs.knapsack import best_allocation
from headprune.selection.layer_policies import UniformPolicy

KINDS = ("heads", "flops", "latency", "kv")


@dataclass
class Budget:
    """`budget=` settings. `target`: the share of the dense model's cost to keep (cost kinds only;
    `heads` reads the schedule's target_sparsity). `batch`, `seq`: the shape costs are taken at.
    `cache_dir`: where latency tables are kept (None: ~/.cache/headprune/latency)."""

    kind: str = "heads"
    target: float = 1.0
    batch: int = 32
    seq: int = 128
    warmup: int = 1
    repeats: int = 5
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"budget.kind={self.kind!r} is not allowed; allowed: {', '.join(KINDS)}")
        if self.kind != "heads" and not 0.0 < self.target <= 1.0:
            raise ValueError(f"budget.target={self.target!r} must be in (0, 1]: the share of the dense model's "
                             f"{self.kind} to keep")
        for name in ("batch", "seq", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"budget.{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"budget.warmup={self.warmup} must be >= 0")

    @property
    def counts_heads(self) -> bool:
        return self.kind == "heads"


@dataclass
class LayerCosts:
    """cost[l][k]: layer l keeping k units; `dense`: the dense model's total (the budget's 100%);
    `fixed`: what no head choice changes (the rest of the forward for latency; 0 otherwise)."""

    cost: list[dict[int, float]]
    dense: float
    fixed: float = 0.0
    unit: str = "ms"

    def total(self, kept: list[int]) -> float:
        return self.fixed + sum(self.cost[l][k] for l, k in enumerate(kept))


def layer_costs(model: nn.Module, budget: Budget, latency_table: dict[int, float] | None = None,
                dense_forward: float | None = None) -> LayerCosts:
    """Per-layer costs of keeping 0..U units for a cost budget (see the module docstring)."""
    adapter, config = get_adapter(model), model.config
    n_layers, _ = model_shape(model)
    group = adapter.group_size(config)
    n_units = adapter.num_kv_heads(config)
    d, hidden = adapter.head_dim(config), getattr(config, "hidden_size", None) or getattr(config, "dim")
    if budget.kind == "flops":
        from headprune.costs.flops import attention_flops

        per = {k: attention_flops(budget.batch, budget.seq, budget.seq, k * group, k, d, hidden) for k in range(n_units + 1)}
        return LayerCosts([dict(per) for _ in range(n_layers)], n_layers * per[n_units], unit="FLOPs")
    if budget.kind == "kv":
        width = next(model.parameters()).element_size()
        per = {k: 2 * k * d * budget.seq * budget.batch * width for k in range(n_units + 1)}
        return LayerCosts([dict(per) for _ in range(n_layers)], n_layers * per[n_units], unit="bytes")
    if budget.kind == "latency":
        if latency_table is None or dense_forward is None:
            raise ValueError("a latency budget needs the measured table (selection.latency.latency_table)")
        per = {k: latency_table[k] for k in range(n_units + 1)}
        return LayerCosts([dict(per) for _ in range(n_layers)], dense_forward,
                          fixed=dense_forward - n_layers * per[n_units], unit="ms")
    raise ValueError(f"budget.kind={budget.kind!r} has no per-layer costs (heads are counted, not costed)")


def allocate(scores: torch.Tensor, alive: torch.Tensor, costs: LayerCosts, share: float, policy,
             model_units: list[list[int]], cheapest: bool = False) -> tuple[list[tuple[int, int]], dict]:
    """The heads to prune so that the layout costs at most `share` x `costs.dense` and keeps the
    most importance, within the policy's constraints (`cheapest`: the cheapest layout they allow);
    and a report (kept units per layer, predicted cost and share, retained importance).

    Scores are shifted to be non-negative (keeping a unit never lowers the value: entropy's -H
    and signed LRP score below 0); a unit is worth the sum of its alive heads' scores, and a
    layer keeping k units keeps its k most valuable. `cheapest` keeps the fewest units allowed."""
    n_layers = alive.shape[0]
    shifted = scores - min(float(scores[alive].min()) if bool(alive.any()) else 0.0, 0.0)
    unit_alive = [[u for u, heads in enumerate(model_units) if bool(alive[l, heads].any())] for l in range(n_layers)]
    unit_value = [{u: float(shifted[l, model_units[u]][alive[l, model_units[u]]].sum()) for u in unit_alive[l]}
                  for l in range(n_layers)]
    ranked = [sorted(unit_alive[l], key=lambda u: (-unit_value[l][u], u)) for l in range(n_layers)]
    group = len(model_units[0])
    caps = policy.caps(alive) if hasattr(policy, "caps") else [alive.shape[1]] * n_layers
    choices = [list(range(max(len(unit_alive[l]) - caps[l] // group, 0), len(unit_alive[l]) + 1))
               for l in range(n_layers)]
    value = [{k: sum(unit_value[l][u] for u in ranked[l][:k]) for k in choices[l]} for l in range(n_layers)]
    limit = share * costs.dense - costs.fixed
    if cheapest:  # the fewest units each layer may keep (costs grow with units, up to timing noise)
        kept = [choices[l][0] for l in range(n_layers)]
    elif isinstance(policy, UniformPolicy):  # the same number of units in every layer: the most that fits
        shared = sorted(set.intersection(*(set(c) for c in choices)), reverse=True)
        fits = [k for k in shared if sum(costs.cost[l][k] for l in range(n_layers)) <= limit + 1e-9 * abs(limit)]
        if not fits:
            raise ValueError(f"no layout with the same number of units in every layer costs at most {share:.4f} of "
                             f"the dense {costs.unit}")
        kept = [fits[0]] * n_layers
    else:
        kept, _, _ = best_allocation(choices, value, costs.cost, limit)
    heads = [(l, h) for l in range(n_layers) for u in ranked[l][kept[l]:] for h in model_units[u] if alive[l, h]]
    predicted = costs.total(kept)
    full = sum(value[l][choices[l][-1]] for l in range(n_layers))
    report = {"kept_units_per_layer": kept, "target_share": share, "predicted_cost": predicted,
              "dense_cost": costs.dense, "predicted_share": predicted / costs.dense, "unit": costs.unit,
              "retained_importance": sum(value[l][kept[l]] for l in range(n_layers)) / max(full, 1e-30)}
    return heads, report
