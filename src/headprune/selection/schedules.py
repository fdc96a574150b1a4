"""Pruning schedules: how sparse the model is after each round, and how long to fine-tune.

A schedule is a small validated object; `sparsities()` is the pure part (the sparsity
reached after round 1, 2, ...), the epoch counts tell the callback when rounds happen.
Sparsity is the share of the ORIGINAL head count that is pruned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def _check_fraction(field: str, value: float, low_open: bool = False) -> None:
    ok = (0.0 < value < 1.0) if low_open else (0.0 <= value < 1.0)
    if not ok:
        interval = "(0, 1)" if low_open else "[0, 1)"
        raise ValueError(f"schedule.{field}={value!r} is outside {interval}: it is a share of the "
                         "model's heads, and at least one head must remain")


def _check_epochs(field: str, value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"schedule.{field}={value!r} must be an integer >= 0")


@dataclass
class Schedule:
    target_sparsity: float = 0.5
    baseline_epochs: int = 1
    epochs_per_round: int = 1

    def __post_init__(self) -> None:
        _check_fraction("target_sparsity", self.target_sparsity)
        _check_epochs("baseline_epochs", self.baseline_epochs)
        _check_epochs("epochs_per_round", self.epochs_per_round)

    def sparsities(self) -> list[float]:
        raise NotImplementedError

    @property
    def num_rounds(self) -> int:
        return len(self.sparsities())

    def total_epochs(self) -> int:
        return self.baseline_epochs + self.num_rounds * self.epochs_per_round

    def heads_after(self, round_index: int, total_heads: int) -> int:
        """Number of heads pruned in total after round `round_index` (0-based)."""
        return int(round(self.sparsities()[round_index] * total_heads))


@dataclass
class OneShot(Schedule):
    """Prune straight to the target in one round, then fine-tune `epochs_per_round`."""

    def sparsities(self) -> list[float]:
        return [self.target_sparsity] if self.target_sparsity > 0 else []


@dataclass
class Iterative(Schedule):
    """Prune `step` of the original heads per round until `target_sparsity` (last step may be
    smaller), fine-tuning `epochs_per_round` after each round."""

    step: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fraction("step", self.step, low_open=True)

    def sparsities(self) -> list[float]:
        if self.target_sparsity == 0:
            return []
        n = math.ceil(self.target_sparsity / self.step - 1e-9)
        return [round(min(self.step * (i + 1), self.target_sparsity), 10) for i in range(n)]
