"""Multirun sweeps of headprune-train through the CLI (conf/hydra/launcher, conf/hydra/sweeper): a
failed job does not stop the others, the joblib launcher runs jobs in parallel, and the Optuna
sweepers run offline and are collected. (Their settings checks: test_sweep_checks.py.) Hydra's
command line runs in this process (train_cli); the joblib launcher's jobs run in its own worker
processes, the basic launcher's in this one."""
import pytest

from tests.helpers import results, train_cli

pytestmark = pytest.mark.slow


def test_failed_job_in_multirun_does_not_stop_the_others(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    proc = train_cli("-m", "model=tiny_bert", "debug=fast", "logger=wandb", "data.max_train_samples=32",
                     "data.score_samples=16", f"data.data_dir={data_dir}", "schedule.target_sparsity=1.5,0.25",
                     f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode != 0
    assert "schedule.target_sparsity=1.5" in proc.stderr + proc.stdout
    done = results(tmp_path / "1")
    assert done["config"]["schedule"]["target_sparsity"] == 0.25 and done["final"]["rounds_completed"] == 1
    assert not (tmp_path / "0" / "results.json").exists()


def test_joblib_launcher_sweep(tmp_path, data_dir):
    """Two jobs at once in joblib's worker processes (the launcher's own), started from Hydra's
    command line in this process."""
    proc = train_cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model=tiny_bert", "debug=fast",
                     "data.max_train_samples=32", "data.score_samples=16",
                     "export=false", "diagnostics.enabled=false",  # what the jobs do is not under test here
                     f"data.data_dir={data_dir}", "layer_policy=global,uniform", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    policies = {results(tmp_path / str(i))["config"]["layer_policy"]["_target_"].rsplit(".", 1)[1] for i in (0, 1)}
    assert policies == {"GlobalPolicy", "UniformPolicy"}


@pytest.mark.parametrize("sweeper,extra,values", [
    ("headprune_optuna", [], 1),
    ("headprune_optuna_pareto", ["objectives=[val_acc,kept_share]"], 2),
])
def test_optuna_sweep_of_three_trials_is_collected(sweeper, extra, values, tmp_path, data_dir):
    """The ready Optuna configs run offline on the tiny model (one objective, then accuracy against
    the share of heads kept), and headprune-collect gathers the trials like any sweep."""
    import yaml

    from headprune.apps.collect import load_runs

    proc = train_cli("-m", f"hydra/sweeper={sweeper}", "hydra.sweeper.n_trials=3", *extra, "model=tiny_bert",
                     "debug=fast", "logger=none", "data.max_train_samples=32", "data.score_samples=16",
                     "data.max_validation_samples=32", "export=false", "diagnostics.enabled=false",
                     f"data.data_dir={data_dir}", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    best = summary.get("best_value", None) if values == 1 else [s["values"] for s in summary["solutions"]]
    assert best is not None and (values == 1 or all(len(v) == 2 for v in best))
    runs = load_runs([tmp_path])
    assert len(runs) == 3 and all(r["overrides"]["metric"] in ("taylor", "fisher", "lrp", "magnitude") for r in runs)
