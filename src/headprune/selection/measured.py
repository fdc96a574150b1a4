"""Layer allocation under a cost budget from MEASURED loss rises (`layer_policy=measured`, issue 29).

Summed head scores predict badly what a layout costs once several layers lose heads together (on
SmolLM2 a Fisher-global layout was worse than the uniform one, and the one-layer costs are not
additive), so this allocator measures:

1. cost curves: for every layer l and every number k of its units (KV groups; heads without GQA)
   it may keep, the calibration loss with layer l keeping its k best units (ordered by the
   metric) and every other layer as it is: `curves[l][k]`;
2. a multiple-choice knapsack over layers (`costs.knapsack`, through `budgets.kept_units`):
   value = minus the loss rise, so the layout with the least summed rise that fits the budget;
3. that layout measured as a whole, then corrected greedily for at most `passes` passes: each
   pass measures, in the current layout, what putting one unit back into a layer gains and what
   removing one more costs (for the `candidates` layers the curves rank best on each side), and
   tries the moves (put one back, or put one back and take one elsewhere) that fit the budget in
   the order those in-context numbers predict; the first that lowers the measured loss of the
   whole layout is kept. A pass that keeps nothing ends the correction, so the measured loss
   never rises.

Speed: the loss with only layer l changed needs blocks l..L-1 and the head, not the whole model:
`Probe` carries each calibration batch's hidden states block by block (`recovery.blockwise`) and
runs the model with blocks 0..l-1 replaced by the carried states. All measurements read the same
`samples` calibration sequences (fewer than the scoring slice when asked: the profile's cost grows
with tokens x layers^2). Masking is the HeadMask's (`override`), so nothing is copied.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from headprune.engine.offload import PASS_THROUGH
from headprune.heads.adapters import get_adapter
from headprune.heads.mask import HeadMask
from headprune.recovery.blockwise import BlockInputs, capture, run_block
from headprune.tasks import Task, forward_logits, task_for, to_device


TIE = 1e-9  # value per unit kept: breaks the knapsack's ties towards using the budget


def first_sequences(loader, device, samples: int | None, max_batches: int | None) -> list[dict]:
    """The first `samples` sequences of `loader` (None: all; `max_batches` bounds the batches) on
    `device`, the last batch cut to size; [] when the loader is empty."""
    batches, taken = [], 0
    for i, batch in enumerate(loader):
        if (max_batches is not None and i >= max_batches) or (samples is not None and taken >= samples):
            break
        batch = to_device(batch, device)
        if samples is not None:
            batch = {k: v[:samples - taken] for k, v in batch.items()}
        taken += int(next(iter(batch.values())).shape[0])
        batches.append(batch)
    return batches


@dataclass
class Probe:
    """The calibration batches a measured allocation reads, and the model's mean loss on them
    under a trial keep-mask: `task`'s loss weighted by `task.weights` (per token for a causal LM,
    per example otherwise). `forwards` counts
    the work done, in whole-model forwards on these batches (a run from layer l counts
    (L - l) / L)."""

    model: nn.Module
    mask: HeadMask
    batches: list[dict]
    inputs: list[BlockInputs]
    task: Task
    forwards: float = 0.0
    seconds: float = field(default=0.0)

    @classmethod
    @torch.no_grad()
    def of(cls, model: nn.Module, mask: HeadMask, loader, samples: int | None = None,
           max_batches: int | None = None, task: Task | None = None) -> "Probe":
        """The first `samples` sequences of `loader` (None: all; `max_batches` bounds the batches);
        `task`: the run's Task (None: the model's head's, read once here)."""
        task = task_for(model, task)
        batches = first_sequences(loader, mask.mask.device, samples, max_batches)
        if not batches:
            raise ValueError("layer_policy=measured got no calibration batch to measure on (the scoring slice is empty)")
        return cls(model, mask, batches, [capture(model, b) for b in batches], task)

    @property
    def num_layers(self) -> int:
        return self.mask.num_layers

    def tokens(self) -> int:
        """Targets the loss averages over (`task.weights`): next-token targets (causal LM) or examples."""
        return int(sum(float(self.task.weights(b).sum()) for b in self.batches))

    @torch.no_grad()
    def loss(self, trial: torch.Tensor, layer: int = 0, hidden: list[torch.Tensor] | None = None) -> float:
        """Mean loss with keep-mask `trial`; `layer` > 0: blocks before it are skipped and
        `hidden[i]` (batch i's states entering block `layer`, computed under the same trial for
        those blocks) stands in for their output."""
        start = time.perf_counter()
        total, count, task = 0.0, 0.0, self.task
        was_training = self.model.training
        self.model.eval()
        try:
            with self.mask.override(trial):
                for i, batch in enumerate(self.batches):
                    with start_at(self.model, layer, None if layer == 0 else hidden[i]):
                        logits = forward_logits(self.model, batch)
                    losses = task.loss(logits, batch)  # (B,)
                    weights = task.weights(batch)  # (B,) examples, or next-token targets
                    total += float((losses * weights).sum())
                    count += float(weights.sum())
        finally:
            self.model.train(was_training)
        self.forwards += (self.num_layers - layer) / self.num_layers
        self.seconds += time.perf_counter() - start
        return total / max(count, 1.0)

    @torch.no_grad()
    def carried(self, trial: torch.Tensor) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """(layer l, every batch's hidden states entering block l under `trial`), for l = 0..L-1;
        the states are advanced through block l after the caller has used them."""
        hidden = [inp.hidden for inp in self.inputs]
        for layer in range(self.num_layers):
            yield layer, hidden
            start = time.perf_counter()
            with self.mask.override(trial):
                hidden = [run_block(self.model, layer, inp, h) for inp, h in zip(self.inputs, hidden)]
            self.forwards += 1.0 / self.num_layers
            self.seconds += time.perf_counter() - start


@contextmanager
def start_at(model: nn.Module, layer: int, hidden: torch.Tensor | None):
    """Blocks 0..layer-1 of `model` return `hidden` instead of computing (layer 0: nothing changes)."""
    blocks = get_adapter(model).blocks(model)[:layer]

    def carried(*args, **kwargs):
        return hidden

    setattr(carried, PASS_THROUGH, True)  # a streamed model leaves these blocks home (engine.offload)
    for block in blocks:
        block.forward = carried  # the instance attribute shadows the class's forward
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def trial_mask(base: torch.Tensor, ranked: list[list[int]], kept: list[int], model_units: list[list[int]]) -> torch.Tensor:
    """`base` with, in every layer l, the units after its `kept[l]` best (`ranked[l]`) masked."""
    trial = base.clone()
    for layer, units in enumerate(ranked):
        for u in units[kept[layer]:]:
            trial[layer, model_units[u]] = 0.0
    return trial


def cost_curves(probe: Probe, base: torch.Tensor, ranked: list[list[int]], choices: list[list[int]],
                model_units: list[list[int]]) -> tuple[float, list[dict[int, float]]]:
    """(loss of `base`, curves): curves[l][k] is the loss with layer l keeping its k best alive
    units and every other layer as in `base` (module docstring, step 1)."""
    full = [len(units) for units in ranked]
    base_loss = probe.loss(base)
    curves: list[dict[int, float]] = []
    for layer, hidden in probe.carried(base):
        curve = {full[layer]: base_loss}
        for k in choices[layer]:
            if k < full[layer]:
                kept = list(full)
                kept[layer] = k
                curve[k] = probe.loss(trial_mask(base, ranked, kept, model_units), layer, hidden)
        curves.append(curve)
    return base_loss, curves


def curve_values(curves: list[dict[int, float]], base_loss: float) -> list[dict[int, float]]:
    """Knapsack values: minus each curve's loss rise, made non-decreasing in k (keeping a unit is
    never worth less than removing it: a measured dip is noise, and the budget should be used),
    plus `TIE` per unit kept, so that of layouts worth the same the knapsack keeps the one with
    more units (its own tie rule prefers the cheaper)."""
    values = []
    for curve in curves:
        best, value = float("-inf"), {}
        for k in sorted(curve):
            best = max(best, base_loss - curve[k])
            value[k] = best + TIE * k
        values.append(value)
    return values


def _fits(costs, kept: list[int], limit: float) -> bool:
    return sum(costs.cost[l][k] for l, k in enumerate(kept)) <= limit + 1e-9 * max(1.0, abs(limit))


def correct(probe: Probe, base: torch.Tensor, ranked: list[list[int]], kept: list[int], choices: list[list[int]],
            model_units: list[list[int]], costs, limit: float, curves: list[dict[int, float]], passes: int,
            candidates: int, tries: int = 2) -> tuple[list[int], float, list[dict]]:
    """Greedy correction of a layout measured as a whole (module docstring, step 3): (kept units
    per layer, its measured loss, one record per pass)."""
    kept = list(kept)
    loss = probe.loss(trial_mask(base, ranked, kept, model_units))
    records = []
    for _ in range(passes):
        began = time.perf_counter()
        lo = [min(c) for c in choices]
        hi = [max(c) for c in choices]
        up = sorted((l for l in range(len(kept)) if kept[l] < hi[l]),
                    key=lambda l: curves[l][kept[l]] - curves[l][kept[l] + 1], reverse=True)[:candidates]
        down = sorted((l for l in range(len(kept)) if kept[l] > lo[l]),
                      key=lambda l: curves[l][kept[l] - 1] - curves[l][kept[l]])[:candidates]
        gain, rise = {}, {}
        current = trial_mask(base, ranked, kept, model_units)
        for layer, hidden in probe.carried(current):
            for side, target, step in ((up, gain, 1), (down, rise, -1)):
                if layer in side:
                    trial = list(kept)
                    trial[layer] += step
                    measured = probe.loss(trial_mask(base, ranked, trial, model_units), layer, hidden)
                    target[layer] = (loss - measured) if step > 0 else (measured - loss)
        moves = []
        for a in gain:
            single = list(kept)
            single[a] += 1
            if _fits(costs, single, limit):
                moves.append((loss - gain[a], a, None, single))
            for b in rise:
                if b != a:
                    pair = list(single)
                    pair[b] -= 1
                    if _fits(costs, pair, limit) and sum(pair) > 0:
                        moves.append((loss - gain[a] + rise[b], a, b, pair))
        moves.sort(key=lambda m: (m[0], m[1], -1 if m[2] is None else m[2]))
        record = {"loss_before": loss, "put_back_gain": {str(l): g for l, g in gain.items()},
                  "removal_rise": {str(l): r for l, r in rise.items()}, "tried": [], "accepted": None}
        for predicted, a, b, layout in [m for m in moves if m[0] < loss][:tries]:
            measured = probe.loss(trial_mask(base, ranked, layout, model_units))
            record["tried"].append({"put_back": a, "removed": b, "predicted": predicted, "measured": measured})
            if measured < loss:
                record["accepted"] = {"put_back": a, "removed": b, "loss": measured}
                kept, loss = layout, measured
                break
        record["seconds"] = round(time.perf_counter() - began, 3)
        records.append(record)
        if record["accepted"] is None:
            break
    return kept, loss, records


def measured_allocation(model: nn.Module, mask: HeadMask, loader, scores: torch.Tensor, costs, share: float, layer_policy,
                        model_units: list[list[int]], *, samples: int | None, passes: int, candidates: int,
                        max_batches: int | None = None, task: Task | None = None
                        ) -> tuple[list[tuple[int, int]], dict, str | None]:
    """(heads to prune, the allocation report, shortfall or None): curves, knapsack, correction
    (module docstring) on the first `samples` calibration sequences of `loader`, under the
    policy's constraints (`policy.caps`). When no layout fits `share`, the cheapest one the
    constraints allow, uncorrected, with the reason as the shortfall. The loss is `task`'s (`Probe`)."""
    from headprune.selection.budgets import cost_limit, kept_units, unit_plan

    start = time.perf_counter()
    alive = mask.alive()
    plan = unit_plan(scores, alive, layer_policy, model_units)
    probe = Probe.of(model, mask, loader, samples, max_batches, task)
    base = mask.mask.detach().clone()
    base_loss, curves = cost_curves(probe, base, plan.ranked, plan.choices, model_units)
    profile_seconds = time.perf_counter() - start
    values = curve_values(curves, base_loss)
    limit = cost_limit(costs, share)
    shortfall = None
    try:
        kept = kept_units(plan.choices, values, costs, limit, layer_policy, False, share)
    except ValueError as err:
        kept = kept_units(plan.choices, values, costs, limit, layer_policy, True, share)
        shortfall = f"the {costs.unit} budget {share:.4f} of dense cannot be met: {err}"
    knapsack = list(kept)
    additive = base_loss + sum(curves[l][k] - base_loss for l, k in enumerate(kept))
    began = time.perf_counter()
    if shortfall is None:
        kept, loss, records = correct(probe, base, plan.ranked, kept, plan.choices, model_units, costs, limit, curves,
                                      passes, candidates)
        knapsack_loss = records[0]["loss_before"] if records else loss
    else:
        loss = knapsack_loss = probe.loss(trial_mask(base, plan.ranked, kept, model_units))
        records = []
    predicted = costs.total(kept)
    report = {"kept_units_per_layer": kept, "target_share": share, "predicted_cost": predicted,
              "dense_cost": costs.dense, "predicted_share": predicted / costs.dense, "unit": costs.unit,
              "measured": {"samples": sum(int(b["input_ids"].shape[0]) if "input_ids" in b else 0 for b in probe.batches),
                           "tokens": probe.tokens(), "base_loss": base_loss,
                           "curves": [{str(k): v for k, v in sorted(c.items())} for c in curves],
                           "knapsack_kept_units_per_layer": knapsack, "additive_loss": additive,
                           "knapsack_loss": knapsack_loss, "loss": loss, "passes": records,
                           "passes_run": len(records), "passes_max": passes,
                           "moves": sum(r["accepted"] is not None for r in records), "forwards": round(probe.forwards, 2),
                           "profile_seconds": round(profile_seconds, 3),
                           "correction_seconds": round(time.perf_counter() - began, 3),
                           "seconds": round(time.perf_counter() - start, 3)}}
    return plan.heads(kept, alive, model_units), report, shortfall
