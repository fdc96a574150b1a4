"""Recovery after pruning: what the model is trained (or tuned) with after heads go.

`RECOVERIES` maps each `recovery=` option to its typed settings:
- `finetune` (default): the task loss, for the schedule's fine-tuning epochs;
- `distill`: the task loss mixed with distillation from the unpruned model (`distill.py`);
- `least_squares`: no training, least-squares scales of the surviving heads (`least_squares.py`);
- `none`: nothing (the schedule must have no epochs after pruning).
"""
from __future__ import annotations

from dataclasses import dataclass

from headprune.recovery.distill import Distill
from headprune.recovery.least_squares import LeastSquares


@dataclass
class Finetune:
    """`recovery=finetune`: fine-tune on the task loss alone (the schedule's epochs)."""


@dataclass
class NoRecovery:
    """`recovery=none`: prune and stop."""


RECOVERIES = {"finetune": Finetune, "distill": Distill, "least_squares": LeastSquares, "none": NoRecovery}
