"""He et al. 2024 ("What matters in transformers? Not all attention is needed"): whole attention
sublayers go, those that change the residual stream least first (`layer_policy=attention_drop`).

A layer's importance is 1 - cos(x, x + a), x the residual stream entering the block and a what the
attention sublayer adds to it (the output projection's output), averaged over the calibration
tokens: a sublayer whose output leaves the stream's direction unchanged is redundant. For post-LN
models (BERT) x + a is the sum before the LayerNorm. The current HeadMask applies (its gates act
before the output projection), so a second round ranks what is left.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from headprune.heads.adapters import get_adapter
from headprune.heads.mask import HeadMask
from headprune.tasks import MODEL_INPUTS, to_device


@torch.no_grad()
def attention_change(model: nn.Module, mask: HeadMask, loader, samples: int | None = None,
                     max_batches: int | None = None) -> tuple[list[float], int]:
    """(per layer 1 - mean cos(x, x + attention output) over real tokens, tokens read), on the first
    `samples` sequences of `loader` (None: all)."""
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    sums = [0.0] * len(blocks)
    entering: dict[int, torch.Tensor] = {}
    weight: dict[str, torch.Tensor] = {}

    def before(layer: int):
        def hook(module, args, kwargs):
            entering[layer] = args[0] if args else kwargs["hidden_states"]  # (B, T, E)
        return hook

    def after(layer: int):
        def hook(module, args, output):
            x = entering.pop(layer).float()  # (B, T, E)
            a = (output[0] if isinstance(output, tuple) else output).float()  # (B, T, E)
            cos = F.cosine_similarity(x, x + a, dim=-1)  # (B, T)
            sums[layer] += float((cos * weight["w"]).sum())
        return hook

    handles = []
    for layer, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(before(layer), with_kwargs=True))
        handles.append(adapter.out_proj(block).register_forward_hook(after(layer)))
    was_training = model.training
    model.eval()
    count, taken = 0.0, 0
    try:
        for i, batch in enumerate(loader):
            if (max_batches is not None and i >= max_batches) or (samples is not None and taken >= samples):
                break
            batch = to_device(batch, mask.mask.device)
            if samples is not None:
                batch = {k: v[:samples - taken] for k, v in batch.items()}
            ids = batch["input_ids"]
            taken += int(ids.shape[0])
            w = batch.get("attention_mask", torch.ones_like(ids)).to(torch.float32)  # (B, T)
            weight["w"] = w
            count += float(w.sum())
            model(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    if count == 0:
        raise ValueError("layer_policy=attention_drop got no calibration token to measure on (the scoring slice is empty)")
    return [1.0 - s / count for s in sums], int(count)


def drop_order(change: list[float], choices: list[list[int]]) -> list[int]:
    """The layers whose attention may go as a whole (0 among their choices), least change first."""
    return sorted((l for l, c in enumerate(choices) if 0 in c), key=lambda l: (change[l], l))


def drop_layers(change: list[float], choices: list[list[int]], costs, limit: float) -> tuple[list[int], list[int], bool]:
    """(kept units per layer, the layers dropped in order, whether the layout fits `limit`): whole
    layers go, least change first, until the layers' summed cost is within `limit`; one unit at
    least stays in the model."""
    kept = [max(c) for c in choices]
    dropped = []

    def cost() -> float:
        return sum(costs.cost[l][k] for l, k in enumerate(kept))

    eps = 1e-9 * max(1.0, abs(limit))
    for layer in drop_order(change, choices):
        if cost() <= limit + eps:
            break
        if sum(kept) - kept[layer] == 0:
            continue
        kept[layer] = 0
        dropped.append(layer)
    return kept, dropped, cost() <= limit + eps


def attention_drop_allocation(model: nn.Module, mask: HeadMask, loader, scores: torch.Tensor, costs, share: float,
                              layer_policy, model_units: list[list[int]], *, samples: int | None,
                              max_batches: int | None = None) -> tuple[list[tuple[int, int]], dict, str | None]:
    """(heads to prune, the allocation report, shortfall or None) under a cost budget: whole layers
    go (`drop_layers`) within the policy's constraints (a layer whose caps keep a head stays)."""
    from headprune.selection.budgets import cost_limit, unit_plan

    start = time.perf_counter()
    alive = mask.alive()
    plan = unit_plan(scores, alive, layer_policy, model_units)
    change, tokens = attention_change(model, mask, loader, samples, max_batches)
    kept, dropped, fits = drop_layers(change, plan.choices, costs, cost_limit(costs, share))
    shortfall = None
    if not fits:
        shortfall = (f"the {costs.unit} budget {share:.4f} of dense cannot be met by dropping whole attention layers: "
                     f"with every layer the constraints let go dropped ({len(dropped)}), the layout keeps "
                     f"{costs.total(kept) / costs.dense:.4f} ({layer_policy.why()})")
    predicted = costs.total(kept)
    report = {"kept_units_per_layer": kept, "target_share": share, "predicted_cost": predicted,
              "dense_cost": costs.dense, "predicted_share": predicted / costs.dense, "unit": costs.unit,
              "attention_drop": {"change": change, "dropped": dropped, "tokens": tokens,
                                 "seconds": round(time.perf_counter() - start, 3)}}
    return plan.heads(kept, alive, model_units), report, shortfall
