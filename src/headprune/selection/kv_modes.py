"""Choosing per-unit KV modes (`kv_modes=` config group, issue 40): each KV group (GQA) or head
(MHA) of each layer is kept `full`, restricted to `sink` + `window` tokens (`window`) or
`removed` (`heads.windows.KVLayout`), the layout worth most within the budget's share of a KV
mode cost table (`budget.mode_table`: a windowed unit costs (sink + window) / seq of a full one
at the budget's seq) by the three-way knapsack (`selection.budgets.allocate_modes`).

KV modes are a strategy of the normal round (`selection.rounds.prune_round`): the metric scores
the heads (only when the choice reads the scores: `KVModes.reads_scores`), then `KVModes.choose`
is the allocation step (what each unit is worth full and windowed, by the valuation `choice` names
in `selection.valuations`: `measured`, `attention_mass`, `retrieval` or one registered; the
knapsack on the mode table), the round masks the layout's removed units and attaches its windows.
The Pruner asks it for the cost table (`measure`) and the final record (`final_record`), so the
same calls serve a run with and without KV modes (`none`: the budget's own table and allocation).

- `given`: no choice. The layout of an earlier run (`selection.given_layout`: read from
  `kv_modes.layout`, checked before any work against the model's shape, the window sizes set
  here, the budget and the layer policy's caps); no valuation, the knapsack does not run.

`granularity=layer` keeps a layer's kept units all full or all windowed (the per-layer sliding
windows engines serve): the knapsack's options per layer are filtered, and a windowed layer is
worth the sum of its units' windowed values.

The layer policy's caps bound the removed units per layer (windows are not removal); its
`unit_scores` are what `attention_mass` reads. `removal=last` removes no unit when every unit
windowed fits the budget (the knapsack then chooses only between full and windowed): the two
values come from different scales (a metric's unit score, a share of attention) or from
single-unit probes that do not add up, and removing a unit the scale calls cheap can cost far more
than windowing it (experiments/llm_kv_modes); with `any` the knapsack weighs all three.

A run with kv modes is one round without epochs and without a reconstruction (refused otherwise,
before any work: `check`). It may train a step budget after the choice (a recovery whose
`follows_kv_modes()` holds: `recovery=distill|lora` with `recovery.steps > 0`, the KL steps of LLM
runs): the windows are attached by then, so every step's student forward is the windowed model's
and the weights adapt to the layout the export keeps; a killed run resumes in those steps (the
checkpoint carries the layout). A repair that solves against the dense model (refit, least
squares, bias compensation) would have to see the windows in its least-squares targets and is
refused.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from headprune.costs.tables import LayerCosts
from headprune.heads.adapters import model_shape
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import kv_group_heads
from headprune.heads.windows import FULL, KERNELS, KV_LAYOUT_ATTR, REMOVED, WINDOW, KVLayout
from headprune.selection.given_layout import given_report, read_kv_layout
from headprune.selection.measured import first_sequences
from headprune.selection.valuations import SETTINGS, VALUATIONS, get_valuation, readers, value_units
from headprune.tasks import CAUSAL_LM, Task, max_positions, task_for

log = logging.getLogger(__name__)
GIVEN = "given"
REMOVALS = ("any", "last")
GRANULARITIES = ("unit", "layer")
UNIT_VALUES = ("metric", "uniform")
__all__ = ["KVModes", "choices", "read_kv_layout", "mode_choices", "all_windowed_fits", "unit_values",
           "calibration_batches", "cost_share"]


def choices() -> tuple[str, ...]:
    """Every kv_modes choice: none, the registered valuations, given."""
    return ("none", *VALUATIONS, GIVEN)


@dataclass
class KVModes:
    """`kv_modes:` settings. `choice`: none (removal only, the budget's own allocation), a
    valuation's name (`selection.valuations`: measured, attention_mass, retrieval) or given (module
    docstring); `sink` + `window`: what a windowed unit keeps;
    `samples`: calibration blocks measured on (null: every one); `removal`: any (the knapsack
    weighs removal like the other two) or last (no unit removed while every unit windowed fits the
    budget); `unit_value` (attention_mass, retrieval): what a unit kept full is worth, the metric's
    unit score or 1 for every unit (the choice then reads only the share a window loses: the
    metric's scores on the calibration text rank the units that copy from far back low);
    `retrieval_blocks` (measured): synthetic retrieval blocks measured beside the calibration ones;
    `layout` (given, and only there): the file or folder the layout is read from;
    `granularity`: unit (each unit full, windowed or removed on its own) or layer (a layer's kept
    units are all full or all windowed: the per-layer sliding windows engines serve; the
    knapsack chooses per layer, a windowed layer worth the sum of its units' windowed values)."""

    choice: str = "none"
    sink: int = 64
    window: int = 448
    samples: Optional[int] = 1
    removal: str = "any"
    unit_value: str = "metric"
    retrieval_blocks: int = 0
    layout: Optional[str] = None
    granularity: str = "unit"

    def __post_init__(self) -> None:
        if self.choice not in choices():
            raise ValueError(f"kv_modes.choice={self.choice!r} is not allowed; allowed: {', '.join(choices())}")
        KVLayout((), self.sink, self.window)  # the sizes' own checks
        if self.removal not in REMOVALS:
            raise ValueError(f"kv_modes.removal={self.removal!r} is not allowed; allowed: any (the knapsack weighs "
                             "removal with full and windowed), last (no unit removed while every unit windowed fits)")
        if self.removal != "any" and not self.active:
            raise ValueError(f"kv_modes.removal={self.removal} chooses between windows and removal, which "
                             "kv_modes=none does not do; allowed: kv_modes.removal=any with kv_modes=none")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"kv_modes.granularity={self.granularity!r} is not allowed; allowed: unit (each unit's mode "
                             "on its own), layer (a layer's kept units all full or all windowed)")
        if self.granularity != "unit" and not self.active:
            raise ValueError(f"kv_modes.granularity={self.granularity} sets how windows are chosen, which kv_modes=none "
                             "does not do; allowed: kv_modes.granularity=unit with kv_modes=none")
        if self.unit_value not in UNIT_VALUES:
            raise ValueError(f"kv_modes.unit_value={self.unit_value!r} is not allowed; allowed: metric (the metric's "
                             "unit score), uniform (1 for every unit)")
        if self.unit_value != SETTINGS["unit_value"] and not self.reads("unit_value"):
            others = " or ".join(["none", *(n for n in VALUATIONS if n not in readers("unit_value"))])
            raise ValueError(f"kv_modes.unit_value={self.unit_value} sets what a unit full is worth for the attention "
                             f"statistics; kv_modes={self.choice} does not read it; allowed: kv_modes.unit_value=metric "
                             f"with kv_modes={others}")
        blocks = self.retrieval_blocks
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise ValueError(f"kv_modes.retrieval_blocks={blocks!r} must be an integer >= 0")
        if blocks and not self.reads("retrieval_blocks"):
            which = " or ".join(f"kv_modes={n}" for n in readers("retrieval_blocks"))
            raise ValueError(f"kv_modes.retrieval_blocks={blocks} adds synthetic retrieval blocks to what {which} "
                             f"measures; kv_modes={self.choice} measures no loss; allowed: kv_modes.retrieval_blocks=0, "
                             f"or {which}")
        if self.samples is not None and (isinstance(self.samples, bool) or self.samples < 1):
            raise ValueError(f"kv_modes.samples={self.samples!r} must be an integer >= 1 or null (every calibration "
                             "block)")
        self.given_layout: KVLayout | None = None
        if (self.layout is not None) != (self.choice == GIVEN):
            raise ValueError(f"kv_modes.layout={self.layout!r} names the layout kv_modes=given puts on the model; "
                             f"with kv_modes={self.choice} " + ("it must be null" if self.layout is not None else
                             "it is required") + "; allowed: kv_modes=given with kv_modes.layout=<results.json, export "
                             "folder or headprune_layout.json>, or kv_modes.layout=null")
        if self.choice == GIVEN:
            if self.samples is not None or self.removal != "any":
                raise ValueError(f"kv_modes=given measures and chooses nothing, so kv_modes.samples={self.samples} and "
                                 f"kv_modes.removal={self.removal} would be ignored; allowed: kv_modes.samples=null, "
                                 "kv_modes.removal=any")
            self.given_layout = read_kv_layout(self.layout)
            if (self.given_layout.sink, self.given_layout.window) != (self.sink, self.window):
                raise ValueError(f"kv_modes.layout={self.layout} keeps sink {self.given_layout.sink} + window "
                                 f"{self.given_layout.window} tokens per windowed unit, but kv_modes.sink={self.sink} "
                                 f"and kv_modes.window={self.window}; allowed: kv_modes.sink={self.given_layout.sink} "
                                 f"kv_modes.window={self.given_layout.window}")

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def reads(self, setting: str) -> bool:
        """Whether the chosen valuation reads the kv_modes setting `setting` (none and given: no)."""
        return self.choice in readers(setting)

    @property
    def reads_scores(self) -> bool:
        """Whether the choice reads the metric's head scores: only a valuation that reads
        `unit_scores` and values a full unit by them (unit_value=metric). A given layout,
        kv_modes=measured and unit_value=uniform read none, so the round skips the metric's pass
        (selection.rounds: on Gemma-3-270M at 4096 the Fisher pass was the choice's memory peak)."""
        if not self.active:
            return True  # the budget's own allocation ranks units by the scores
        if self.given_layout is not None:
            return False
        reads = get_valuation(self.choice).reads
        return "unit_scores" in reads and not ("unit_value" in reads and self.unit_value == "uniform")

    def record(self) -> dict:
        return {"choice": self.choice, "sink": self.sink, "window": self.window, "samples": self.samples,
                "removal": self.removal, "unit_value": self.unit_value, "retrieval_blocks": self.retrieval_blocks,
                "layout": self.layout, "granularity": self.granularity}

    def check(self, schedule, layer_policy, recovery, budget, *, block_size: int | None, rearrange: bool,
              world_size: int = 1, resuming: bool = False, score_samples: int | None = None) -> None:
        """Refuse, before any work, settings a run with kv modes cannot honour (`score_samples`:
        the calibration blocks the data gives, None when unknown)."""
        if not self.active:
            return
        name = f"kv_modes={self.choice}"
        if self.samples is not None and score_samples is not None and self.samples > score_samples:
            raise ValueError(f"{name}: kv_modes.samples={self.samples} calibration blocks to measure on, but "
                             f"data.score_samples={score_samples} gives only {score_samples}; allowed: kv_modes.samples "
                             f"<= {score_samples}, kv_modes.samples=null (every one), or a larger data.score_samples")
        if not hasattr(budget, "mode_table"):
            raise ValueError(f"{name} chooses full / windowed / removed KV units under a cost budget with a KV mode "
                             f"table, which budget={budget.kind} has not; allowed: budget=kv or flops")
        if self.sink + self.window >= budget.seq:
            raise ValueError(f"{name}: kv_modes.sink + kv_modes.window = {self.sink + self.window} tokens cover the "
                             f"whole budget.seq={budget.seq} context, so a window would keep everything; allowed: "
                             f"sink + window < budget.seq")
        if schedule.num_rounds != 1 or schedule.total_epochs() > 0:
            raise ValueError(f"{name} chooses the modes once, in one round without epochs; got {schedule.num_rounds} "
                             f"round(s) and {schedule.total_epochs()} epoch(s); allowed: schedule=one_shot with "
                             "baseline_epochs=0, epochs_per_round=0 and recover_epochs=0 (train with recovery.steps)")
        steps = recovery.trains_steps()
        if not recovery.follows_kv_modes():
            raise ValueError(f"{name} applies no repair after the modes are chosen (a reconstruction would have to "
                             f"see the windows); got recovery={type(recovery).__name__}"
                             f"{' with recovery.steps=0' if hasattr(recovery, 'steps') else ''}; allowed: recovery=none, "
                             "or recovery=distill|lora with recovery.steps > 0 (the steps train with the windows on)")
        if getattr(layer_policy, "measures_layout", False) or layer_policy.same_units_per_layer:
            raise ValueError(f"{name} allocates the budget per unit itself; layer_policy="
                             f"{type(layer_policy).__name__} allocates per layer; allowed: layer_policy=global or "
                             "depth_prior")
        if rearrange:
            raise ValueError(f"{name} chooses each unit's mode by its own value; pruning.rearrange=true would re-choose "
                             "removed units after it; allowed: pruning.rearrange=false")
        if self.given_layout is None and (block_size is None or block_size < budget.seq):
            raise ValueError(f"{name} measures on the calibration blocks, which must be at least the budget's context: "
                             f"data.block_size={block_size} < budget.seq={budget.seq}; allowed: data.block_size >= "
                             "budget.seq")
        check_blocks = get_valuation(self.choice).check if self.given_layout is None else None
        if check_blocks is not None:  # blocks the valuation cannot measure on
            check_blocks(self, block_size)
        if world_size > 1:
            raise ValueError(f"{name} runs on one process (the choice measures on it, the windows are attached to it); got {world_size} processes; allowed: trainer.devices=1")
        if resuming and not steps:
            raise ValueError(f"{name}: a run without training has no checkpoint to resume; allowed: ckpt_path=null "
                             "(or a run with recovery.steps > 0: its recovery/last.ckpt)")

    def check_model(self, model: nn.Module, task: Task | None = None, budget=None, layer_policy=None) -> None:
        """The run's `task` (None: the model's head's) is causal LM and the kernel takes per-head
        masks; kv_modes=given's layout fits the model, `budget` (its target share of the mode
        table) and `layer_policy`'s caps (`given`), before any work."""
        if not self.active:
            return
        if task_for(model, task) is not CAUSAL_LM:
            raise ValueError(f"kv_modes={self.choice} windows a decoder's KV cache; {type(model).__name__} is not a "
                             "causal LM; allowed: kv_modes=none")
        kernel = getattr(model.config, "_attn_implementation", None)
        if kernel not in KERNELS:
            raise ValueError(f"kv_modes={self.choice}: windowed units need a per-head mask, which "
                             f"model.attn_implementation={kernel} does not take; allowed: {', '.join(KERNELS)}")
        positions = max_positions(model.config)
        if budget is not None and positions is not None and budget.seq > positions:
            raise ValueError(f"kv_modes={self.choice} prices the KV cache at budget.seq={budget.seq} tokens, beyond the "
                             f"model's {positions} positions; allowed: budget.seq <= {positions}")
        if budget is None or layer_policy is None:
            return
        alive = torch.ones(model_shape(model), dtype=torch.bool)
        costs = self.table(budget, model)
        if self.given_layout is not None:
            given_report(self.given_layout, f"kv_modes.layout={self.layout}", model, alive, costs, budget.target,
                         layer_policy, self.granularity)
            return
        self.check_fits(model, alive, costs, budget.target, layer_policy)

    def check_fits(self, model: nn.Module, alive: torch.Tensor, costs: LayerCosts, share: float,
                   layer_policy) -> None:
        """Refuse, before any work, a budget `share` that no layout the choice may take fits (the
        knapsack with every kept unit worth 1, within the layer policy's caps and `removal`)."""
        from headprune.selection.budgets import allocate_modes

        units = kv_group_heads(model)
        choices, _ = mode_choices(costs, units, layer_policy.caps(alive), share, self.removal, self.granularity)
        ones = [[1.0] * len(units) for _ in costs.cost]  # every unit kept worth the same: a layout keeping any fits
        try:
            allocate_modes(ones, ones, costs, share, self.sink, self.window, choices=choices)
        except ValueError as err:
            raise ValueError(f"kv_modes={self.choice} with budget.target={share}: {err}; allowed: a larger "
                             "budget.target (or smaller kv_modes.sink + kv_modes.window, a layer policy whose caps "
                             "let more units go, kv_modes.removal=any)") from None

    def table(self, budget, dense: nn.Module) -> LayerCosts:
        """The budget's KV mode cost table for these window sizes."""
        return budget.mode_table(dense, self.sink, self.window)

    def measure(self, budget, dense: nn.Module) -> tuple[LayerCosts, dict]:
        """(the cost table the round allocates on, what the budget records of it): the budget's own,
        or with kv modes its mode table for these window sizes (options (units full, units windowed)
        per layer)."""
        costs, info = budget.measure(dense)
        if not self.active:
            return costs, info
        return self.table(budget, dense), {**info, "kv_modes": self.record()}

    def final_record(self, model: nn.Module, budget, costs: LayerCosts, alive: torch.Tensor) -> dict:
        """results.json `final`'s cost entries: the kept layout's share of the dense cost (with kv
        modes: the attached layout priced by the mode table, and the layout itself)."""
        if not self.active:
            return {"cost_share": budget.cost_share(costs, alive, kv_group_heads(model))}
        return {"cost_share": cost_share(model, costs), "kv_layout": getattr(model, KV_LAYOUT_ATTR).to_json()}

    def choose(self, model: nn.Module, mask: HeadMask, scores: torch.Tensor, loader, costs: LayerCosts, share: float,
               layer_policy, max_batches: int | None = None, task: Task | None = None) -> tuple[KVLayout, dict]:
        """The round's allocation step: the layout and its report (the knapsack's, with what the
        valuation measured); `scores`: the metric's (layers, heads) scores; `task`: the run's Task
        (None: the model's head's)."""
        from headprune.selection.budgets import allocate_modes

        start = time.perf_counter()
        if self.given_layout is not None:
            report = given_report(self.given_layout, f"kv_modes.layout={self.layout}", model, mask.alive(), costs,
                                  share, layer_policy, self.granularity)
            report["kv_modes"] = {**self.record(), "seconds": round(time.perf_counter() - start, 3)}
            return self.given_layout, report
        units = kv_group_heads(model)
        batches = calibration_batches(loader, mask.mask.device, self.samples, max_batches)
        offered = {"mask": lambda: mask, "task": lambda: task_for(model, task),
                   "unit_scores": lambda: None if scores is None  # not scored: the choice reads none (reads_scores)
                   else unit_values(layer_policy.unit_scores(scores, mask.alive()), units),
                   "unit_value": lambda: self.unit_value, "retrieval_blocks": lambda: self.retrieval_blocks}
        options, windows_fit = mode_choices(costs, units, layer_policy.caps(mask.alive()), share, self.removal,
                                            self.granularity)
        offered["removal_used"] = lambda: not removal_unused(options, len(units))
        full, windowed, measured = value_units(self.choice, model, batches, units, self.sink, self.window, offered)
        layout, report = allocate_modes(full, windowed, costs, share, self.sink, self.window, choices=options)
        report["all_windowed_fits"] = windows_fit
        report["kv_modes"] = {**self.record(), "tokens": sum(int(b["input_ids"].numel()) for b in batches),
                              "seq": int(batches[0]["input_ids"].shape[1]), "full_value": full,
                              "window_value": windowed, **measured, "seconds": round(time.perf_counter() - start, 3)}
        counts = {m: sum(layer.count(m) for layer in layout.modes) for m in (FULL, WINDOW, REMOVED)}
        log.info("kv modes %s by %s (predicted share %.4f of the dense %s)", counts, self.choice,
                 report["predicted_share"], costs.unit)
        return layout, report


def calibration_batches(loader, device, samples: int | None, max_batches: int | None) -> list[dict]:
    """The first `samples` calibration sequences of `loader`, on `device`."""
    batches = first_sequences(loader, device, samples, max_batches)
    if not batches:
        raise ValueError("kv_modes got no calibration block to measure on (the scoring slice is empty)")
    return batches


def mode_choices(costs: LayerCosts, units: list[list[int]], caps: list[int], share: float,
                 removal: str, granularity: str = "unit") -> tuple[list[list[tuple[int, int]]], bool]:
    """(the options (units full, units windowed) each layer may take, whether every unit windowed
    fits `share`): a layer removes at most its policy cap's worth of units (`caps[l]` heads, a unit
    being len(units[0]) of them); `removal="last"`, when every unit windowed fits, no unit removed;
    `granularity="layer"`: a layer's kept units all full or all windowed."""
    group = len(units[0])
    choices = [sorted(k for k in costs.cost[l] if len(units) - sum(k) <= caps[l] // group)
               for l in range(len(costs.cost))]
    if granularity == "layer":
        choices = [[k for k in ks if 0 in k] for ks in choices]
    windows_fit = all_windowed_fits(costs, len(units), share)
    if removal == "last" and windows_fit:
        choices = [[k for k in ks if sum(k) == len(units)] for ks in choices]
    return choices, windows_fit


def removal_unused(choices: list[list[tuple[int, int]]], n_units: int) -> bool:
    """Whether every option of `choices` (units full, units windowed) keeps all `n_units` units:
    then no removal rise can change the knapsack's choice (`selection.measured_values`)."""
    return all(sum(k) == n_units for ks in choices for k in ks)


def all_windowed_fits(costs: LayerCosts, n_units: int, share: float) -> bool:
    """Whether every unit of every layer windowed costs at most `share` of the dense cost (False
    when a layer's table has no option keeping all its units)."""
    from headprune.selection.budgets import cost_limit

    kept_all = [[c for k, c in layer.items() if sum(k) == n_units] for layer in costs.cost]
    return all(kept_all) and sum(min(c) for c in kept_all) <= cost_limit(costs, share)


def unit_values(scores: torch.Tensor, units: list[list[int]]) -> list[list[float]]:
    """values[l][u]: the sum of unit u's head scores in layer l, shifted so the least is >= 0."""
    shifted = scores - min(float(scores.min()), 0.0)
    return [[float(shifted[l, heads].sum()) for heads in units] for l in range(scores.shape[0])]


def removed_heads(layout: KVLayout, model: nn.Module, mask: HeadMask) -> list[tuple[int, int]]:
    """The (layer, head) pairs of `layout`'s removed units still alive in `mask`, sorted."""
    alive = mask.alive()
    return sorted((l, h) for l, hs in layout.removed_heads(model).items() for h in hs if bool(alive[l, h]))


def cost_share(model: nn.Module, costs: LayerCosts) -> float:
    """The attached layout's cost as a share of the dense model's (results.json `final.cost_share`)."""
    layout = getattr(model, KV_LAYOUT_ATTR)
    return costs.total(layout.options()) / costs.dense
