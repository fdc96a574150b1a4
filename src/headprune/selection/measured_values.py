"""`kv_modes=measured`: what each KV unit is worth full and windowed, from measured calibration loss
rises (a valuation of `selection.valuations`).

The calibration loss rise of the unit alone windowed, and of the unit alone removed, every other
unit full (`selection.unit_probes`: the loss from layer l on, blocks before it carried, a layer's
probes batched, the head in token chunks), on the first `samples` calibration blocks, which must be
at least `budget.seq` tokens long (a window's cost shows only at long range). Full is worth the
removal rise, windowed the removal rise minus the window rise, removed 0: the knapsack keeps the
layout with the least summed rise.

When no option the knapsack may take removes a unit (`removal=last` with every unit windowed
fitting, or caps that forbid removal: the offered `removal_used` is False), only the window rises are
measured (half the probes): every option then keeps every unit, so each layer's value is the summed
removal rises minus its windowed units' window rises, and the removal rises add the same constant to
every option; full is worth the window rise and windowed 0 instead, which differ from the three-way
values by that constant only (the report's `measured_modes` says which were measured; the same
layouts from SmolLM2's recorded values: experiments/kv_choice_speed/window_only_check.py).

`retrieval_blocks` adds that many synthetic retrieval blocks (`data.retrieval`: random tokens
repeating with a period longer than sink + window, seeds 1, 2, ...; only the repeated part is
scored): natural text rarely needs a token from thousands back, so on it alone the rises miss what a
window costs a copy from far back (passkey retrieval). The rises are measured on the calibration and
the retrieval blocks apart and mixed by their scored tokens, each retrieval rise clamped at 0
(`with_retrieval`): on random tokens many units' removal *lowers* the loss (SmolLM2: 35 of 90, by up
to 1.0 nat), and those gains, summed by the knapsack as if independent, removed 28 units at once
(experiments/llm_kv_modes, measured_retrieval: +230% perplexity). The synthetic blocks can make a
unit dearer to window or remove, never cheaper.
"""
from __future__ import annotations

import torch
from torch import nn

from headprune.data.retrieval import retrieval_batches, retrieval_period
from headprune.heads.mask import HeadMask
from headprune.heads.windows import REMOVED, WINDOW
from headprune.tasks import CAUSAL_LM, Task


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


def measured(model: nn.Module, batches: list[dict], units: list[list[int]], sink: int, window: int, *,
             mask: HeadMask, task: Task, retrieval_blocks: int = 0, removal_used: bool = True
             ) -> tuple[list, list, dict]:
    """(full, windowed, what was measured): full worth the removal rise, windowed the removal rise
    minus the window rise, on `batches` and `retrieval_blocks` synthetic retrieval blocks mixed;
    when no option removes a unit (`removal_used` False) the window rises only, full worth the
    window rise and windowed 0 (module docstring)."""
    modes = (REMOVED, WINDOW) if removal_used else (WINDOW,)
    removed_rise, window_rise, base = measured_rises(model, mask, batches, units, sink, window, task, modes)
    extra = retrieval_batches(model.config, int(batches[0]["input_ids"].shape[1]), sink, window, retrieval_blocks,
                              mask.mask.device)
    report = {"measured_modes": list(modes)}
    if extra:
        rises = measured_rises(model, mask, extra, units, sink, window, task, modes)
        scored = scored_targets(batches, task), scored_targets(extra, task)
        report.update(calibration={"base_loss": base, "removed_rise": removed_rise, "window_rise": window_rise,
                                   "targets": scored[0]},
                      retrieval={"base_loss": rises[2], "removed_rise": rises[0], "window_rise": rises[1],
                                 "targets": scored[1]},
                      retrieval_period=retrieval_period(int(extra[0]["input_ids"].shape[1]), sink, window))
        if removed_rise is not None:
            removed_rise = with_retrieval(removed_rise, rises[0], *scored)
        window_rise = with_retrieval(window_rise, rises[1], *scored)
        base = (scored[0] * base + scored[1] * rises[2]) / (scored[0] + scored[1])
    if removed_rise is None:  # every option keeps every unit: only the window rises tell options apart
        full, windowed = window_rise, [[0.0] * len(ws) for ws in window_rise]
    else:
        full = removed_rise
        windowed = [[r - w for r, w in zip(rs, ws)] for rs, ws in zip(removed_rise, window_rise)]
    report.update(base_loss=base, removed_rise=removed_rise, window_rise=window_rise)
    return full, windowed, report


def check_measured(settings, block_size: int | None) -> None:
    """Refuse, before any work, blocks too short for the retrieval blocks' two copies."""
    if settings.retrieval_blocks:
        retrieval_period(block_size, settings.sink, settings.window)
