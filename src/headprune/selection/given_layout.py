"""`kv_modes=given`: no choice, the KV layout of an earlier run, read from `kv_modes.layout` (its
results.json, which records `final.kv_layout`; its export folder or that folder's
headprune_layout.json, deploy/layout_file.py), checked before any work against the model's shape, the window sizes, the
budget and the layer policy's caps. Why: a layout that took an hour to measure can be trained (KL
steps) or evaluated again without measuring it again, and recoveries compared on one layout.

It is no valuation (`selection.valuations`): it measures nothing and the knapsack does not run, so
there are no values to give; it is a source of the round's layout beside the knapsack's.
"""
from __future__ import annotations


import torch
from torch import nn

from headprune.costs.tables import LayerCosts
from headprune.heads.surgery import kv_group_heads
from headprune.heads.windows import REMOVED, KVLayout


def read_kv_layout(path: str) -> KVLayout:
    """The KV layout at `path`: a run's results.json (`final.kv_layout`), an export folder (its
    sidecar, deploy/layout_file.py) or such a file; refused, naming the file, when it holds none."""
    from headprune.deploy.layout_file import read_layout

    return read_layout(path, where=f"kv_modes.layout={path}")


def given_report(layout: KVLayout, where: str, model: nn.Module, alive: torch.Tensor, costs: LayerCosts,
                 share: float, layer_policy, granularity: str) -> dict:
    """The given layout's report (as the knapsack's: modes, options, predicted cost and share),
    refused (`where` names the setting) when it is not the model's shape, costs more than `share`
    of the dense cost, mixes modes in a layer under `granularity=layer`, or removes more of a
    layer than the layer policy's caps allow (`alive` (layers, heads): the heads still in the model)."""
    from headprune.selection.budgets import cost_limit

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
    if granularity == "layer" and mixed:
        raise ValueError(f"{where}: layer {mixed[0]} keeps {options[mixed[0]][0]} unit(s) full and "
                         f"{options[mixed[0]][1]} windowed, which kv_modes.granularity=layer does not allow; "
                         "allowed: kv_modes.granularity=unit, or a layout whose layers are all full or all windowed")
    group = len(kv_group_heads(model)[0])
    caps = layer_policy.caps(alive)
    for l, layer in enumerate(layout.modes):
        if layer.count(REMOVED) * group > caps[l]:
            raise ValueError(f"{where} removes {layer.count(REMOVED)} unit(s) of layer {l}; the layer policy lets "
                             f"it lose at most {caps[l]} head(s); allowed: a layer_policy whose caps allow it "
                             "(layer_policy.min_heads_per_layer, max_prune_per_layer)")
    return {"modes": [list(layer) for layer in layout.modes], "options": [list(o) for o in options],
            "target_share": share, "predicted_cost": cost, "dense_cost": costs.dense,
            "predicted_share": cost / costs.dense, "unit": costs.unit}
