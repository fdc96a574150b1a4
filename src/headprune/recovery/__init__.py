"""Recovery after pruning: what the model is trained (or tuned) with after heads go; one class per
`recovery=` option, each owning its behaviour through hooks (`base.py`):
- `finetune` (default): the task loss, for the schedule's fine-tuning epochs;
- `distill`: the task loss mixed with distillation from the unpruned model (`distill.py`), in the
  schedule's epochs or (`steps` > 0) for a step budget right after each round;
- `lora`: LoRA adapters trained for a step budget after each round and merged (`lora.py`);
- `least_squares`: no training, least-squares scales of the surviving heads and a bias per layer
  (`least_squares.py`);
- `bias_compensation`: no training, the removed heads' mean output as bias (FLAP, `bias_compensation.py`);
- `refit`: no training, each layer's output projection re-solved on its kept heads (ridge, `refit.py`);
- `chain`: several of these one after the other (a repair, then training on top of it; `chain.py`);
- `none`: nothing (the schedule must have no epochs after pruning).
"""
from __future__ import annotations

from headprune.recovery.base import Recovery
from headprune.recovery.bias_compensation import BiasCompensation
from headprune.recovery.chain import Chain
from headprune.recovery.distill import Distill
from headprune.recovery.finetune import Finetune
from headprune.recovery.least_squares import LeastSquares
from headprune.recovery.lora import Lora
from headprune.recovery.none import NoRecovery
from headprune.recovery.refit import Refit

RECOVERIES: dict[str, type[Recovery]] = {"finetune": Finetune, "distill": Distill, "lora": Lora,
                                         "least_squares": LeastSquares,
                                         "bias_compensation": BiasCompensation, "refit": Refit,
                                         "chain": Chain, "none": NoRecovery}


def make_recovery(recovery: Recovery | str | None) -> Recovery:
    """A Recovery from itself, its name or None (finetune)."""
    if recovery is None:
        return Finetune()
    if isinstance(recovery, Recovery):
        return recovery
    if recovery not in RECOVERIES:
        raise ValueError(f"recovery={recovery!r} is not allowed; allowed: {', '.join(RECOVERIES)}")
    return RECOVERIES[recovery]()


__all__ = ["RECOVERIES", "BiasCompensation", "Chain", "Distill", "Finetune", "LeastSquares", "Lora", "NoRecovery", "Recovery", "Refit", "make_recovery"]
