"""Checks of an Optuna sweep's settings before its first trial, as a Hydra callback.

conf/hydra/sweeper/headprune_optuna*.yaml register `SweepChecks` under `hydra.callbacks`; Hydra
calls `on_multirun_start` before the sweeper starts. Without it, `hydra.sweeper.n_trials=0` ends
in Optuna's "No trials are completed yet", and a two-direction (Pareto) sweep of a run returning
one objective fails only after a whole trial, exiting 0 with no Pareto solutions.
"""
from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

DIRECTIONS = ("maximize", "minimize")


def sweep_problem(config: DictConfig) -> str | None:
    """What makes the sweep settings in `config` (hydra.sweeper.*, objectives) unusable; None if
    nothing does."""
    sweeper = config.hydra.sweeper
    for field in ("n_trials", "n_jobs"):
        value = sweeper.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"hydra.sweeper.{field}={value!r}: allowed: an integer >= 1"
    direction = sweeper.get("direction")
    directions = list(direction) if isinstance(direction, (list, ListConfig)) else [direction]
    shown = OmegaConf.to_object(direction) if isinstance(direction, ListConfig) else direction
    for d in directions:
        if str(d).lower() not in DIRECTIONS:
            return (f"hydra.sweeper.direction={shown}: {d!r} is not allowed; allowed: {', '.join(DIRECTIONS)} "
                    "(or a list of them, one per objective)")
    objectives = config.get("objectives")
    names = list(objectives) if isinstance(objectives, (list, ListConfig)) else [objectives]
    if len(names) != len(directions):
        noun = "objective" if len(names) == 1 else "objectives"
        return (f"objectives={names} names {len(names)} {noun}, but hydra.sweeper.direction="
                f"{directions if len(directions) > 1 else directions[0]} optimises {len(directions)}: give one "
                f"objective per direction (e.g. objectives=[val_acc,kept_share] for two; see train.yaml `objectives`)")
    return None


class SweepChecks(Callback):
    """Refuses a sweep whose settings could only fail later (see `sweep_problem`): exit 1 with
    the message, before the sweeper starts."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problem = sweep_problem(config)
        if problem:
            # SystemExit, not ValueError: Hydra turns a callback's Exception into a warning and sweeps on
            raise SystemExit(f"headprune-train: sweep settings: {problem}")
