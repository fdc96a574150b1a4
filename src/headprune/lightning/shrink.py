"""Physical shrink in the middle of `fit`: pruned heads leave the model, the optimizer and DDP.

After a round the pruning callback calls `shrink`: `prune_heads` slices the heads out of the
weights (new, smaller parameters), the optimizer is pointed at the new parameters with the
surviving slice of its state (AdamW moments sliced, step counts kept; the LR scheduler holds the
same optimizer object, so the schedule goes on where it was), and under DDP the model is wrapped
anew, so that gradient buckets cover the new parameters. Later epochs then compute only the heads
that are left.
"""
from __future__ import annotations

import logging

import lightning as L
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from headprune.heads.optimizer_state import carry_optimizer_state
from headprune.heads.surgery import prune_heads

log = logging.getLogger(__name__)


def shrink_supported(trainer: L.Trainer | None) -> tuple[bool, str]:
    """(whether heads can leave the model mid-fit under this trainer's strategy, why not)."""
    if trainer is None:
        return True, ""
    strategy = trainer.strategy
    if type(strategy) in (SingleDeviceStrategy, DDPStrategy):
        return True, ""
    return False, f"the {type(strategy).__name__} strategy cannot re-wrap a model whose parameters changed"


def shrink(pl_module: L.LightningModule, heads, trainer: L.Trainer | None = None) -> int:
    """Remove `heads` ((layer, head) pairs, original ids) from `pl_module.model` in place, carry the
    optimizer state over and, under DDP, re-wrap the model. Returns the number of parameters
    replaced."""
    sliced = []
    prune_heads(pl_module.model, heads, sliced=sliced)
    if trainer is None or not sliced:
        return len(sliced)
    carry_optimizer_state(trainer.optimizers, sliced)
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy):
        # DDP registered hooks on the old parameters and sized its buckets for them: wrap again
        # (a collective: every rank shrinks at the same epoch boundary, with the same heads)
        strategy.model = strategy._setup_model(strategy.lightning_module)
        strategy._register_ddp_hooks()
    return len(sliced)
