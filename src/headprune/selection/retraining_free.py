"""Pruning to a budget without retraining (Kwon et al. 2022, "A Fast Post-Training Pruning
Framework for Transformers"): one round of the Pruner.

    report = headprune.prune_to_budget(model, calib_loader, budget={"kind": "latency", "target": 0.6},
                                       metric="fisher", recovery="least_squares", eval_loader=val_loader)

1. costs: the budget's per-layer cost table (a latency budget measures its lookup table, cached);
2. mask search: score every head on the calibration examples (Fisher information of the mask by
   default) and keep, per layer, as many units as the budget allows with the most importance
   retained (`selection.budgets.allocate`);
3. mask rearrangement: re-choose within each layer by the block-diagonal Fisher
   (`selection.rearrange`);
4. recovery: least-squares scales of the surviving heads that reconstruct each layer's dense
   output (`recovery.least_squares`), kept in the HeadMask; or none.

The model is only masked (and scaled); `headprune.fold(model, mask)` folds the scales into the
output projection and removes the pruned heads. Every stage is timed.
"""
from __future__ import annotations

import time
from typing import Any

from torch import nn

from headprune.heads.mask import HeadMask
from headprune.recovery import make_recovery
from headprune.results import RunResults
from headprune.scoring import get_metric
from headprune.selection.budgets import make_budget
from headprune.selection.layer_policies import GlobalPolicy
from headprune.selection.pruner import Loaders, Pruner
from headprune.selection.schedules import OneShot


def prune_to_budget(model: nn.Module, calib_loader, budget, metric: str = "fisher", recovery="least_squares",
                    layer_policy=None, rearrange: bool = True, mask: HeadMask | None = None, eval_loader=None,
                    max_batches: int | None = None, train_loader=None, task=None) -> dict[str, Any]:
    """Mask (and scale) the heads of `model` down to `budget` without training; returns a report:
    `round` (the Pruner's round record: heads, allocation, predicted cost share, the tuning report,
    `val` when `eval_loader` is given), `budget` (its settings and cost table), `seconds` per stage
    and the mask's `scales`.

    `budget`: a Budget, or its fields with `kind` ({"kind": "flops", "target": 0.5}); `target` is
    the share of the dense model's cost (heads: of its heads) to keep, in (0, 1]. `recovery`:
    "least_squares", "none" or such a Recovery. `layer_policy`: a layer policy whose constraints bound
    each layer (default GlobalPolicy(min_heads_per_layer=1)). `mask`: the model's HeadMask (one is
    attached if None). `train_loader`: the training text of a recovery that trains a step budget
    (recovery=lora or distill with steps > 0). `task`: the Task (or its name) whose loss and metrics
    the metric, the recovery and `val` compute, checked against the model's head (None: the head's)."""
    fields = dict(budget) if isinstance(budget, dict) else None
    target = _target(fields.pop("target", None) if fields is not None else getattr(budget, "target", None))
    if fields is not None and fields.get("kind", "heads") != "heads":
        fields["target"] = target
    budget = make_budget(fields if fields is not None else budget)
    schedule = OneShot(target_sparsity=round(1.0 - target, 12), baseline_epochs=0, epochs_per_round=0)
    recovery = make_recovery(recovery)
    if recovery.trains:
        raise ValueError(f"prune_to_budget trains nothing, so {type(recovery).__name__} would do nothing; allowed: "
                         "recovery=least_squares, none, lora, or distill with steps > 0")
    recovery.check_model(model)  # before any work, as headprune-train does (e.g. a bias the model cannot carry)
    results = RunResults(None)
    start = time.perf_counter()
    pruner = Pruner(model, get_metric(metric), schedule, layer_policy if layer_policy is not None else GlobalPolicy(),
                    budget, recovery, mask=mask, rearrange=rearrange, results=results, max_batches=max_batches,
                    task=task)
    record = pruner.step(0, Loaders(calib_loader, eval_loader, train=train_loader)) if schedule.sparsities() else None
    report: dict[str, Any] = {"round": record, "budget": {**results.data.get("budget", budget.record()), "target": target},
                              "seconds": _seconds(record, results.data.get("budget"), time.perf_counter() - start),
                              "scales": pruner.mask.mask.tolist()}
    return report


def _target(target) -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 < target <= 1.0:
        raise ValueError(f"budget target={target!r} must be in (0, 1]: the share of the dense model's cost (or heads) "
                         "to keep")
    return float(target)


def _seconds(record: dict | None, budget: dict | None, total: float) -> dict:
    out = {"costs": (budget or {}).get("seconds")}
    if record is not None:
        out["search"] = record["score_seconds"]
        out["rearrange"] = (record.get("rearranged") or {}).get("seconds")
        out["mask_tuning"] = (record.get("mask_tuning") or {}).get("seconds")
    return {k: v for k, v in out.items() if v is not None} | {"total": round(total, 3)}

