"""Pruning schedules: how sparse the model is after each round, how long to fine-tune, and
when to stop early.

A schedule is a small validated object; `sparsities()` is the pure part (the sparsity
reached after round 1, 2, ...), the epoch counts say when rounds happen.
Sparsity is the share of the ORIGINAL head count that is pruned.

Timeline for baseline_epochs=b, epochs_per_round=e and R rounds (`round_epoch`): after epoch b
the baseline is evaluated and round 1 prunes; after epoch b + k*e round k's fine-tuned
validation metrics are recorded and round k+1 prunes; after epoch b + R*e the last round is
recorded, and `recover_epochs` more epochs may follow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def _check_fraction(field: str, value: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and ((0.0 < value < 1.0) if low_open else (0.0 <= value < 1.0))
    if not ok:
        interval = "(0, 1)" if low_open else "[0, 1)"
        raise ValueError(f"schedule.{field}={value!r} is outside {interval}: it is a share of the "
                         "model's heads, and at least one head must remain")


def _check_count(field: str, value: int, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"schedule.{field}={value!r} must be an integer >= {minimum}")


@dataclass
class Schedule:
    """Common fields. `recover_epochs`: extra fine-tuning after the last round.
    `reset_optimizer_state`: zero the optimizer's moment estimates of pruned heads' weights."""

    target_sparsity: float = 0.5
    baseline_epochs: int = 1
    epochs_per_round: int = 1
    recover_epochs: int = 0
    reset_optimizer_state: bool = False

    def __post_init__(self) -> None:
        _check_fraction("target_sparsity", self.target_sparsity)
        _check_count("baseline_epochs", self.baseline_epochs)
        _check_count("epochs_per_round", self.epochs_per_round)
        _check_count("recover_epochs", self.recover_epochs)

    def sparsities(self) -> list[float]:
        raise NotImplementedError

    @property
    def num_rounds(self) -> int:
        return len(self.sparsities())

    def total_epochs(self) -> int:
        return self.baseline_epochs + self.num_rounds * self.epochs_per_round + self.recover_epochs

    def heads_after(self, round_index: int, total_heads: int) -> int:
        """Number of heads pruned in total after round `round_index` (0-based)."""
        return int(round(self.sparsities()[round_index] * total_heads))

    def heads_to_prune(self, round_index: int, alive) -> int:
        """How many more heads round `round_index` (0-based) removes from the bool keep-mask `alive`."""
        total = alive.numel()
        return max(self.heads_after(round_index, total) - (total - int(alive.sum())), 0)

    def round_epoch(self, round_index: int) -> int:
        """Training epochs completed when round `round_index` (0-based) prunes; the previous
        round's fine-tuning ends at the same point."""
        return self.baseline_epochs + round_index * self.epochs_per_round

    def stop_reason(self, baseline: dict, val: dict) -> str | None:
        """Why to stop after a round whose fine-tuned metrics on the selection slice are `val`
        (`baseline`: the unpruned model's, on the same slice), or None."""
        return None

    @property
    def can_reject(self) -> bool:
        """Whether a round may be rejected after its fine-tuning (and its heads restored), so that
        they may leave the model physically only once the next round starts."""
        return type(self).stop_reason is not Schedule.stop_reason

    def check_metrics(self, available: tuple[str, ...], task: str) -> None:
        """Fail before any training when the stopping rule reads a validation metric that a
        `task` run does not report (`available`)."""

    def selection_samples(self) -> int:
        """Training examples to hold out for the stopping rule to decide on (0: it reads nothing)."""
        return 0

    def check_model(self, total_heads: int) -> None:
        """One rule for every schedule: at least one head of the model must remain."""
        last = self.sparsities()[-1] if self.sparsities() else 0.0
        if round(last * total_heads) >= total_heads:
            raise ValueError(f"schedule.target_sparsity={self.target_sparsity} removes all {total_heads} heads of this "
                             f"model (round({last} x {total_heads}) = {round(last * total_heads)}); allowed: at most "
                             f"{(total_heads - 1) / total_heads:.4f}, so that at least one head remains")


@dataclass
class OneShot(Schedule):
    """Prune straight to the target in one round, then fine-tune `epochs_per_round`."""

    def sparsities(self) -> list[float]:
        return [self.target_sparsity] if self.target_sparsity > 0 else []


@dataclass
class Iterative(Schedule):
    """Prune `step` of the original heads per round until `target_sparsity` (the last step may be
    smaller), fine-tuning `epochs_per_round` after each round."""

    step: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fraction("step", self.step, low_open=True)

    def sparsities(self) -> list[float]:
        if self.target_sparsity == 0:
            return []
        n = max(1, math.ceil(self.target_sparsity / self.step - 1e-9))
        return [min(round(self.step * (i + 1), 10), self.target_sparsity) for i in range(n - 1)] + [
            self.target_sparsity]


@dataclass
class Cubic(Schedule):
    """Zhu & Gupta (2017) ramp: s_t = s_f + (s_i - s_f)(1 - t/n)^3 for rounds t = 1..n. Prunes
    fast while many redundant heads remain and slowly near the target."""

    rounds: int = 5
    initial_sparsity: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_count("rounds", self.rounds, minimum=1)
        _check_fraction("initial_sparsity", self.initial_sparsity)
        if self.initial_sparsity > self.target_sparsity:
            raise ValueError(f"schedule.initial_sparsity={self.initial_sparsity} must be <= "
                             f"schedule.target_sparsity={self.target_sparsity}")

    def sparsities(self) -> list[float]:
        if self.target_sparsity == 0:
            return []
        s_i, s_f, n = self.initial_sparsity, self.target_sparsity, self.rounds
        ramp = [s_f + (s_i - s_f) * (1 - t / n) ** 3 for t in range(1, n)]
        # rounded to 10 places against float noise, unless that would round a tiny target's step to 0; a
        # step that underflows to 0 itself (a subnormal target) is no round at all
        return [min(round(x, 10) if round(x, 10) > 0 else x, s_f) for x in ramp if x > 0] + [s_f]


@dataclass
class UntilThreshold(Iterative):
    """Iterative pruning by `step` up to `target_sparsity` (the most it may reach) that stops as
    soon as a fine-tuned round's validation `metric` falls below `threshold` x the unpruned
    baseline; the callback then restores the last good mask. The rule reads `select_samples`
    training examples held out for it (never the validation set that results report)."""

    threshold: float = 0.99
    metric: str = "acc"
    select_samples: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.threshold, (int, float)) or not 0.0 < self.threshold <= 1.5:
            raise ValueError(f"schedule.threshold={self.threshold!r} must be in (0, 1.5]: a fraction of the "
                             "baseline metric")
        if self.metric != "acc":
            raise ValueError(f"schedule.metric={self.metric!r} is not allowed; allowed: acc")
        _check_count("select_samples", self.select_samples, minimum=1)

    def selection_samples(self) -> int:
        return self.select_samples

    def check_metrics(self, available: tuple[str, ...], task: str) -> None:
        if self.metric not in available:
            raise ValueError(f"schedule.metric={self.metric!r} is not reported by a model.task={task} run "
                             f"(its validation metrics: {', '.join(available)}); schedule=until_threshold "
                             "allows: acc. Use schedule=one_shot, iterative or cubic with this task")

    def stop_reason(self, baseline: dict, val: dict) -> str | None:
        floor = self.threshold * baseline[self.metric]
        if val[self.metric] < floor:
            return (f"threshold: selection-slice {self.metric} {val[self.metric]:.4f} < {self.threshold} x baseline "
                    f"{baseline[self.metric]:.4f} = {floor:.4f}")
        return None


SCHEDULES = {"one_shot": OneShot, "iterative": Iterative, "cubic": Cubic, "until_threshold": UntilThreshold}
