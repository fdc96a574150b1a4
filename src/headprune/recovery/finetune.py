"""`recovery=finetune` (the default): the schedule's fine-tuning epochs, on the task loss alone."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from headprune.recovery.base import Recovery


@dataclass
class Finetune(Recovery):
    """Fine-tune on the task loss for the schedule's epochs (none: prune only)."""

    trains: ClassVar[bool] = True
