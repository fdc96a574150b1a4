"""`recovery=none`: prune and stop; nothing trains or tunes the model after a round."""
from __future__ import annotations

from dataclasses import dataclass

from headprune.recovery.base import Recovery, trains_after_pruning


@dataclass
class NoRecovery(Recovery):
    """Prune and stop (the schedule must have no epochs after pruning)."""

    def follows_kv_modes(self) -> bool:
        return True  # nothing changes after the choice

    def check(self, schedule) -> None:
        if trains_after_pruning(schedule):
            raise ValueError(f"recovery=none trains nothing after pruning, but schedule.epochs_per_round="
                             f"{schedule.epochs_per_round} and schedule.recover_epochs={schedule.recover_epochs}; "
                             "allowed: both 0, or recovery=finetune")
