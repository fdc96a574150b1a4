"""Per-layer cost tables: what a layer costs when it keeps k units (a head, or under grouped-query
attention a whole KV group), for the cost budgets of `selection.budgets`.

- FLOPs: the layer's attention FLOPs (`costs.flops.attention_flops`: Q/K/V/O products, scores,
  weighted sum) at batch x seq;
- KV bytes: 2 (K and V) x kept KV heads x head_dim x seq x batch x bytes per value;
- latency: the measured time of one attention layer with k units (`costs.latency`); the dense
  forward minus every layer's dense attention is the part no head choice changes (`fixed`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from headprune.costs.flops import attention_flops
from headprune.heads.adapters import get_adapter, model_shape


@dataclass
class LayerCosts:
    """cost[l][k]: layer l keeping k units; `dense`: the dense model's total (a budget's 100%);
    `fixed`: what no head choice changes (the rest of the forward for latency; 0 otherwise)."""

    cost: list[dict[int, float]]
    dense: float
    fixed: float = 0.0
    unit: str = "ms"

    def total(self, kept: list[int]) -> float:
        return self.fixed + sum(self.cost[l][k] for l, k in enumerate(kept))

    def to_json(self) -> dict:
        """A JSON-able form (unit counts become string keys); `from_json` reads it back."""
        out = asdict(self)
        out["cost"] = [{str(k): v for k, v in layer.items()} for layer in self.cost]
        return out

    @classmethod
    def from_json(cls, data: dict) -> "LayerCosts":
        return cls([{int(k): float(v) for k, v in layer.items()} for layer in data["cost"]], float(data["dense"]),
                   float(data.get("fixed", 0.0)), data.get("unit", "ms"))


def _dims(model: nn.Module) -> tuple[int, int, int, int, int]:
    """(layers, units per layer, query heads per unit, head_dim, hidden)."""
    adapter, config = get_adapter(model), model.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim")
    return (model_shape(model)[0], adapter.num_kv_heads(config), adapter.group_size(config),
            adapter.head_dim(config), hidden)


def flops_costs(model: nn.Module, batch: int, seq: int) -> LayerCosts:
    n_layers, n_units, group, d, hidden = _dims(model)
    per = {k: attention_flops(batch, seq, seq, k * group, k, d, hidden) for k in range(n_units + 1)}
    return LayerCosts([dict(per) for _ in range(n_layers)], n_layers * per[n_units], unit="FLOPs")


def kv_costs(model: nn.Module, batch: int, seq: int) -> LayerCosts:
    n_layers, n_units, _, d, _ = _dims(model)
    width = next(model.parameters()).element_size()
    per = {k: 2 * k * d * seq * batch * width for k in range(n_units + 1)}
    return LayerCosts([dict(per) for _ in range(n_layers)], n_layers * per[n_units], unit="bytes")


def latency_costs(model: nn.Module, layer_ms: dict[int, float], forward_ms: float) -> LayerCosts:
    n_layers, n_units = _dims(model)[:2]
    per = {k: layer_ms[k] for k in range(n_units + 1)}
    return LayerCosts([dict(per) for _ in range(n_layers)], forward_ms,
                      fixed=forward_ms - n_layers * per[n_units], unit="ms")
