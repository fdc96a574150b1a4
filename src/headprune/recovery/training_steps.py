"""A fixed budget of optimizer steps on the training text, run by a recovery right after a round
masks its heads: the LLM way to recover (a few hundred steps of LoRA or distillation on a
calibration corpus) rather than the schedule's fine-tuning epochs under a Trainer. It works with
no Trainer at all, so it serves a retraining-free prune and every round of an iterative one.

AdamW on the parameters that require grad, a linear warm-up over the first tenth of the steps and
a cosine decay to zero, gradients clipped to `max_grad_norm`; the loss is the recovery's
`training_loss` (next-token cross-entropy, or the distillation mix). The training loader is
cycled when `steps` outlasts it. A non-finite loss stops the run loudly before it reaches the
weights.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from headprune.lr_schedules import warmup_cosine

log = logging.getLogger(__name__)
WINDOW = 10  # steps averaged for the first and last loss in the report (fewer in a short run)


@contextmanager
def trainable(model: nn.Module, pick: Callable[[str], bool]) -> Iterator[None]:
    """Only the parameters whose names `pick` accepts require grad inside the block; every
    parameter there at its start has its flag back afterwards (ones added inside are not touched)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for name, p in model.named_parameters():
            p.requires_grad_(pick(name))
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def cycle(loader: Iterable) -> Iterator[dict]:
    """The loader's batches again and again (a new pass, reshuffled by its sampler, when one ends)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the training loader yields no batches")


def train_steps(model: nn.Module, loader: Iterable, loss_fn: Callable[[nn.Module, dict], torch.Tensor], steps: int,
                lr: float, max_grad_norm: float = 1.0, label: str = "recovery") -> dict:
    """Train `model`'s parameters that require grad for `steps` steps of `loss_fn(model, batch)`
    (a scalar); returns a report: steps, tokens seen, seconds, first and last loss (each the mean
    over `loss_window` steps: `WINDOW`, or half the steps when there are fewer than 2 x WINDOW, so
    the two never share a step and a loss that moved shows as moved), trainable parameters and
    the peak learning rate."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{label}: no parameter requires grad, nothing to train")
    device = params[0].device
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, steps))
    was_training = model.training
    model.train()
    losses, tokens, start = [], 0, time.perf_counter()
    batches = cycle(loader)
    try:
        for step in range(steps):
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in next(batches).items()}
            loss = loss_fn(model, batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{label}: the training loss is {loss.item()} at step {step + 1} of {steps}; "
                                         f"nothing was written. Allowed: a lower learning rate (now {lr})")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
            if (step + 1) % max(1, steps // 10) == 0:
                log.info("%s: step %d/%d loss %.4f (%.1f s)", label, step + 1, steps, losses[-1],
                         time.perf_counter() - start)
    finally:
        model.train(was_training)
        optimizer.zero_grad(set_to_none=True)  # no stale gradients (or their memory) after the recovery
    window = max(1, min(WINDOW, len(losses) // 2))
    return {"steps": steps, "tokens": tokens, "lr": lr, "trainable_params": sum(p.numel() for p in params),
            "loss_first": sum(losses[:window]) / window, "loss_last": sum(losses[-window:]) / window,
            "loss_window": window,
            "train_seconds": round(time.perf_counter() - start, 3)}
