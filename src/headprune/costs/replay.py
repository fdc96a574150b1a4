"""Replaying one forward's attention calls: the attention work of a forward without the
feed-forward blocks, embeddings or the rest of the model's Python.

One untimed forward records, with forward pre-hooks, the exact inputs of every layer's attention
core and, where it sits outside the core, of its output projection (BERT: `BertSelfAttention`,
then `output.dense`); `replay` calls them again, layer after layer, on the recorded hidden
states. The bench times attention this way and the latency lookup table (`costs.latency`) times
one layer's attention with 0..U units kept.
"""
from __future__ import annotations

import torch
from torch import nn

from headprune.heads.adapters import get_adapter


CACHE_KWARGS = ("cache", "past_key_values", "layer_past")  # what a decoder's attention gets its KV cache as


def record_attention_calls(model: nn.Module, input_ids: torch.Tensor) -> list[tuple[nn.Module, tuple, dict]]:
    """(module, args, kwargs) of every attention core and outside output projection call, in order.
    The KV cache a decoder's forward hands its attention is not recorded (None instead): each
    replay would append the recorded tokens to it again, timing attention over ever more keys."""
    calls: list[tuple[nn.Module, tuple, dict]] = []

    def record(m, args, kwargs):
        calls.append((m, args, {k: None if k in CACHE_KWARGS else v for k, v in kwargs.items()}))

    handles = [module.register_forward_pre_hook(record, with_kwargs=True, prepend=True)  # prepend: before any gate
               for module in attention_parts(model)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def attention_parts(model: nn.Module) -> list[nn.Module]:
    """Per layer: the attention core, plus the output projection when the core does not hold it."""
    adapter = get_adapter(model)
    parts = []
    for block in adapter.blocks(model):
        attn = adapter.attention(block)
        parts.append(attn.get_submodule(adapter.core) if adapter.core else attn)
        if adapter.core and not adapter.o.startswith(adapter.core + "."):
            parts.append(attn.get_submodule(adapter.o))
    return parts


def replay(calls: list[tuple[nn.Module, tuple, dict]]) -> None:
    for module, args, kwargs in calls:
        module(*args, **kwargs)
