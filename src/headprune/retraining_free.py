"""Pruning to a budget without retraining (Kwon et al. 2022, "A Fast Post-Training Pruning
Framework for Transformers"), as one plain function.

    report = headprune.prune_to_budget(model, calib_loader, budget={"kind": "latency", "target": 0.6},
                                       metric="fisher", recovery="least_squares", eval_loader=val_loader)

1. costs: per-layer costs of the budget's kind (a latency budget measures its lookup table,
   cached; `selection.budgets`, `selection.latency`);
2. mask search: score every head on the calibration examples (Fisher information of the mask by
   default) and keep, per layer, as many units as the budget allows with the most importance
   retained (`selection.knapsack`);
3. mask rearrangement: re-choose within each layer by the block-diagonal Fisher
   (`selection.rearrange`);
4. mask tuning: least-squares scales of the surviving heads that reconstruct each layer's dense
   output (`recovery.least_squares`), kept in the HeadMask.

The model is only masked (and scaled); `headprune.export_scaled(model, mask)` or the app's export
folds the scales into the output projection and removes the pruned heads. Every stage is timed.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from headprune.heads.mask import HeadMask
from headprune.recovery.least_squares import LeastSquares, tune_scales
from headprune.scoring import get_metric
from headprune.selection.budgets import Budget, layer_costs
from headprune.costs.latency import latency_table
from headprune.selection.layer_policies import GlobalPolicy
from headprune.selection.rounds import prune_round
from headprune.tasks import evaluate

RECOVERIES = ("least_squares", "none")


def budget_costs(model: nn.Module, budget: Budget):
    """(LayerCosts, info) for a cost budget; a latency budget measures (or reads) its table on
    `model`, which must compute every head (no HeadMask attached, nothing pruned)."""
    if budget.kind != "latency":
        return layer_costs(model, budget), {}
    table = latency_table(model, budget.batch, budget.seq, budget.cache_dir, budget.warmup, budget.repeats)
    info = {"latency_table": {k: round(v, 4) for k, v in table["layer_ms"].items()},
            "dense_forward_ms": table["forward_ms"], "table_cached": table["cached"], "table_path": table["path"],
            "table_seconds": round(table["seconds"], 3)}
    return layer_costs(model, budget, table["layer_ms"], table["forward_ms"]), info


def prune_to_budget(model: nn.Module, calib_loader, budget: Budget | dict, metric: str = "fisher",
                    recovery: str = "least_squares", policy=None, rearrange: bool = True, mask: HeadMask | None = None,
                    eval_loader=None, least_squares: LeastSquares | None = None,
                    max_batches: int | None = None) -> dict[str, Any]:
    """Mask (and scale) the heads of `model` down to `budget` without training; returns a report:
    the round record (heads, allocation, predicted cost share), the tuning report, validation
    metrics before and after tuning when `eval_loader` is given, and `seconds` per stage.

    `budget`: a Budget or its fields; `target` is the share of the dense model's cost (heads:
    of its heads) to keep. `policy`: a layer policy whose constraints bound each layer (default
    GlobalPolicy(min_heads_per_layer=1)). `mask`: the model's HeadMask (one is attached if None)."""
    if recovery not in RECOVERIES:
        raise ValueError(f"recovery={recovery!r} is not allowed; allowed: {', '.join(RECOVERIES)}")
    budget = Budget(**budget) if isinstance(budget, dict) else budget
    policy = policy if policy is not None else GlobalPolicy(min_heads_per_layer=1)
    if mask is None:
        mask = HeadMask.for_model(model).to(next(model.parameters()).device)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    dense = mask.unmasked_copy(model).eval()
    seconds["copy"] = time.perf_counter() - start
    info: dict = {}
    cost_budget = None
    if budget.kind != "heads":
        began = time.perf_counter()
        costs, info = budget_costs(dense, budget)
        cost_budget = (costs, budget.target)
        seconds["costs"] = time.perf_counter() - began
    total = mask.mask.numel()
    n_prune = max(total - round(budget.target * total) - int((~mask.alive()).sum()), 0)
    began = time.perf_counter()
    result = prune_round(model, mask, get_metric(metric), policy, n_prune, calib_loader, eval_loader=eval_loader,
                         cost_budget=cost_budget, rearrange=rearrange, max_batches=max_batches)
    seconds["search"] = time.perf_counter() - began - (result.rearranged or {}).get("seconds", 0.0)
    if result.rearranged:
        seconds["rearrange"] = result.rearranged["seconds"]
    report: dict[str, Any] = {"round": result.record(), "budget": {"kind": budget.kind, "target": budget.target, **info}}
    if recovery == "least_squares":
        began = time.perf_counter()
        report["mask_tuning"] = tune_scales(model, mask, dense, calib_loader, least_squares or LeastSquares(),
                                            max_batches)
        seconds["mask_tuning"] = time.perf_counter() - began
        if eval_loader is not None:
            began = time.perf_counter()
            report["val_after_tuning"] = evaluate(model, eval_loader, mask.mask.device, max_batches=max_batches)
            seconds["evaluate"] = time.perf_counter() - began
    report["seconds"] = {k: round(v, 3) for k, v in seconds.items()} | {"total": round(time.perf_counter() - start, 3)}
    report["scales"] = mask.mask.tolist()
    return report


@torch.no_grad()
def export_scaled(model: nn.Module, mask: HeadMask) -> nn.Module:
    """Fold the mask's gate values into the output-projection columns and remove the heads whose
    gate is 0, in place: the model then computes, with no hook, what the masked and scaled one
    did. The mask is detached."""
    from headprune.heads.surgery import prune_heads, scale_heads

    gates = mask.mask.detach().clone()
    mask.detach()
    scale_heads(model, gates)
    return prune_heads(model, [(int(l), int(h)) for l, h in (gates == 0).nonzero().tolist()])


@torch.no_grad()
def measured_latency(dense: nn.Module, pruned: nn.Module, budget: Budget, rounds: list[dict] | None = None) -> dict:
    """The pruned model's forward latency against the dense one's, timed together (interleaved) at
    the budget's batch x seq, next to what the lookup table predicted for its layout."""
    from headprune.costs.timing import Clock, interleaved

    device = next(pruned.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dense.config.vocab_size, (budget.batch, budget.seq), generator=g).to(device)
    modes = dense.training, pruned.training
    dense.eval(), pruned.eval()
    try:
        stats = interleaved({"dense": lambda: dense(input_ids=ids), "pruned": lambda: pruned(input_ids=ids)},
                            Clock(device), warmup=budget.warmup, repeats=budget.repeats)
    finally:
        dense.train(modes[0]), pruned.train(modes[1])
    measured = stats["pruned"].median_ms / stats["dense"].median_ms
    predicted = (rounds or [{}])[-1].get("budget", {}).get("predicted_share")
    out = {"dense_ms": stats["dense"].median_ms, "pruned_ms": stats["pruned"].median_ms, "measured_share": measured,
           "target_share": budget.target, "batch": budget.batch, "seq": budget.seq,
           "threads": torch.get_num_threads(), "repeats": budget.repeats}
    if predicted is not None:
        out.update(predicted_share=predicted, prediction_error=measured - predicted)
    return out
