"""Resuming a run (`apps/resume.py`): a finished run resumed changes nothing, a run killed during
its export finishes it, a resume with other experiment settings is refused naming them, and a
refused resume or a run refused for its data writes nothing into its run dir."""
import json
import os
import subprocess
import sys

import pytest

import headprune.apps.train as train_app
from headprune.apps.train import run
from tests.conftest import compose_train

BASE = ["model=tiny_bert", "logger=none", "data.max_train_samples=64", "data.score_samples=32",
        "data.max_validation_samples=32", "trainer.num_sanity_val_steps=0", "schedule=iterative",
        "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=1", "schedule.epochs_per_round=1",
        "diagnostics.enabled=false", "callbacks=default"]


class Killed(RuntimeError):
    pass


def _files(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir):
    """One finished run (checkpoints, export, results.json) the tests resume; copied per test."""
    out = tmp_path_factory.mktemp("finished")
    run(compose_train(out, data_dir, *BASE))
    return out


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    last = dst / "checkpoints" / "last.ckpt"
    results = json.loads((dst / "results.json").read_text())
    results["final"]["export_dir"] = str(dst / "export")  # the copy's own export
    (dst / "results.json").write_text(json.dumps(results))
    return last


def test_resuming_a_finished_run_changes_nothing(finished, tmp_path, data_dir):
    last = _copy(finished, tmp_path / "run")
    before = _files(tmp_path / "run")
    res = run(compose_train(tmp_path / "run", data_dir, *BASE, f"ckpt_path={last}"))
    assert res["final"]["stop_reason"] == "target_reached" and "val" in res["final"]
    assert _files(tmp_path / "run") == before


def test_a_run_killed_during_its_export_finishes_it_on_resume(tmp_path, data_dir, monkeypatch):
    out = tmp_path / "run"
    export = train_app.export_pruned

    def killed(*args, **kwargs):
        raise Killed("killed while exporting")

    monkeypatch.setattr(train_app, "export_pruned", killed)
    with pytest.raises(Killed):
        run(compose_train(out, data_dir, *BASE))
    monkeypatch.setattr(train_app, "export_pruned", export)
    before = json.loads((out / "results.json").read_text())
    assert "export_dir" not in before["final"]
    res = run(compose_train(out, data_dir, *BASE, f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}"))
    after = json.loads((out / "results.json").read_text())
    assert after["final"]["export_dir"] == str(out / "export") and (out / "export" / "config.json").is_file()
    for key in ("val", "pruned", "sparsity", "stop_reason"):
        assert after["final"][key] == before["final"][key] == res["final"][key]
    assert after["rounds"] == before["rounds"]


def test_a_resume_with_other_settings_is_refused_naming_them(finished, tmp_path, data_dir):
    last = _copy(finished, tmp_path / "run")
    before = _files(tmp_path / "run")
    overrides = ["metric=magnitude", "schedule.target_sparsity=0.75", "model.config_overrides.num_hidden_layers=2"]
    with pytest.raises(ValueError, match=r"other settings than this resume: .*metric\._target_.*"
                                         r"model\.config_overrides\.num_hidden_layers \(3 -> 2\).*"
                                         r"schedule\.target_sparsity \(0\.5 -> 0\.75\)"):
        run(compose_train(tmp_path / "run", data_dir, *BASE, *overrides, f"ckpt_path={last}"))
    assert _files(tmp_path / "run") == before


def test_a_schedule_without_epochs_has_nothing_to_resume(finished, tmp_path, data_dir):
    last = _copy(finished, tmp_path / "run")
    with pytest.raises(ValueError, match="trains no epoch.*no checkpoint to resume from"):
        run(compose_train(tmp_path / "run", data_dir, *BASE, "schedule.baseline_epochs=0",
                          "schedule.epochs_per_round=0", "recovery=least_squares", f"ckpt_path={last}"))


def test_refused_runs_write_nothing_into_their_run_dir(tmp_path, data_dir):
    """Through the CLI (Hydra writes .hydra/ and train.log in a run dir): a resume refused at a
    start-time check leaves the first run's record as it was, and a new run refused for its data
    (a check made after the data is read) leaves its run dir without .hydra/ or train.log."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cli = [sys.executable, "-m", "headprune.apps.train", "model=tiny_bert", "debug=fast", "data.max_train_samples=32",
           "data.score_samples=16", f"data.data_dir={data_dir}", "callbacks=default"]
    first = tmp_path / "first"
    assert subprocess.run([*cli, f"hydra.run.dir={first}"], env=env, capture_output=True, timeout=300).returncode == 0
    before = _files(first)
    resume = [*cli, f"hydra.run.dir={first}", "data.score_samples=0", f"ckpt_path={first}/checkpoints/last.ckpt"]
    proc = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "data.score_samples=0 leaves no held-out examples" in proc.stderr + proc.stdout
    assert _files(first) == before
    fresh = tmp_path / "fresh"
    proc = subprocess.run([*cli, f"hydra.run.dir={fresh}", "data.train_file=sst2/missing.tsv"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert not (fresh / ".hydra").exists() and not (fresh / "train.log").exists(), proc.stderr[-2000:]
