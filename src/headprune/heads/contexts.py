"""What enters each layer's attention output projection (the heads' concatenated contexts, after
a HeadMask's gate), streamed over the real tokens of a loader: the per-layer sums that bias
compensation (the dense model's mean contexts) and the refit-error ranking (the kept contexts'
Gram matrices) accumulate, one forward pass per batch ended after the last layer read."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from headprune.heads.adapters import get_adapter
from headprune.tasks import forward_logits, real_tokens, to_device


class _Done(Exception):
    """Raised in the last layer's hook: nothing after it is needed."""


@torch.no_grad()
def stream_contexts(model: nn.Module, loader, layers: Iterable[int], consume: Callable[[int, torch.Tensor], None],
                    device, max_batches: int | None = None) -> torch.Tensor:
    """Run `model` over `loader` in eval mode and call `consume(layer, x)` for each of `layers`
    with its output projection's input at the batch's real tokens, x (N, features), in layer
    order. Returns the real tokens seen (a float64 scalar on `device`)."""
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    layers = sorted(set(layers))
    last = layers[-1] if layers else -1
    current: dict = {}

    def hook(layer: int):
        def add(module, args):
            consume(layer, args[0][current["real"]])  # (B, T, F) -> (N, F)
            if layer == last:
                raise _Done
        return add

    handles = [adapter.out_proj(blocks[layer]).register_forward_pre_hook(hook(layer)) for layer in layers]
    was_training = model.training
    model.eval()
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(batch, device)
            current["real"] = real_tokens(batch)
            tokens += current["real"].sum()
            try:
                forward_logits(model, batch)
            except _Done:
                pass
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return tokens
