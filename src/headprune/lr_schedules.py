"""Learning-rate schedules, one module for every training loop: `warmup_decay` for a Trainer's
fine-tuning epochs (a `partial`-friendly factory, Hydra: `_partial_: true`, conf/optim/) and
`warmup_cosine` for a recovery's fixed step budget (engine/step_fit.py)."""
from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_decay(optimizer: Optimizer, total_steps: int, warmup_ratio: float = 0.06,
                 decay: str = "linear", final_ratio: float = 0.0) -> LambdaLR:
    """Linear warm-up over `warmup_ratio` of the steps, then `decay`: "linear" to
    `final_ratio` x peak at the last step, or "constant"."""
    if decay not in ("linear", "constant"):
        raise ValueError(f"optim.scheduler.decay={decay!r} is not allowed; allowed: linear, constant")
    if not 0.0 <= warmup_ratio < 1.0:
        raise ValueError(f"optim.scheduler.warmup_ratio={warmup_ratio!r} must be in [0, 1)")
    total_steps = max(int(total_steps), 1)
    warmup = int(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if decay == "constant":
            return 1.0
        progress = (step - warmup) / max(total_steps - warmup, 1)
        return max(final_ratio, 1.0 - (1.0 - final_ratio) * progress)

    return LambdaLR(optimizer, factor)


def warmup_cosine(step: int, steps: int) -> float:
    """The factor of the peak rate at `step` of `steps`: a linear warm-up over the first tenth of
    the steps, then cosine to zero."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
