"""Recovery after pruning: what the model is trained (or tuned) with after heads go.

`RECOVERIES` maps each `recovery=` option to its typed settings:
- `finetune` (default): the task loss, for the schedule's fine-tuning epochs;
- `distill`: the task loss mixed with distillation from the unpruned model (`distill.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

from headprune.recovery.distill import Distill


@dataclass
class Finetune:
    """`recovery=finetune`: fine-tune on the task loss alone (the schedule's epochs)."""


RECOVERIES = {"finetune": Finetune, "distill": Distill}
