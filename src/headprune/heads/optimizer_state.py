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
    its output-projection columns, and its rows of per-head position projections (DeBERTa-v2).
    Empty if the head was physically removed."""
    adapter = get_adapter(model)
    parts = adapter.head_rows(model, layer).get(head)
    if parts is None:
        return []
    owned = ("q", "o") if adapter.group_size(model.config) > 1 else ("q", "k", "v", "o")
    owned += tuple(part for part in parts if part in adapter.position_projections)  # DeBERTa-v2's, per query head
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


def carry_optimizer_state(optimizers, sliced) -> int:
    """Point `optimizers` at the parameters `prune_heads` created (its `sliced` list) and keep the
    surviving slice of each one's state: tensors shaped like the old parameter (Adam's moments)
    are sliced the same way, everything else (step counts) is kept as it is. Param-group
    settings and LR schedulers are untouched, so training continues where it was.
    Returns the number of parameters moved."""
    moved = 0
    for old, new, dim, index in sliced:
        for opt in optimizers:
            for group in opt.param_groups:
                for i, p in enumerate(group["params"]):
                    if p is old:
                        group["params"][i] = new
                        moved += 1
            if old in opt.state:
                state = opt.state.pop(old)
                opt.state[new] = {k: v.index_select(dim, index.to(v.device))
                                  if hasattr(v, "shape") and v.shape == old.shape and v.dim() > 0 else v
                                  for k, v in state.items()}
    return moved
