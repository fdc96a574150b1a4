"""Optimizer state of individual heads: zeroing a pruned head's moment estimates.

The slices come from the adapter's `head_rows`, so every family's weight layout (GPT-2's fused
`c_attn` included) is handled in one place.
"""
from __future__ import annotations

from torch import nn

from headprune.heads.adapters import get_adapter


def head_parameter_slices(model: nn.Module, layer: int, head: int) -> list[tuple[nn.Parameter, int, slice]]:
    """(parameter, dim, slice) triples covering head `head` (original id) of `layer`: its Q rows
    (and K/V rows where the head owns its key/value head, i.e. no GQA sharing), with biases, and
    its output-projection columns. Empty if the head was physically removed."""
    adapter = get_adapter(model)
    parts = adapter.head_rows(model, layer).get(head)
    if parts is None:
        return []
    owned = ("q", "o") if adapter.group_size(model.config) > 1 else ("q", "k", "v", "o")
    return [s for part in owned for s in parts[part].param_slices()]


def reset_optimizer_state(optimizers, model: nn.Module, heads) -> int:
    """Zero every tensor-valued optimizer state entry (e.g. Adam's moments) on the slices of
    `heads`; returns the number of slices reset."""
    n = 0
    for layer, head in heads:
        for param, dim, sl in head_parameter_slices(model, layer, head):
            for opt in optimizers:
                state = opt.state.get(param, {})
                for value in state.values():
                    if hasattr(value, "shape") and value.shape == param.shape:
                        value.narrow(dim, sl.start, sl.stop - sl.start).zero_()
                        n += 1
    return n
