"""Budgets: how much of the dense model a pruned one may cost, in heads, attention FLOPs,
measured latency or KV-cache bytes (`budget=` config group, one class per kind).

`heads` counts heads: the schedule's target_sparsity is the share removed, placed by the layer
policy. The cost budgets keep at most `target` of the dense model's cost and choose, per layer,
how many units to keep so that the retained importance is as large as possible
(`costs.knapsack`): a unit is a head, or under grouped-query attention a whole KV group (the
query heads sharing one KV head), so the KV cache shrinks and no group is split. The layer
policy's constraints (`min_heads_per_layer`, `max_prune_per_layer`, protected layers) bound each
layer's choices, its `unit_scores` are what a unit is worth, and a policy with
`same_units_per_layer` keeps the same number of units in every layer. At least one unit is kept
in the whole model. Each budget owns its cost table (`costs.tables`) and says, per round, how
much may remain (`goal`): the one place that computes how far a round prunes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import nn

from headprune.costs.knapsack import best_allocation, best_modes
from headprune.costs.kv_bytes import held_tokens, native_windows
from headprune.costs.tables import LayerCosts, flops_costs, flops_mode_costs, kv_costs, kv_mode_costs, latency_costs
from headprune.heads.adapters import model_shape
from headprune.heads.windows import REMOVED, KVLayout
from headprune.tasks import CAUSAL_LM, Task, max_positions, task_for


@dataclass(frozen=True)
class Goal:
    """What one round must reach: `n_prune` more heads (heads budget), or keep at most `share`
    of the dense cost (`costs`: the cost table)."""

    n_prune: int = 0
    share: float | None = None
    costs: LayerCosts | None = None


@dataclass
class Budget:
    """`budget=heads`: the schedule's target_sparsity, counted in heads."""

    kind: ClassVar[str] = "heads"
    counts_heads: ClassVar[bool] = True
    needs_dense: ClassVar[bool] = False  # the unpruned model is needed after the first round
    reports: ClassVar[tuple[str, ...]] = ()  # what `after_export` adds to results.json `final`

    def describe(self, schedule) -> str:
        """What the rounds aim at, for the log."""
        return f"head sparsities {schedule.sparsities()}"

    def after_export(self, dense: nn.Module | None, exported: nn.Module, rounds: list[dict]) -> dict:
        """Measurements of the exported model for results.json `final` ({}: none)."""
        return {}

    def record(self) -> dict:
        """The settings as results.json `budget` shows them."""
        return {"kind": self.kind, **{k: v for k, v in vars(self).items()}}

    def check(self, schedule, layer_policy) -> None:
        """Refuse, before anything runs, settings this budget would silently ignore."""
        if getattr(layer_policy, "measures_layout", False):
            raise ValueError(f"layer_policy={layer_policy.name} allocates a cost budget and cannot place a number of "
                             "heads (budget=heads); allowed: budget=kv, flops or latency")

    def check_model(self, model: nn.Module, schedule, task: Task | None = None) -> None:
        """Refuse, before any work, a model this budget cannot price (`task`: the run's Task; None:
        the model's head's)."""
        layers, heads = model_shape(model)
        schedule.check_model(layers * heads)

    def measure(self, dense: nn.Module) -> tuple[LayerCosts | None, dict]:
        """(cost table, what to record) on the unpruned model; heads have none."""
        return None, {}

    def goal(self, schedule, k: int, alive: torch.Tensor, costs: LayerCosts | None) -> Goal:
        return Goal(n_prune=schedule.heads_to_prune(k, alive))


@dataclass
class CostBudget(Budget):
    """Keep at most `target` of the dense model's cost, at `batch` x `seq`."""

    target: float = 0.5
    batch: int = 32
    seq: int = 128

    counts_heads: ClassVar[bool] = False
    unit: ClassVar[str] = ""
    seq_matters: ClassVar[bool] = True  # the layout kept depends on seq (not so for KV bytes)

    def __post_init__(self) -> None:
        if isinstance(self.target, bool) or not isinstance(self.target, (int, float)) or not 0.0 < self.target <= 1.0:
            raise ValueError(f"budget.target={self.target!r} must be in (0, 1]: the share of the dense model's "
                             f"{self.kind} to keep")
        for name in ("batch", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"budget.{name}={getattr(self, name)} must be >= 1")

    def check(self, schedule, layer_policy) -> None:
        if not schedule.sparsities():
            raise ValueError(f"budget={self.kind} with schedule.target_sparsity=0 plans no round, so nothing would be "
                             f"pruned; under a cost budget the schedule's sparsities only spread budget.target over its "
                             f"rounds: allowed: schedule.target_sparsity > 0")
        if schedule.can_reject:
            raise ValueError(f"budget={self.kind} with schedule=until_threshold is not supported: the threshold stops "
                             "by accuracy, the budget by cost; allowed: schedule=one_shot, iterative or cubic")
        if layer_policy.needs_sensitivity:
            raise ValueError(f"layer_policy=sensitivity with budget={self.kind} is not supported: the allocation keeps, "
                             f"per layer, the units worth most under the {self.kind} budget and would measure the "
                             "sensitivity profile only to ignore it; allowed: layer_policy=global, uniform or depth_prior")

    def check_model(self, model: nn.Module, schedule, task: Task | None = None) -> None:
        positions = max_positions(model.config)
        if self.seq_matters and positions and self.seq > positions:
            raise ValueError(f"budget.seq={self.seq} exceeds the model's {positions} positions; allowed: at most "
                             f"{positions}")

    def describe(self, schedule) -> str:
        s = schedule.sparsities()
        shares = [round(1.0 - (1.0 - self.target) * x / s[-1], 4) for x in s] if s else []
        return f"{self.target} of the dense {self.kind} (kept per round: {shares})"

    def table(self, dense: nn.Module) -> LayerCosts:
        raise NotImplementedError

    def measure(self, dense: nn.Module) -> tuple[LayerCosts, dict]:
        return self.table(dense), {}

    def cost_share(self, costs: LayerCosts, alive: torch.Tensor, model_units: list[list[int]]) -> float:
        """The kept layout's cost as a share of the dense model's, at this budget's batch and seq
        (results.json `final.cost_share`): a layer keeps every unit with a head alive."""
        kept = [sum(bool(alive[l, heads].any()) for heads in model_units) for l in range(alive.shape[0])]
        return costs.total(kept) / costs.dense

    def goal(self, schedule, k: int, alive: torch.Tensor, costs: LayerCosts | None) -> Goal:
        """Round k keeps at most 1 - (1 - target) x s_k / s_last of the dense cost, s the
        schedule's sparsities (the last round: `target` exactly)."""
        s = schedule.sparsities()
        share = self.target if k == len(s) - 1 else 1.0 - (1.0 - self.target) * s[k] / s[-1]
        return Goal(share=share, costs=costs)


@dataclass
class FlopsBudget(CostBudget):
    """`budget=flops`: attention FLOPs (Q/K/V/O products, scores, weighted sum)."""

    kind: ClassVar[str] = "flops"

    def table(self, dense):
        return flops_costs(dense, self.batch, self.seq)

    def mode_table(self, dense: nn.Module, sink: int, window: int) -> LayerCosts:
        """The table with per-unit KV modes: options (units full, units windowed) of each layer."""
        return flops_mode_costs(dense, self.batch, self.seq, sink, window)


@dataclass
class KVBudget(CostBudget):
    """`budget=kv`: KV-cache bytes, for decoders, counted at a context of `seq` tokens (batch x seq
    only scale the bytes of full units; a windowed unit's share depends on seq: `mode_table`)."""

    batch: int = 1
    seq: int = 1024
    kind: ClassVar[str] = "kv"
    seq_matters: ClassVar[bool] = False

    def check_model(self, model, schedule, task: Task | None = None) -> None:
        if task_for(model, task) is not CAUSAL_LM:
            raise ValueError(f"budget=kv keeps a share of the KV cache, which only a decoder (model.task=causal_lm) has; "
                             f"{type(model).__name__} keeps no cache: allowed: budget=heads, flops or latency")

    def table(self, dense):
        return kv_costs(dense, self.batch, self.seq)

    def measure(self, dense: nn.Module) -> tuple[LayerCosts, dict]:
        """The table, and for multi-head latent attention (heads.latent) the note that removing heads
        saves KV bytes only where a layer loses them all (logged, and in results.json `budget.kv_note`);
        a model that windows some layers itself (Gemma 3's sliding layers, Mistral's sliding_window)
        gets them reported (results.json `budget.native_windows`: layer -> tokens held at `seq`),
        priced as already windowed (costs.kv_bytes)."""
        from headprune.heads.adapters import get_adapter
        from headprune.heads.latent import is_latent, latent_kv_note

        if is_latent(get_adapter(dense)):
            note = latent_kv_note(dense.config.model_type)
            logging.getLogger(__name__).warning("budget=kv: %s", note)
            return self.table(dense), {"kv_note": note}
        native = {l: held_tokens("full", self.seq, native=w, static=True)
                  for l, w in enumerate(native_windows(dense.config)) if w is not None}
        if not native:
            return self.table(dense), {}
        logging.getLogger(__name__).info("budget=kv at seq %d: %d layers are windowed by the model itself and priced "
                                         "as the tokens they hold: %s", self.seq, len(native), native)
        return self.table(dense), {"native_windows": {str(l): n for l, n in native.items()}}

    def mode_table(self, dense: nn.Module, sink: int, window: int) -> LayerCosts:
        """The table with per-unit KV modes: options (units full, units windowed) of each layer, a
        windowed unit costing min(sink + window, seq) / seq of a full one."""
        return kv_mode_costs(dense, self.batch, self.seq, sink, window)


@dataclass
class LatencyBudget(CostBudget):
    """`budget=latency`: the forward latency measured on this machine (`costs.latency`); the
    table is cached under `cache_dir` (None: ~/.cache/headprune/latency)."""

    target: float = 0.7
    warmup: int = 1
    repeats: int = 5
    cache_dir: Optional[str] = None
    kind: ClassVar[str] = "latency"
    needs_dense: ClassVar[bool] = True  # the export's latency is measured against it
    reports: ClassVar[tuple[str, ...]] = ("latency",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.repeats < 1:
            raise ValueError(f"budget.repeats={self.repeats} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"budget.warmup={self.warmup} must be >= 0")

    def measure(self, dense):
        from headprune.costs.latency import latency_table

        table = latency_table(dense, self.batch, self.seq, self.cache_dir, self.warmup, self.repeats)
        info = {"latency_table": {k: round(v, 4) for k, v in table["layer_ms"].items()},
                "dense_forward_ms": table["forward_ms"], "table_cached": table["cached"], "table_path": table["path"],
                "table_seconds": round(table["seconds"], 3)}
        return latency_costs(dense, table["layer_ms"], table["forward_ms"]), info

    def after_export(self, dense, exported, rounds):
        """The exported model's forward latency against the dense model's, measured together."""
        from headprune.costs.latency import measured_latency

        return {"latency": measured_latency(dense, exported, self, rounds)} if dense is not None else {}


BUDGETS: dict[str, type[Budget]] = {"heads": Budget, "flops": FlopsBudget, "kv": KVBudget, "latency": LatencyBudget}


def make_budget(budget: Budget | dict | None) -> Budget:
    """A Budget from itself, None (heads) or its fields with `kind` ({"kind": "kv", "target": 0.5})."""
    if budget is None:
        return Budget()
    if isinstance(budget, Budget):
        return budget
    fields = dict(budget)
    kind = fields.pop("kind", "heads")
    if kind not in BUDGETS:
        raise ValueError(f"budget kind={kind!r} is not allowed; allowed: {', '.join(BUDGETS)}")
    return BUDGETS[kind](**fields)


def allocate(scores: torch.Tensor, alive: torch.Tensor, costs: LayerCosts, share: float, layer_policy,
             model_units: list[list[int]], cheapest: bool = False) -> tuple[list[tuple[int, int]], dict]:
    """The heads to prune so that the layout costs at most `share` x `costs.dense` and keeps the
    most importance, within the policy's constraints (`cheapest`: the cheapest layout they allow);
    and a report (kept units per layer, predicted cost and share, retained importance).

    Scores are the policy's `unit_scores`, shifted to be non-negative (keeping a unit never lowers
    the value: entropy's -H and signed LRP score below 0); a unit is worth the sum of its alive
    heads' scores, and a layer keeping k units keeps its k most valuable. At least one unit stays
    in the model. Raises ValueError when no layout fits."""
    n_layers = alive.shape[0]
    plan = unit_plan(scores, alive, layer_policy, model_units)
    choices, value = plan.choices, plan.value
    kept = kept_units(choices, value, costs, cost_limit(costs, share), layer_policy, cheapest, share)
    heads = plan.heads(kept, alive, model_units)
    predicted = costs.total(kept)
    full = sum(value[l][choices[l][-1]] for l in range(n_layers))
    report = {"kept_units_per_layer": kept, "target_share": share, "predicted_cost": predicted,
              "dense_cost": costs.dense, "predicted_share": predicted / costs.dense, "unit": costs.unit,
              "retained_importance": sum(value[l][kept[l]] for l in range(n_layers)) / max(full, 1e-30)}
    return heads, report


def allocate_modes(full: list[list[float]], window: list[list[float]], costs: LayerCosts, share: float, sink: int,
                   window_tokens: int, choices: list[list[tuple[int, int]]] | None = None) -> tuple[KVLayout, dict]:
    """The per-unit KV modes worth most within `share` of `costs.dense` (`costs`: a `mode_table`
    of the same sink and window), unit u of layer l worth `full[l][u]` kept full and
    `window[l][u]` windowed (removed: 0); and a report (modes, (full, windowed) per layer,
    predicted cost and share, retained value). `choices[l]`: the options (units full, units
    windowed) layer l may take (None: every option of its table; a layer policy's caps bound
    the units removed). At least one unit stays in the model; raises ValueError when no layout
    fits."""
    if not all(isinstance(k, tuple) for layer in costs.cost for k in layer):
        raise ValueError("allocate_modes needs a KV mode cost table (options (units full, units windowed)): "
                         "KVBudget.mode_table or FlopsBudget.mode_table")
    try:
        modes, value, cost = best_modes(full, window, costs.cost, cost_limit(costs, share), choices)
    except ValueError as err:
        raise ValueError(f"no layout of full, windowed and removed units costs at most {share:.4f} of the dense "
                         f"{costs.unit}: {err}") from err
    if all(m == REMOVED for layer in modes for m in layer):
        raise ValueError(f"only a layout without any unit fits {share:.4f} of the dense {costs.unit}, and at least one "
                         "unit must remain")
    layout = KVLayout(tuple(modes), sink, window_tokens)
    best = sum(max(f, w, 0.0) for fs, ws in zip(full, window) for f, w in zip(fs, ws))
    report = {"modes": [list(layer) for layer in modes], "options": [list(o) for o in layout.options()],
              "target_share": share, "predicted_cost": cost, "dense_cost": costs.dense,
              "predicted_share": cost / costs.dense, "unit": costs.unit,
              "retained_value": value / best if best > 0 else 1.0}
    return layout, report


@dataclass
class UnitPlan:
    """Per layer: its alive units, most valuable first (`ranked`: unit ids of `model_units`), the
    numbers of them it may keep under the policy's constraints (`choices`), and what keeping k
    is worth by the scores (`value[l][k]`: the sum of its k most valuable units)."""

    ranked: list[list[int]]
    choices: list[list[int]]
    value: list[dict[int, float]]

    def heads(self, kept: list[int], alive: torch.Tensor, model_units: list[list[int]]) -> list[tuple[int, int]]:
        """The alive heads of the units each layer does not keep (layer l keeps its `kept[l]` best)."""
        return [(l, h) for l, units in enumerate(self.ranked) for u in units[kept[l]:] for h in model_units[u]
                if alive[l, h]]


def unit_plan(scores: torch.Tensor, alive: torch.Tensor, layer_policy, model_units: list[list[int]]) -> UnitPlan:
    """The units of each layer ranked by the policy's `unit_scores` (shifted to be non-negative),
    and the choices its `caps` allow (`allocate`'s docstring)."""
    n_layers = alive.shape[0]
    ranked_scores = layer_policy.unit_scores(scores, alive)
    shifted = ranked_scores - min(float(ranked_scores[alive].min()) if bool(alive.any()) else 0.0, 0.0)
    unit_alive = [[u for u, heads in enumerate(model_units) if bool(alive[l, heads].any())] for l in range(n_layers)]
    unit_value = [{u: float(shifted[l, model_units[u]][alive[l, model_units[u]]].sum()) for u in unit_alive[l]}
                  for l in range(n_layers)]
    ranked = [sorted(unit_alive[l], key=lambda u: (-unit_value[l][u], u)) for l in range(n_layers)]
    group = len(model_units[0])
    caps = layer_policy.caps(alive)
    choices = [list(range(max(len(unit_alive[l]) - caps[l] // group, 0), len(unit_alive[l]) + 1))
               for l in range(n_layers)]
    value = [{k: sum(unit_value[l][u] for u in ranked[l][:k]) for k in choices[l]} for l in range(n_layers)]
    return UnitPlan(ranked, choices, value)


def cost_limit(costs: LayerCosts, share: float) -> float:
    """What the layers' summed costs may reach when the layout keeps `share` of the dense cost."""
    return share * costs.dense - costs.fixed


def kept_units(choices, value, costs: LayerCosts, limit: float, layer_policy, cheapest: bool,
               share: float) -> list[int]:
    """Units kept per layer: the most valuable layout within `limit` (module docstring)."""
    n_layers = len(choices)
    if layer_policy.same_units_per_layer:  # the same number of units in every layer: the most that fits
        shared = sorted(set.intersection(*(set(c) for c in choices)) - {0}, reverse=True)
        if cheapest:
            return [shared[-1] if shared else choices[0][0]] * n_layers
        fits = [k for k in shared if sum(costs.cost[l][k] for l in range(n_layers)) <= limit + 1e-9 * abs(limit)]
        if not fits:
            raise ValueError(f"no layout with the same number of units in every layer costs at most {share:.4f} of "
                             f"the dense {costs.unit}")
        return [fits[0]] * n_layers
    if cheapest:  # the fewest units each layer may keep (costs grow with units, up to timing noise)
        kept = [c[0] for c in choices]
        return kept if sum(kept) else _one_unit(choices, costs)
    kept, _, _ = best_allocation(choices, value, costs.cost, limit)
    if sum(kept):
        return kept
    # every layer chose none: the best layout keeping one unit somewhere, if one fits
    options = []
    for l in range(n_layers):
        forced = [c if i != l else [k for k in c if k > 0] for i, c in enumerate(choices)]
        if forced[l]:
            try:
                options.append(best_allocation(forced, value, costs.cost, limit))
            except ValueError:
                pass
    if not options:
        raise ValueError(f"only a layout without any head fits {share:.4f} of the dense {costs.unit}, and at least one "
                         "head must remain")
    return max(options, key=lambda t: (t[1], -t[2]))[0]


def _one_unit(choices, costs: LayerCosts) -> list[int]:
    """The cheapest layout keeping exactly one unit (in the layer where one costs least)."""
    options = [l for l, c in enumerate(choices) if any(k > 0 for k in c)]
    if not options:
        raise ValueError("the layer policy's constraints leave no head that may be kept")
    best = min(options, key=lambda l: costs.cost[l][min(k for k in choices[l] if k > 0)] - costs.cost[l][choices[l][0]])
    return [min(k for k in c if k > 0) if l == best else c[0] for l, c in enumerate(choices)]
