"""One whole pruning round as a plain function: score, select, prune, record.

`prune_round` is what the Lightning callback calls after each fine-tuning stretch, and what a
hand-written loop calls without a Trainer:

    for k in range(schedule.num_rounds):
        r = prune_round(model, mask, metric, layer_policy, schedule.heads_to_prune(k, mask.alive()),
                        score_loader, round_no=k + 1, eval_loader=val_loader)
        finetune(model)          # anything: a few optimizer steps, distillation, nothing

The mask changes, the model's weights do not; `headprune.prune_heads(model, r.pruned)` removes
the heads physically afterwards if wanted.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from headprune.heads.mask import HeadMask
from headprune.heads.surgery import kv_group_heads
from headprune.heads.windows import KVWindows
from headprune.scoring import metric_name, score
from headprune.scoring.fisher import fisher_blocks
from headprune.scoring.reduce import finish_scores
from headprune.costs.tables import LayerCosts
from headprune.selection.budgets import allocate
from headprune.selection.kv_modes import removed_heads
from headprune.selection.layer_policies import ShortfallError
from headprune.selection.rearrange import rearrange as rearrange_heads
from headprune.selection.sensitivity import layer_sensitivity
from headprune.tasks import Task, headline, task_for

log = logging.getLogger(__name__)


@dataclass
class Round:
    """What one round did. `record()` is its results.json form."""

    round: int
    sparsity: float
    n_pruned: int
    n_requested: int
    heads_per_layer: list[int]
    pruned: list[list[int]]  # this round's (layer, head) pairs, original ids, sorted
    score_seconds: float
    scores: torch.Tensor | None  # (layers, heads) the scores the selection saw; None: a KV-mode choice reading none
    shortfall: str | None = None  # why fewer heads went than requested (the policy's limits)
    sensitivity: list[float] | None = None  # the layer profile, when this round measured it
    val_before_finetune: dict | None = None
    budget: dict | None = None  # a cost budget's allocation: kept units per layer, predicted cost and share
    rearranged: dict | None = None  # mask rearrangement: heads moved, seconds

    def record(self) -> dict:
        out = {"round": self.round, "sparsity": self.sparsity, "n_pruned": self.n_pruned,
               "n_requested": self.n_requested, "heads_per_layer": self.heads_per_layer, "pruned": self.pruned,
               "score_seconds": round(self.score_seconds, 3),
               "scores": None if self.scores is None else self.scores.tolist()}
        for name in ("budget", "rearranged", "val_before_finetune"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.shortfall:
            out["shortfall"] = self.shortfall
        return out


def prune_round(model: nn.Module, mask: HeadMask, metric: Callable, layer_policy: Callable, n_prune: int,
                loader, *, round_no: int = 1, eval_loader=None, sensitivity: list[float] | None = None,
                sync: Callable[[Any], Any] | None = None, max_batches: int | None = None,
                cost_budget: tuple[LayerCosts, float] | None = None, rearrange: bool = False,
                task: Task | None = None, kv_modes=None) -> Round:
    """Score the heads of `model` on `loader` with `metric`, let `layer_policy` pick `n_prune` of the
    alive ones and zero them in `mask`.

    When the policy's constraints cannot place `n_prune` heads, as many as it can place go and
    the round's `shortfall` says why. A policy with `needs_sensitivity` gets `sensitivity`, or
    a profile measured here on `loader` (returned in `Round.sensitivity`; pass it to later
    rounds). `sync(value)` makes a value identical on every data-parallel rank (rank 0's):
    applied to the measured profile and to the chosen heads. `eval_loader`: evaluate the
    pruned model before any fine-tuning (`val_before_finetune`).

    `cost_budget=(costs, share)`: instead of `n_prune` heads, keep the units (KV groups; heads
    without GQA) worth most under `share` of the dense cost (`selection.budgets.allocate`; the
    cheapest layout the policy allows, with a shortfall, when none fits); a policy with
    `measures_layout` allocates it itself from measurements of `model` on `loader`
    (`layer_policy=measured`, `attention_drop`). `rearrange`: then
    re-choose, within each layer, which units go by the block-diagonal Fisher
    (`selection.rearrange`, Kwon et al.); with `metric=fisher` the scores are that Fisher's diagonal.
    `task`: the run's Task, whose loss and metrics every step computes (the metric when it takes
    one, the sensitivity profile, the measured layouts, the Fisher blocks, `val_before_finetune`);
    None: the model's head's, read once here.

    `kv_modes` (`selection.kv_modes.KVModes`, active, with `cost_budget` on its mode table): the
    allocation step is its choice of each unit's mode (`KVModes.choose`: a valuation and the
    three-way knapsack, or a given layout); the layout's removed units are masked and its windows
    attached to `model` (`model.headprune_kv_layout`); no sensitivity profile is measured.
    """
    task = task_for(model, task)
    start = time.perf_counter()
    limit = {"max_batches": max_batches} if max_batches else {}
    modes = cost_budget is not None and kv_modes is not None and kv_modes.active
    blocks = fisher_blocks(model, mask, loader, max_batches, task) if rearrange else None
    if blocks is not None and metric_name(metric) == "fisher":  # one pass: the diagonal is the metric
        scores = finish_scores(torch.diagonal(blocks, dim1=1, dim2=2), mask)
    elif modes and not kv_modes.reads_scores and metric_name(metric) != "l0_gates":  # l0_gates trains the mask's gates
        scores = None
        log.info("round %d: kv_modes=%s reads no head score: the metric's pass is skipped", round_no, kv_modes.choice)
    else:
        scores = score(metric, model, mask, loader, task, **limit)
    score_seconds = time.perf_counter() - start
    measured = None
    if getattr(layer_policy, "needs_sensitivity", False) and sensitivity is None and not modes:
        sensitivity = layer_sensitivity(model, mask, scores, loader, share=layer_policy.share, max_batches=max_batches,
                                        task=task)
        sensitivity = measured = sync(sensitivity) if sync is not None else sensitivity
    options = {"sensitivity": sensitivity} if sensitivity is not None else {}
    shortfall, allocation, moved, layout = None, None, None, None
    model_units = kv_group_heads(model) if cost_budget is not None else [[h] for h in range(mask.num_heads)]
    if modes:  # full / windowed / removed per unit, on the budget's mode table
        layout, allocation = kv_modes.choose(model, mask, scores, loader, *cost_budget, layer_policy, max_batches, task)
        heads = removed_heads(layout, model, mask)
    elif cost_budget is not None and getattr(layer_policy, "measures_layout", False):  # it measures layouts on `loader`
        heads, allocation, shortfall = layer_policy.measure_allocation(model, mask, loader, scores, *cost_budget,
                                                                       model_units, max_batches=max_batches, task=task)
        if shortfall:
            log.warning("round %d: %s; taking the cheapest layout the layer policy allows", round_no, shortfall)
    elif cost_budget is not None:
        heads, allocation, shortfall = _allocate(scores, mask.alive(), *cost_budget, layer_policy, model_units, round_no)
    else:
        try:
            heads = layer_policy(scores, mask.alive(), n_prune, **options)
        except ShortfallError as err:
            shortfall = str(err)
            log.warning("round %d: %s; pruning %d heads instead", round_no, err, err.available)
            heads = layer_policy(scores, mask.alive(), err.available, **options)
    if blocks is not None:
        began = time.perf_counter()
        searched = sorted(tuple(h) for h in heads)
        heads = rearrange_heads(blocks, searched, mask.alive(), model_units)
        moved = {"heads_moved": len(set(heads) - set(searched)), "seconds": round(time.perf_counter() - began, 3)}
    if sync is not None:  # one decision, rank 0's, everywhere
        heads = [tuple(h) for h in sync(list(heads))]
    mask.prune(heads)
    if layout is not None:
        KVWindows(layout).attach(model)
    val = task.evaluate(model, eval_loader, mask.mask.device, max_batches=max_batches) if eval_loader is not None else None
    result = Round(round_no, mask.sparsity(), len(heads), len(heads) if cost_budget is not None else n_prune,
                   mask.heads_per_layer(), sorted([list(h) for h in heads]), score_seconds, scores, shortfall, measured,
                   val, allocation, moved)
    if val is not None:
        log.info("round %d: pruned %d heads -> sparsity %.3f, heads per layer %s, val %s before fine-tuning %.4f",
                 round_no, len(heads), result.sparsity, result.heads_per_layer, *headline(val))
    return result


def _allocate(scores, alive, costs: LayerCosts, share: float, layer_policy, model_units, round_no: int):
    """(heads, allocation report, shortfall) for a cost budget, falling back to the cheapest layout
    the policy allows when no layout fits `share`."""
    try:
        heads, report = allocate(scores, alive, costs, share, layer_policy, model_units)
        return heads, report, None
    except ValueError as err:
        log.warning("round %d: %s; taking the cheapest layout the layer policy allows", round_no, err)
        heads, report = allocate(scores, alive, costs, share, layer_policy, model_units, cheapest=True)
        return heads, report, f"the {costs.unit} budget {share:.4f} of dense cannot be met: {err}"
