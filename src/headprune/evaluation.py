"""Plain evaluation loop used between pruning rounds (independent of the Trainer's loop)."""
from __future__ import annotations

import torch
from torch import nn

from headprune.objectives import forward_logits, per_example_loss, to_device


@torch.no_grad()
def evaluate(model: nn.Module, dataloader, device: torch.device | str = "cpu",
             max_batches: int | None = None) -> dict[str, float]:
    """Accuracy and mean loss over `dataloader` (classification), in eval mode."""
    was_training = model.training
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    try:
        for i, batch in enumerate(dataloader):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(batch, device)
            logits = forward_logits(model, batch)
            loss_sum += float(per_example_loss(logits, batch).sum())
            correct += int((logits.argmax(-1) == batch["labels"]).sum())
            count += batch["labels"].shape[0]
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() got an empty dataloader")
    return {"acc": correct / count, "loss": loss_sum / count}
