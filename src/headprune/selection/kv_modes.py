"""Choosing per-unit KV modes (`kv_modes=` config group, issue 40): each KV group (GQA) or head
(MHA) of each layer is kept `full`, restricted to `sink` + `window` tokens (`window`) or
`removed` (`heads.windows.KVLayout`), the layout worth most within the budget's share of a KV
mode cost table (`budget.mode_table`: a windowed unit costs (sink + window) / seq of a full one
at the budget's seq) by the three-way knapsack (`selection.budgets.allocate_modes`).

What a unit is worth, three ways:

- `measured`: the calibration loss rise of the unit alone windowed, and of the unit alone removed,
  every other unit full (`selection.unit_probes`: the loss from layer l on, blocks before it
  carried, a layer's probes batched, the head in token chunks), on the
  first `samples` calibration blocks, which must be at least `budget.seq` tokens long (a window's
  cost shows only at long range). Full is worth the removal rise, windowed the removal rise
  minus the window rise, removed 0: the knapsack keeps the layout with the least summed rise.
  When no option the knapsack may take removes a unit (`removal=last` with every unit windowed
  fitting, or caps that forbid removal), only the window rises are measured (half the probes):
  every option then keeps every unit, so each layer's value is the summed removal rises minus
  its windowed units' window rises, and the removal rises add the same constant to every option;
  full is worth the window rise and windowed 0 instead, which differ from the three-way values by
  that constant only (`removal_unused`; the report's `measured_modes` says which were measured).
  `retrieval_blocks` adds that many synthetic retrieval blocks (random tokens repeating with a
  period longer than sink + window, as `retrieval` reads, seeds 1, 2, ...; only the repeated part
  is scored): natural text rarely needs a token from thousands back, so on it alone the rises miss
  what a window costs a copy from far back (passkey retrieval). The rises are measured on the
  calibration and the retrieval blocks apart and mixed by their scored tokens, each retrieval
  rise clamped at 0 (`with_retrieval`): on random tokens many units' removal *lowers* the loss
  (SmolLM2: 35 of 90, by up to 1.0 nat), and those gains, summed by the knapsack as if
  independent, removed 28 units at once (experiments/llm_kv_modes, measured_retrieval: +230%
  perplexity). The synthetic blocks can make a unit dearer to window or remove, never cheaper.
- `attention_mass`: training-free. The share of each unit's attention probability on keys
  outside its sinks and recent window (averaged over its query heads and over the queries that
  have such keys, on the same long blocks; one eager forward per block), so a windowed unit keeps
  1 - mass of what it is worth full; full is worth the metric's unit score (the sum of its heads'
  scores, shifted to be non-negative, as the cost budgets rank units), or 1 for every unit with
  `unit_value=uniform`.
- `retrieval`: `attention_mass`, with each unit's share lost to a window the larger of its
  attention mass and its retrieval score (RazorAttention, 2407.15891: "echo" and "induction"
  heads): on one seeded sequence of random tokens repeating with a period longer than sink +
  window, the attention a query head puts on the earlier copy of its current token (echo) and on
  the token after it (induction), keys a window cannot see; a unit scores its most retrieving
  query head's (a KV group must stay full if any of its heads copies from far back). Why: the
  attention mass on natural text keeps full the units that look far back most on average, which
  are not the few that fetch a fact from thousands of tokens back (passkey retrieval fell from
  0.80 to 0.20 with attention_mass at 2/3 of the KV bytes removed; experiments/llm_kv_modes).

- `given`: no choice. The layout of an earlier run, read from `layout` (its results.json, which
  records `final.kv_layout`; its export folder or that folder's headprune_kv_modes.json), checked
  before any work against the model's shape, the window sizes set here, the budget and the layer
  policy's caps. Why: a layout that took an hour to measure can be trained (KL steps) or evaluated
  again without measuring it again, and recoveries compared on one layout.

`granularity=layer` keeps a layer's kept units all full or all windowed (the per-layer sliding
windows engines serve): the knapsack's options per layer are filtered, and a windowed layer is
worth the sum of its units' windowed values.

The layer policy's caps bound the removed units per layer (windows are not removal); its
`unit_scores` are what `attention_mass` reads. `removal=last` removes no unit when every unit
windowed fits the budget (the knapsack then chooses only between full and windowed): the two
values above come from different scales (a metric's unit score, a share of attention) or from
single-unit probes that do not add up, and removing a unit the scale calls cheap can cost far more
than windowing it (experiments/llm_kv_modes); with `any` the knapsack weighs all three.

A run with kv modes is one round without epochs and without a reconstruction (refused otherwise,
before any work: `check`). It may train a step budget after the choice (`recovery=distill|lora`
with `recovery.steps > 0`, the KL steps of LLM runs): the windows are attached by then, so every
step's student forward is the windowed model's and the weights adapt to the layout the export
keeps; a killed run resumes in those steps (the checkpoint carries the layout). A repair that
solves against the dense model (refit, least squares, bias compensation) would have to see the
windows in its least-squares targets and is refused.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from headprune.costs.tables import LayerCosts
from headprune.heads.adapters import get_adapter, model_shape
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import kv_group_heads
from headprune.heads.windows import FULL, KERNELS, KV_LAYOUT_ATTR, REMOVED, WINDOW, KVLayout, KVWindows, window_allowed
from headprune.selection.measured import first_sequences
from headprune.tasks import CAUSAL_LM, Task, max_positions, task_for

log = logging.getLogger(__name__)
CHOICES = ("none", "measured", "attention_mass", "retrieval", "given")
REMOVALS = ("any", "last")
GRANULARITIES = ("unit", "layer")
UNIT_VALUES = ("metric", "uniform")


@dataclass
class KVModes:
    """`kv_modes:` settings. `choice`: none (removal only, the budget's own allocation), measured,
    attention_mass or retrieval (module docstring); `sink` + `window`: what a windowed unit keeps;
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
        if self.choice not in CHOICES:
            raise ValueError(f"kv_modes.choice={self.choice!r} is not allowed; allowed: {', '.join(CHOICES)}")
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
        if self.unit_value != "metric" and self.choice not in ("attention_mass", "retrieval"):
            raise ValueError(f"kv_modes.unit_value={self.unit_value} sets what a unit full is worth for the attention "
                             f"statistics; kv_modes={self.choice} does not read it; allowed: kv_modes.unit_value=metric "
                             "with kv_modes=none or measured")
        blocks = self.retrieval_blocks
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise ValueError(f"kv_modes.retrieval_blocks={blocks!r} must be an integer >= 0")
        if blocks and self.choice != "measured":
            raise ValueError(f"kv_modes.retrieval_blocks={blocks} adds synthetic retrieval blocks to what kv_modes="
                             f"measured measures; kv_modes={self.choice} measures no loss; allowed: "
                             "kv_modes.retrieval_blocks=0, or kv_modes=measured")
        if self.samples is not None and (isinstance(self.samples, bool) or self.samples < 1):
            raise ValueError(f"kv_modes.samples={self.samples!r} must be an integer >= 1 or null (every calibration "
                             "block)")
        self.given_layout: KVLayout | None = None
        if (self.layout is not None) != (self.choice == "given"):
            raise ValueError(f"kv_modes.layout={self.layout!r} names the layout kv_modes=given puts on the model; "
                             f"with kv_modes={self.choice} " + ("it must be null" if self.layout is not None else
                             "it is required") + "; allowed: kv_modes=given with kv_modes.layout=<results.json, export "
                             "folder or headprune_kv_modes.json>, or kv_modes.layout=null")
        if self.choice == "given":
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
        if self.choice != "given" and (block_size is None or block_size < budget.seq):
            raise ValueError(f"{name} measures on the calibration blocks, which must be at least the budget's context: "
                             f"data.block_size={block_size} < budget.seq={budget.seq}; allowed: data.block_size >= "
                             "budget.seq")
        if self.choice == "retrieval" or self.retrieval_blocks:
            retrieval_period(block_size, self.sink, self.window)
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
        if self.choice == "given":
            self.given(model, alive, costs, budget.target, layer_policy)
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

    def choose(self, model: nn.Module, mask: HeadMask, scores: torch.Tensor, loader, costs: LayerCosts, share: float,
               layer_policy, max_batches: int | None = None, task: Task | None = None) -> tuple[KVLayout, dict]:
        """The layout and its report (the knapsack's, with what was measured); `task`: the run's
        Task, whose loss `measured` reads (None: the model's head's)."""
        from headprune.selection.budgets import allocate_modes

        start = time.perf_counter()
        if self.choice == "given":
            layout, report = self.given(model, mask.alive(), costs, share, layer_policy)
            report["kv_modes"] = {**self.record(), "seconds": round(time.perf_counter() - start, 3)}
            return layout, report
        units = kv_group_heads(model)
        batches = calibration_batches(loader, mask.mask.device, self.samples, max_batches)
        choices, windows_fit = mode_choices(costs, units, layer_policy.caps(mask.alive()), share, self.removal,
                                            self.granularity)
        if self.choice == "measured":
            task = task_for(model, task)
            modes = (WINDOW,) if removal_unused(choices, len(units)) else (REMOVED, WINDOW)
            removed_rise, window_rise, base = measured_rises(model, mask, batches, units, self.sink, self.window, task,
                                                             modes)
            extra = retrieval_batches(model.config, int(batches[0]["input_ids"].shape[1]), self.sink, self.window,
                                      self.retrieval_blocks, mask.mask.device)
            measured = {"measured_modes": list(modes)}
            if extra:
                rises = measured_rises(model, mask, extra, units, self.sink, self.window, task, modes)
                scored = scored_targets(batches, task), scored_targets(extra, task)
                measured.update(calibration={"base_loss": base, "removed_rise": removed_rise, "window_rise": window_rise,
                                             "targets": scored[0]},
                                retrieval={"base_loss": rises[2], "removed_rise": rises[0], "window_rise": rises[1],
                                           "targets": scored[1]},
                                retrieval_period=retrieval_period(int(extra[0]["input_ids"].shape[1]), self.sink,
                                                                  self.window))
                if removed_rise is not None:
                    removed_rise = with_retrieval(removed_rise, rises[0], *scored)
                window_rise = with_retrieval(window_rise, rises[1], *scored)
                base = (scored[0] * base + scored[1] * rises[2]) / (scored[0] + scored[1])
            if removed_rise is None:  # every option keeps every unit: only the window rises tell options apart
                full = window_rise
                windowed = [[0.0] * len(ws) for ws in window_rise]
            else:
                full = removed_rise
                windowed = [[r - w for r, w in zip(rs, ws)] for rs, ws in zip(removed_rise, window_rise)]
            measured.update(base_loss=base, removed_rise=removed_rise, window_rise=window_rise)
        else:
            mass = attention_mass(model, batches, units, self.sink, self.window)
            if self.unit_value == "uniform":
                full = [[1.0] * len(units) for _ in mass]
            else:
                full = unit_values(layer_policy.unit_scores(scores, mask.alive()), units)
            measured = {"mass_beyond_window": mass}
            lost = mass
            if self.choice == "retrieval":
                seq = int(batches[0]["input_ids"].shape[1])
                retrieval, period = retrieval_scores(model, units, self.sink, self.window, seq, mask.mask.device)
                lost = [[max(m, r) for m, r in zip(ms, rs)] for ms, rs in zip(mass, retrieval)]
                measured.update(retrieval=retrieval, retrieval_period=period)
            windowed = [[f * (1.0 - m) for f, m in zip(fs, ms)] for fs, ms in zip(full, lost)]
        layout, report = allocate_modes(full, windowed, costs, share, self.sink, self.window, choices=choices)
        report["all_windowed_fits"] = windows_fit
        report["kv_modes"] = {**self.record(), "tokens": sum(int(b["input_ids"].numel()) for b in batches),
                              "seq": int(batches[0]["input_ids"].shape[1]), "full_value": full,
                              "window_value": windowed, **measured, "seconds": round(time.perf_counter() - start, 3)}
        return layout, report


    def given(self, model: nn.Module, alive: torch.Tensor, costs: LayerCosts, share: float,
              layer_policy) -> tuple[KVLayout, dict]:
        """kv_modes=given's layout and its report (as the knapsack's: modes, options, predicted
        cost and share), refused when it is not the model's shape, costs more than `share` of
        the dense cost, or removes more of a layer than the layer policy's caps allow."""
        from headprune.selection.budgets import cost_limit

        layout = self.given_layout
        where = f"kv_modes.layout={self.layout}"
        try:
            layout.check(model)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        options = layout.options()
        missing = [l for l, option in enumerate(options) if option not in costs.cost[l]]
        if missing:
            raise ValueError(f"{where}: layer {missing[0]} keeps {options[missing[0]]} (units full, windowed), which "
                             "the budget's cost table has no entry for")
        cost = costs.total(options)
        if cost - costs.fixed > cost_limit(costs, share) * (1 + 1e-9):
            raise ValueError(f"{where} keeps {cost / costs.dense:.4f} of the dense {costs.unit}, more than the budget's "
                             f"{share:.4f}; allowed: budget.target >= {cost / costs.dense:.4f}, or a smaller layout")
        mixed = [l for l, (full, windowed) in enumerate(options) if full and windowed]
        if self.granularity == "layer" and mixed:
            raise ValueError(f"{where}: layer {mixed[0]} keeps {options[mixed[0]][0]} unit(s) full and "
                             f"{options[mixed[0]][1]} windowed, which kv_modes.granularity=layer does not allow; "
                             "allowed: kv_modes.granularity=unit, or a layout whose layers are all full or all windowed")
        group = len(kv_group_heads(model)[0])
        caps = layer_policy.caps(alive)  # alive (layers, heads): the heads still in the model
        for l, layer in enumerate(layout.modes):
            if layer.count(REMOVED) * group > caps[l]:
                raise ValueError(f"{where} removes {layer.count(REMOVED)} unit(s) of layer {l}; the layer policy lets "
                                 f"it lose at most {caps[l]} head(s); allowed: a layer_policy whose caps allow it "
                                 "(layer_policy.min_heads_per_layer, max_prune_per_layer)")
        report = {"modes": [list(layer) for layer in layout.modes], "options": [list(o) for o in options],
                  "target_share": share, "predicted_cost": cost, "dense_cost": costs.dense,
                  "predicted_share": cost / costs.dense, "unit": costs.unit}
        return layout, report


def read_kv_layout(path: str) -> KVLayout:
    """The KV layout at `path`: a run's results.json (`final.kv_layout`), an export folder (its
    headprune_kv_modes.json) or such a file; refused, naming the file, when it holds none."""
    import json
    from pathlib import Path

    from headprune.deploy.hf import MODES_FILE

    where = f"kv_modes.layout={path}"
    file = Path(path)
    if file.is_dir():
        file = file / MODES_FILE
    if not file.is_file():
        raise ValueError(f"{where}: no such file ({file}); allowed: a run's results.json, an export folder with "
                         f"{MODES_FILE}, or such a file")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: {file} is not valid JSON ({err})") from None
    if isinstance(data, dict) and isinstance(data.get("final"), dict):
        if "kv_layout" not in data["final"]:
            raise ValueError(f"{where}: {file} is a results.json without final.kv_layout (a run without kv modes, or "
                             "one that did not finish)")
        data = data["final"]["kv_layout"]
    return KVLayout.from_json(data, where=str(file))


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
    then no removal rise can change the knapsack's choice (module docstring, `measured`)."""
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


@torch.no_grad()
def measured_rises(model: nn.Module, mask: HeadMask, batches: list[dict], units: list[list[int]], sink: int,
                   window: int, task: Task = CAUSAL_LM, modes: tuple[str, ...] = (REMOVED, WINDOW)
                   ) -> tuple[list[list[float]] | None, list[list[float]], float]:
    """(removal rise, window rise, base loss): per layer and unit, the calibration loss (next-token,
    a causal LM's) of the model with that unit alone removed / windowed, minus the loss with every
    unit as `mask` has it (`selection.unit_probes`: blocks before the unit carried, a layer's probes
    batched, the head in chunks). `modes`: what is probed; the removal rise is None without
    `removed` (the window rise is always measured)."""
    from headprune.selection.unit_probes import unit_rises

    if task is not CAUSAL_LM:
        raise ValueError(f"kv_modes=measured measures a causal LM's next-token loss; got task {task.name}")
    if WINDOW not in modes:
        raise ValueError(f"kv_modes=measured always measures the window rise; got modes {modes}")
    rises, base = unit_rises(model, mask, batches, units, sink, window, modes)
    return rises.get(REMOVED), rises[WINDOW], base


def scored_targets(batches: list[dict], task: Task) -> float:
    """What `batches` count for in a mean loss (`task.weights`: examples, or next-token targets)."""
    return float(sum(float(task.weights(b).sum()) for b in batches))


def with_retrieval(calibration: list[list[float]], retrieval: list[list[float]], calibration_targets: float,
                   retrieval_targets: float) -> list[list[float]]:
    """Per layer and unit, the rise over the calibration and the retrieval blocks together, each
    set weighted by its scored targets, the retrieval rise clamped at 0: a unit whose removal or
    window lowers the loss on random repeating tokens is not thereby cheaper to lose on text
    (module docstring)."""
    total = calibration_targets + retrieval_targets
    return [[(calibration_targets * c + retrieval_targets * max(r, 0.0)) / total for c, r in zip(cs, rs)]
            for cs, rs in zip(calibration, retrieval)]


@torch.no_grad()
def attention_maps(model: nn.Module, inputs: list[torch.Tensor], reduce, choice: str) -> None:
    """Run `model` (eval mode, eager attention: its probabilities) on each of `inputs` (B, T) ids,
    handing each layer's attention probabilities (B, H, Q, K) to `reduce(layer, weights)` as they
    are made, one layer's maps at a time (dropped from the module's output after); `choice` names
    the kv_modes statistic in errors."""
    from headprune.scoring.attention import eager_attention

    adapter = get_adapter(model)

    def hook(layer: int):
        def read(module, args, output):
            if output[1] is None:
                raise ValueError(f"kv_modes={choice} needs the attention probabilities, which this attention module "
                                 "does not return under eager attention")
            reduce(layer, output[1])
            return (output[0], None, *output[2:])
        return read

    handles = [adapter.attention(block).register_forward_hook(hook(l)) for l, block in enumerate(adapter.blocks(model))]
    was_training = model.training
    model.eval()
    try:
        with eager_attention(model):
            for ids in inputs:
                model(input_ids=ids, use_cache=False)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()


def attention_mass(model: nn.Module, batches: list[dict], units: list[list[int]], sink: int,
                   window: int) -> list[list[float]]:
    """mass[l][u]: the mean share of unit u's attention probability (its query heads, the queries
    at slots >= sink + window, every block) on keys outside its sinks and window; eager attention
    for the pass (its probabilities), one layer's maps at a time."""
    adapter = get_adapter(model)
    n_layers = len(adapter.blocks(model))
    sums = [torch.zeros(adapter.num_heads(model.config), dtype=torch.float64) for _ in range(n_layers)]
    count = [0]

    def reduce(layer: int, weights: torch.Tensor) -> None:  # weights (B, H, Q, K)
        q = weights.shape[-2]
        if q <= sink + window:
            raise ValueError(f"kv_modes=attention_mass: blocks of {q} tokens have no key outside sink + window = "
                             f"{sink + window}")
        slots = torch.arange(q, device=weights.device)
        outside = ~window_allowed(slots[sink + window:], slots, sink, window)  # (Q', K)
        outside &= slots[None, :] <= slots[sink + window:, None]
        mass = (weights[:, :, sink + window:].float() * outside).sum(-1)  # (B, H, Q')
        sums[layer] += mass.sum(dim=(0, 2)).double().cpu()
        if layer == 0:
            count[0] += mass.shape[0] * mass.shape[2]

    attention_maps(model, [batch["input_ids"] for batch in batches], reduce, "attention_mass")
    per_head = [s / max(count[0], 1) for s in sums]
    return [[float(per_head[l][heads].mean()) for heads in units] for l in range(n_layers)]


def retrieval_period(seq: int, sink: int, window: int) -> int:
    """The period of the repeated random sequence: a quarter of `seq` (three copies to look back
    on) when that exceeds sink + window, else half; refused when even half leaves every earlier
    copy inside the window."""
    for period in (seq // 4, seq // 2):
        if period > sink + window:
            return period
    raise ValueError(f"kv_modes=retrieval: a {seq}-token block cannot hold two copies of a sequence longer than "
                     f"sink + window = {sink + window} tokens (a window would see the earlier copy); allowed: "
                     f"data.block_size > 2 x (kv_modes.sink + kv_modes.window)")


def repeated_random_tokens(config, seq: int, period: int, seed: int = 0) -> torch.Tensor:
    """(1, seq) ids: `period` random ids (seeded; the config's special ids left out) repeated."""
    special = {getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    special = {i for s in special for i in (s if isinstance(s, (list, tuple)) else [s]) if i is not None}
    allowed = torch.tensor([i for i in range(config.vocab_size) if i not in special])
    pick = torch.randint(len(allowed), (period,), generator=torch.Generator().manual_seed(seed))
    return allowed[pick].repeat(seq // period + 1)[:seq][None]


def retrieval_batches(config, seq: int, sink: int, window: int, n: int, device) -> list[dict]:
    """`n` synthetic retrieval blocks of `seq` tokens (seeds 1..n): random tokens repeating every
    `retrieval_period` tokens, labels -100 over the first copy, so a loss scores only tokens whose
    earlier copy lies beyond sink + window (past the sinks once the period exceeds them)."""
    if n == 0:
        return []
    period = retrieval_period(seq, sink, window)
    out = []
    for seed in range(1, n + 1):
        ids = repeated_random_tokens(config, seq, period, seed).to(device)  # (1, seq)
        labels = ids.clone()
        labels[:, :period] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def retrieval_scores(model: nn.Module, units: list[list[int]], sink: int, window: int, seq: int,
                     device, seed: int = 0) -> tuple[list[list[float]], int]:
    """(scores[l][u], period): per unit, its most retrieving query head's mean attention on the
    earlier copy of the query's token (echo, key i - period) plus the token after it (induction,
    key i - period + 1), over the queries i >= period + sink whose earlier copy exists, on one
    seeded `seq`-token sequence of random tokens repeating every `period` (> sink + window, so
    those keys are outside every window and past the sinks). Eager attention for the pass."""
    period = retrieval_period(seq, sink, window)
    ids = repeated_random_tokens(model.config, seq, period, seed).to(device)
    per_head: dict[int, torch.Tensor] = {}
    queries = torch.arange(period + sink, seq, device=device)  # (Q,)

    def reduce(layer: int, weights: torch.Tensor) -> None:  # weights (1, H, T, T)
        echo = weights[0][:, queries, queries - period].float()  # (H, Q)
        induction = weights[0][:, queries, queries - period + 1].float()  # (H, Q)
        per_head[layer] = (echo + induction).mean(-1).double().cpu()  # (H,)

    attention_maps(model, [ids], reduce, "retrieval")
    return [[float(per_head[l][heads].max()) for heads in units] for l in range(len(per_head))], period


def kv_modes_round(model: nn.Module, mask: HeadMask, metric, kv_modes: KVModes, costs: LayerCosts, share: float,
                   layer_policy, loader, *, round_no: int = 1, eval_loader=None, max_batches: int | None = None,
                   task: Task | None = None):
    """One round choosing KV modes: score (the metric, recorded and read by attention_mass), choose
    the layout, mask its removed units, attach its windows to `model`; a `rounds.Round`. `task`: the
    run's Task (None: the model's head's, read once here)."""
    from headprune.scoring import score
    from headprune.selection.rounds import Round

    task = task_for(model, task)
    start = time.perf_counter()
    limit = {"max_batches": max_batches} if max_batches else {}
    scores = score(metric, model, mask, loader, task, **limit)
    score_seconds = time.perf_counter() - start
    layout, report = kv_modes.choose(model, mask, scores, loader, costs, share, layer_policy, max_batches, task)
    heads = sorted((l, h) for l, hs in layout.removed_heads(model).items() for h in hs if bool(mask.alive()[l, h]))
    mask.prune(heads)
    KVWindows(layout).attach(model)
    val = task.evaluate(model, eval_loader, mask.mask.device, max_batches=max_batches) if eval_loader is not None else None
    counts = {m: sum(layer.count(m) for layer in layout.modes) for m in (FULL, WINDOW, REMOVED)}
    log.info("round %d: kv modes %s (predicted share %.4f of the dense %s)", round_no, counts,
             report["predicted_share"], costs.unit)
    return Round(round_no, mask.sparsity(), len(heads), len(heads), mask.heads_per_layer(), [list(h) for h in heads],
                 score_seconds, scores, None, None, val, report, None)


def cost_share(model: nn.Module, costs: LayerCosts) -> float:
    """The attached layout's cost as a share of the dense model's (results.json `final.cost_share`)."""
    layout = getattr(model, KV_LAYOUT_ATTR)
    return costs.total(layout.options()) / costs.dense
