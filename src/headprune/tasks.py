"""What each task computes: logits, per-example losses and validation metrics.

The single list of tasks (`TASKS`) lives here. Training, evaluation between rounds and the
gradient-based metrics all use these functions, so they agree on every number:
- classification: cross-entropy of (B, C) logits; validation {"acc", "loss"} (mean per example);
- causal_lm: mean next-token cross-entropy over each example's real tokens; validation
  {"loss", "ppl"}: the mean loss per token and its exponential, the perplexity.

Perplexity has one implementation, `evaluate` (its causal-LM branch sums `next_token_loss_sum`):
`val` runs it on the data module's validation blocks (fed as trained on: no BOS, the first
token of each block unscored), and headprune.evaluation.perplexity runs it on fixed windows of
held-out text with BOS stated; the two differ only in the windows and the BOS rule they name.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# what `evaluate` reports, per task (model.task)
VAL_METRICS = {"classification": ("acc", "loss"), "causal_lm": ("loss", "ppl")}
TASKS = tuple(VAL_METRICS)


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"model.task={task!r} is not allowed; allowed: {', '.join(TASKS)}")
    return task


def forward_logits(model: nn.Module, batch: dict, **options) -> torch.Tensor:
    """The model's logits on the batch's model inputs; `options` go to the forward (use_cache=False)."""
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    return model(**inputs, **options).logits


def per_example_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Loss of each example, shape (B,).

    Sequence classification: cross-entropy of (B, C) logits against `labels`.
    Causal LM: mean next-token cross-entropy over each example's real tokens.
    """
    if logits.dim() == 2:
        return F.cross_entropy(logits.float(), batch["labels"], reduction="none")
    targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
    logits = logits[:, :-1].float()  # (B, T-1, V)
    token_loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    weights = target_weights(batch)  # (B, T-1)
    return (token_loss * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def next_token_loss_sum(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy, number of targets) of a causal-LM batch: position t
    predicts token t+1 wherever t+1 is real and labelled (`target_weights`), so the first token
    of every row is context only. The perplexity rule of `evaluate`, which sums these over batches."""
    targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
    if "attention_mask" in batch:
        targets = targets.masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())


def target_counts(batch: dict) -> torch.Tensor:
    """(B,) number of next-token targets each causal-LM example's loss averages over, so that
    sum(per_example_loss * target_counts) / sum(target_counts) is the per-token mean loss."""
    return target_weights(batch).sum(1)


def target_weights(batch: dict) -> torch.Tensor:
    """(B, T-1) 1.0 where position t+1 is a real, labelled target of position t."""
    targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
    weights = (targets != -100).float()
    if "attention_mask" in batch:
        weights = weights * batch["attention_mask"][:, 1:].float()
    return weights


def real_tokens(batch: dict) -> torch.Tensor:
    """Bool (B, T): True for real tokens, False for padding."""
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    return torch.ones_like(batch["input_ids"], dtype=torch.bool)


def max_positions(config) -> int | None:
    """The longest sequence a config's position embeddings cover (GPT-2 `n_positions`, others
    `max_position_embeddings`), or None when it names none."""
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def is_causal_lm(model: nn.Module) -> bool:
    """A next-token model (its architectures, else its class, end in ForCausalLM / LMHeadModel)."""
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in model.config.architectures or [type(model).__name__])


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def headline(val: dict) -> tuple[str, float]:
    """(name, value) of the number that sums up a validation result: accuracy (higher is better)
    for classification, perplexity (lower is better) for causal LM."""
    name = "acc" if "acc" in val else "ppl"
    return name, val[name]


@torch.no_grad()
def evaluate(model: nn.Module, dataloader, device: torch.device | str = "cpu",
             max_batches: int | None = None) -> dict[str, float]:
    """Validation metrics over `dataloader`, in eval mode: {"acc", "loss"} for (B, C)
    classification logits, {"loss", "ppl"} for (B, T, V) causal-LM logits: the per-token mean of
    `next_token_loss_sum` over every batch and its exponential (the one perplexity; a causal LM
    runs without its KV cache)."""
    was_training = model.training
    model.eval()
    options = {"use_cache": False} if is_causal_lm(model) else {}
    correct, loss_sum, count, lm = 0, 0.0, 0.0, False
    try:
        for i, batch in enumerate(dataloader):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(batch, device)
            logits = forward_logits(model, batch, **options)
            lm = logits.dim() == 3
            if lm:  # summed over tokens: a per-token mean
                loss, targets = next_token_loss_sum(logits, batch)
                loss_sum += loss.item()
                count += targets
            else:
                losses = per_example_loss(logits, batch)  # (B,)
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
