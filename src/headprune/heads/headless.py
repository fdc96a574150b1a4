"""What an attention layer becomes when every one of its heads is removed.

HF attention forwards reshape with `-1` heads, which is ambiguous for an empty tensor, so a
layer with no heads left cannot run its own forward. `HeadlessAttention` replaces its core
and returns exactly what masking all heads gives: the output projection's bias, with no
matmul. A KV cache still has to advance (models read the sequence length from a layer's
cache, usually layer 0), so the layer stores (B, 0, T, D) tensors and counts their tokens.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from headprune.heads.adapters import num_features


class HeadlessAttention(nn.Module):
    """Stands in for an attention core with no heads.

    The core's (now empty) projections stay as children under their names, so state dicts and
    adapters see the same keys. `out` names the output projection among them, or is None when
    the projection sits outside the core (BERT): the core then returns an empty (B, T, 0)
    context for it. In training mode GPT-2 would also apply dropout to the bias; this does not.
    """

    def __init__(self, core: nn.Module, out: str | None, head_dim: int, layer_idx: int | None):
        super().__init__()
        for name, child in core.named_children():
            self.add_module(name, child)
        self.out = out
        self.head_dim = head_dim
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        batch, tokens = hidden_states.shape[:2]
        cache = next((kwargs[k] for k in ("cache", "past_key_values", "layer_past") if kwargs.get(k) is not None), None)
        if cache is not None and self.layer_idx is not None:
            empty = hidden_states.new_zeros(batch, 0, tokens, self.head_dim)  # (B, 0, T, D)
            _advance(cache, self.layer_idx, empty)
        if self.out is None:
            return hidden_states.new_zeros(batch, tokens, 0), None  # (B, T, 0)
        proj = self.get_submodule(self.out)
        proj = getattr(proj, "base_layer", proj)  # under LoRA (peft) the layer it wraps has the shapes
        output = hidden_states.new_zeros(batch, tokens, num_features(proj, outputs=True))  # (B, T, hidden)
        if proj.bias is not None:
            output = output + proj.bias
        return output, None


class HeadlessCacheLayer(DynamicLayer):
    """A DynamicLayer that reports its length although its (B, 0, T, D) tensors are empty."""

    def get_seq_length(self) -> int:
        if not self.is_initialized or self.keys.dim() != 4:
            return 0
        return self.keys.shape[-2]


def _advance(cache, layer_idx: int, empty: torch.Tensor) -> None:
    cache = getattr(cache, "self_attention_cache", cache)
    cache.update(empty, empty, layer_idx)
    layer = cache.layers[layer_idx]
    if type(layer) is DynamicLayer:
        layer.__class__ = HeadlessCacheLayer  # same state, length counted from the token axis
