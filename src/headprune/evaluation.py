"""Plain evaluation loop used between pruning rounds (independent of the Trainer's loop).

Classification reports {"acc", "loss"} (mean loss per example); causal LM reports
{"loss", "ppl"}: the mean next-token loss per token and its exponential, the perplexity.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from headprune.objectives import forward_logits, per_example_loss, target_counts, to_device

# what `evaluate` reports, per model.task
VAL_METRICS = {"classification": ("acc", "loss"), "causal_lm": ("loss", "ppl")}


def headline(val: dict) -> tuple[str, float]:
    """(name, value) of the number that sums up a validation result: accuracy (higher is better)
    for classification, perplexity (lower is better) for causal LM."""
    name = "acc" if "acc" in val else "ppl"
    return name, val[name]


@torch.no_grad()
def evaluate(model: nn.Module, dataloader, device: torch.device | str = "cpu",
             max_batches: int | None = None) -> dict[str, float]:
    """Validation metrics over `dataloader`, in eval mode: {"acc", "loss"} for (B, C)
    classification logits, {"loss", "ppl"} (per token) for (B, T, V) causal-LM logits."""
    was_training = model.training
    model.eval()
    correct, loss_sum, count, lm = 0, 0.0, 0.0, False
    try:
        for i, batch in enumerate(dataloader):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(batch, device)
            logits = forward_logits(model, batch)
            losses = per_example_loss(logits, batch)  # (B,)
            lm = logits.dim() == 3
            if lm:  # weight each example's mean by its number of targets: a per-token mean
                weights = target_counts(batch)  # (B,)
                loss_sum += float((losses * weights).sum())
                count += float(weights.sum())
            else:
                loss_sum += float(losses.sum())
                correct += int((logits.argmax(-1) == batch["labels"]).sum())
                count += batch["labels"].shape[0]
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() got an empty dataloader")
    if lm:
        loss = loss_sum / count
        return {"loss": loss, "ppl": math.exp(loss)}
    return {"acc": correct / count, "loss": loss_sum / count}
