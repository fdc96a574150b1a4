"""Folding a HeadMask into the model: after it, the model computes with no hook what the masked
(and scaled) model computed, with the pruned heads physically gone.

Gate values other than 0 and 1 (least-squares scales, `recovery=least_squares`) scale their
heads' output-projection columns; learned L0 gates (`metric=l0_gates`) are replaced by their
deterministic test-time values first, and heads whose gate is then 0 are removed as well.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from headprune.heads.mask import HeadMask
from headprune.heads.surgery import prune_heads, scale_heads

log = logging.getLogger(__name__)


@torch.no_grad()
def fold(model: nn.Module, mask: HeadMask, verify: bool | None = None) -> dict:
    """Fold `mask` into `model` in place and detach it (module docstring). Returns what was
    folded, for results.json: `l0_gates_folded` (heads closed by learned gates) and
    `gates_folded` (scales other than 0 and 1), each only when it applies. The removal verifies
    itself (`prune_heads`' `verify`: a `heads.verify.SurgeryError` before anything is saved)."""
    gates = mask.mask.detach().clone()  # (L, H)
    info: dict = {}
    if mask.stochastic is not None:
        gates = mask.stochastic.deterministic() * gates
        closed = int(((gates == 0).cpu() & mask.alive()).sum())
        if closed:
            log.info("fold: %d heads whose learned gate is closed are removed as well", closed)
        info["l0_gates_folded"] = {"closed_heads": closed, "heads_per_layer": [int(n) for n in (gates > 0).sum(1)]}
        mask.stochastic = None
    if bool(((gates != 0) & (gates != 1)).any()):
        scale_heads(model, gates)
        info["gates_folded"] = "gate values other than 0 and 1 scaled into the output projection"
    mask.mask.copy_((gates > 0).to(mask.mask))
    pruned = mask.pruned()
    mask.detach()
    prune_heads(model, pruned, verify=verify)
    return info
