"""The Optuna sweeps' settings are checked before the first trial (apps/sweep_checks.py, wired
into conf/hydra/sweeper/*.yaml as a Hydra callback)."""
import re

import pytest

from tests.helpers import train_cli

BASE = ["model=tiny_bert", "debug=fast", "logger=none", "data.max_train_samples=32", "data.score_samples=16",
        "data.max_validation_samples=32"]


def _sweep(tmp_path, data_dir, *overrides):
    """`headprune-train -m ...` (Hydra's multirun, the sweeper's callbacks), in this process."""
    return train_cli("-m", *overrides, *BASE, f"data.data_dir={data_dir}", f"hydra.sweep.dir={tmp_path / 'sweep'}")


@pytest.mark.parametrize("overrides, pattern", [
    (["hydra/sweeper=headprune_optuna", "hydra.sweeper.n_trials=0"], "hydra.sweeper.n_trials=0.*allowed: an integer >= 1"),
    (["hydra/sweeper=headprune_optuna_pareto", "hydra.sweeper.n_trials=-2"], "hydra.sweeper.n_trials=-2"),
    (["hydra/sweeper=headprune_optuna_pareto", "hydra.sweeper.n_trials=1"],
     r"objectives=\['headline'\] names 1 objective.*hydra.sweeper.direction.*2"),
    (["hydra/sweeper=headprune_optuna", "objectives=[val_acc,kept_share]", "hydra.sweeper.n_trials=1"],
     r"objectives=\['val_acc', 'kept_share'\] names 2 objectives.*hydra.sweeper.direction.*1"),
])
def test_bad_sweep_settings_fail_before_the_first_trial(overrides, pattern, tmp_path, data_dir):
    proc = _sweep(tmp_path, data_dir, *overrides)
    assert proc.returncode == 1

    assert re.search(pattern, proc.stderr), proc.stderr[-3000:]
    assert "Launching" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr  # refused, not crashed
    assert not list(tmp_path.rglob("results.json"))  # refused before any trial ran


def test_the_check_itself(tmp_path):
    """The callback on its own: the shipped settings pass; each bad field is named."""
    from omegaconf import OmegaConf

    from headprune.apps.sweep_checks import SweepChecks, sweep_problem

    good = OmegaConf.create({"objectives": ["val_acc", "kept_share"],
                             "hydra": {"sweeper": {"n_trials": 3, "n_jobs": 1, "direction": ["maximize", "minimize"]}}})
    assert sweep_problem(good) is None
    SweepChecks().on_multirun_start(good)
    for field, value, pattern in [("n_trials", 2.5, "n_trials=2.5"), ("n_jobs", 0, "n_jobs=0"),
                                  ("direction", ["maximize", "up"], "direction.*'up'.*maximize, minimize")]:
        bad = OmegaConf.merge(good, {"hydra": {"sweeper": {field: value}}})
        with pytest.raises(SystemExit, match=pattern):
            SweepChecks().on_multirun_start(bad)
