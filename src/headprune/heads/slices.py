"""Which slices of which parameters belong to one attention head (for optimizer-state resets
and per-head weight statistics), in each architecture's own weight layout."""
from __future__ import annotations

from torch import nn

from headprune.heads.adapters import _get, get_adapter, head_layout


def head_parameter_slices(model: nn.Module, layer: int, head: int) -> list[tuple[nn.Parameter, int, slice]]:
    """(parameter, dim, slice) triples covering head `head` (original id) of `layer`: its Q rows
    (and K/V rows where the head owns its key/value head, i.e. no GQA sharing) and its
    output-projection columns. Empty if the head was physically removed."""
    adapter = get_adapter(model)
    kept = head_layout(model)[layer]
    if head not in kept:
        return []
    pos = kept.index(head)
    d = adapter.head_dim(model.config)
    rows = slice(pos * d, (pos + 1) * d)
    attn = adapter.attention(adapter.blocks(model)[layer])
    out = []
    if adapter.name == "gpt2":
        n_kept = len(kept)
        for part in range(3):  # c_attn = [Q | K | V], Conv1D weight is (in, out)
            cols = slice(part * n_kept * d + pos * d, part * n_kept * d + (pos + 1) * d)
            out += [(attn.c_attn.weight, 1, cols), (attn.c_attn.bias, 0, cols)]
        out.append((attn.c_proj.weight, 0, rows))
        return out
    shared_kv = adapter.num_kv_heads(model.config) != adapter.num_heads(model.config)
    names = [adapter.q] if shared_kv else [adapter.q, adapter.k, adapter.v]
    for name in names:
        proj = _get(attn, name)
        out.append((proj.weight, 0, rows))
        if getattr(proj, "bias", None) is not None:
            out.append((proj.bias, 0, rows))
    out.append((_get(attn, adapter.o).weight, 1, rows))
    return out


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
