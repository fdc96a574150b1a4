"""Per-layer cost tables: what a layer costs when it keeps k units (a head, or under grouped-query
attention a whole KV group), for the cost budgets of `selection.budgets`.

- FLOPs: the layer's attention FLOPs (`costs.flops.attention_flops`: Q/K/V/O products, scores,
  weighted sum) at batch x seq;
- KV bytes: 2 (K and V) x kept KV heads x head_dim x held tokens x batch x bytes per value
  (`costs.kv_bytes`: the one price, which a live cache's count equals); a layer the model itself
  windows (Gemma 3's sliding layers, Mistral's `sliding_window`) holds its window at any longer
  seq (512 tokens for Gemma 3), and its units are priced as that; under
  multi-head latent attention (`heads.latent`) a layer's latent (kv_lora_rank + qk_rope_head_dim
  per token) whatever heads it keeps, 0 once it keeps none (its FLOPs: `latent_attention_flops`);
- per-unit KV modes (`heads.windows`): the same two costs with options (units kept full, units
  windowed): a windowed unit holds min(sink + window, seq) tokens where a full one holds seq,
  so it costs (sink + window) / seq of a full one in KV bytes and in score / weighted-sum FLOPs
  (its projections cost what a full unit's do; the FLOP tables do not count native windows); a
  natively sliding layer's units have no windowed option (`mode_options`): they are already
  windowed, kept full (priced at their window) or removed;
- latency: the measured time of one attention layer with k units (`costs.latency`); the dense
  forward minus every layer's dense attention is the part no head choice changes (`fixed`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from headprune.costs.flops import attention_flops, latent_attention_flops
from headprune.costs.kv_bytes import held_tokens, native_windows, token_bytes, value_bytes
from headprune.heads.adapters import get_adapter, model_shape
from headprune.heads.latent import is_latent


@dataclass
class LayerCosts:
    """cost[l][k]: layer l keeping k units (or, for per-unit KV modes, k = (units full, units
    windowed)); `dense`: the dense model's total (a budget's 100%); `fixed`: what no head choice
    changes (the rest of the forward for latency; 0 otherwise)."""

    cost: list[dict[int | tuple[int, int], float]]
    dense: float
    fixed: float = 0.0
    unit: str = "ms"

    def total(self, kept: list) -> float:
        return self.fixed + sum(self.cost[l][k] for l, k in enumerate(kept))

    def to_json(self) -> dict:
        """A JSON-able form (unit counts become string keys, a (full, windowed) pair "full,windowed");
        `from_json` reads it back."""
        out = asdict(self)
        out["cost"] = [{_key(k): v for k, v in layer.items()} for layer in self.cost]
        return out

    @classmethod
    def from_json(cls, data: dict) -> "LayerCosts":
        return cls([{_option(k): float(v) for k, v in layer.items()} for layer in data["cost"]], float(data["dense"]),
                   float(data.get("fixed", 0.0)), data.get("unit", "ms"))


def _key(option: int | tuple[int, int]) -> str:
    return ",".join(map(str, option)) if isinstance(option, tuple) else str(option)


def _option(key: str) -> int | tuple[int, int]:
    return tuple(int(part) for part in key.split(",")) if "," in key else int(key)


def _dims(model: nn.Module) -> tuple[int, int, int, int, int]:
    """(layers, units per layer, query heads per unit, head_dim, hidden)."""
    adapter, config = get_adapter(model), model.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim")
    return (model_shape(model)[0], adapter.num_kv_heads(config), adapter.group_size(config),
            adapter.head_dim(config), hidden)


def flops_costs(model: nn.Module, batch: int, seq: int) -> LayerCosts:
    n_layers, n_units, group, d, hidden = _dims(model)
    if is_latent(get_adapter(model)):  # MLA: its own products (costs.flops.latent_attention_flops)
        c = model.config
        per = {k: latent_attention_flops(batch, seq, seq, k, hidden, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                                         c.qk_rope_head_dim, c.v_head_dim) for k in range(n_units + 1)}
        return LayerCosts([dict(per) for _ in range(n_layers)], n_layers * per[n_units], unit="FLOPs")
    per = {k: attention_flops(batch, seq, seq, k * group, k, d, hidden) for k in range(n_units + 1)}
    return LayerCosts([dict(per) for _ in range(n_layers)], n_layers * per[n_units], unit="FLOPs")


def kv_costs(model: nn.Module, batch: int, seq: int) -> LayerCosts:
    """KV bytes per kept unit count; for multi-head latent attention (`heads.latent`) a layer's
    latent, the same for every head count but 0 (removing heads saves nothing until a layer has
    none: `heads.latent.latent_kv_note`)."""
    n_layers, n_units, _, d, _ = _dims(model)
    width = value_bytes(model)
    adapter = get_adapter(model)
    if is_latent(adapter):
        latent = adapter.latent_width(model.config) * seq * batch * width
        per = {k: latent if k else 0 for k in range(n_units + 1)}
        return LayerCosts([dict(per) for _ in range(n_layers)], n_layers * latent, unit="bytes")
    cost = [{k: token_bytes(k, d, width) * batch * held_tokens("full", seq, native=native, static=True)
             for k in range(n_units + 1)} for native in native_windows(model.config)]
    return LayerCosts(cost, sum(layer[n_units] for layer in cost), unit="bytes")


def mode_options(n_units: int, native: int | None = None) -> list[tuple[int, int]]:
    """Every (units full, units windowed) a layer of `n_units` units may keep (the rest removed);
    a layer with its own sliding window (`native`, heads.sliding) keeps its units full (already
    windowed by the model) or removes them: no unit of it is windowed again."""
    if native is not None:
        return [(full, 0) for full in range(n_units + 1)]
    return [(full, windowed) for full in range(n_units + 1) for windowed in range(n_units + 1 - full)]


def kv_mode_costs(model: nn.Module, batch: int, seq: int, sink: int, window: int) -> LayerCosts:
    """KV bytes at `seq` tokens per (full, windowed) option: a windowed unit holds min(sink +
    window, seq) tokens, any unit of a natively sliding layer at most its window (`kv_costs` is
    the table without windows)."""
    _refuse_latent_windows(model)
    n_layers, n_units, _, d, _ = _dims(model)
    per_token = token_bytes(1, d, value_bytes(model)) * batch
    cost = []
    for native in native_windows(model.config):
        full = held_tokens("full", seq, native=native, static=True)
        held = held_tokens("window", seq, sink, window, static=True)
        cost.append({(f, w): per_token * (f * full + w * held) for f, w in mode_options(n_units, native)})
    return LayerCosts(cost, sum(layer[(n_units, 0)] for layer in cost), unit="bytes")


def flops_mode_costs(model: nn.Module, batch: int, seq: int, sink: int, window: int) -> LayerCosts:
    """Attention FLOPs at batch x seq per (full, windowed) option: a windowed unit's queries
    score min(sink + window, seq) keys (`flops_costs` is the table without windows)."""
    _refuse_latent_windows(model)
    n_layers, n_units, group, d, hidden = _dims(model)
    held = min(sink + window, seq)
    per = {(f, w): attention_flops(batch, seq, seq, f * group, f, d, hidden)
           + attention_flops(batch, seq, held, w * group, w, d, hidden) for f, w in mode_options(n_units)}
    cost = [{k: c for k, c in per.items() if k in mode_options(n_units, native)}
            for native in native_windows(model.config)]
    return LayerCosts(cost, n_layers * per[(n_units, 0)], unit="FLOPs")


def _refuse_latent_windows(model: nn.Module) -> None:
    if is_latent(get_adapter(model)):
        raise ValueError(f"KV modes with windowed units: model_type={model.config.model_type!r} caches one latent per "
                         "layer shared by all its heads (multi-head latent attention), so a head cannot keep a window "
                         "of it (not done); allowed: kv_modes off (every unit full or removed)")


def latency_costs(model: nn.Module, layer_ms: dict[int, float], forward_ms: float) -> LayerCosts:
    n_layers, n_units = _dims(model)[:2]
    per = {k: layer_ms[k] for k in range(n_units + 1)}
    return LayerCosts([dict(per) for _ in range(n_layers)], forward_ms,
                      fixed=forward_ms - n_layers * per[n_units], unit="ms")
