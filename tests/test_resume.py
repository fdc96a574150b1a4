"""Resuming a run (`runs/resume.py`): a run that crashed resumes to where an uninterrupted run
ends, a finished run resumed changes nothing, a run killed during its export finishes it, and a
resume with other experiment settings is refused naming them. (A refused resume through the CLI
writes nothing into its run dir: test_run_dir.py.)"""
import json
import shutil

import pytest
import torch

import headprune.runs.execute as execute
from headprune.apps.train import run
from tests.helpers import Crash, compose_train, files, results

BASE = ["model=tiny_bert", "logger=none", "data.max_train_samples=64", "data.score_samples=32",
        "data.max_validation_samples=32", "trainer.num_sanity_val_steps=0", "schedule=iterative",
        "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=1", "schedule.epochs_per_round=1",
        "diagnostics.enabled=false", "callbacks=default"]


class Killed(RuntimeError):
    pass


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir):
    """One finished run (checkpoints, export, results.json) the tests resume (copied per test), and
    the uninterrupted run a crashed one must end like."""
    out = tmp_path_factory.mktemp("finished")
    run(compose_train(out, data_dir, *BASE))
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    last = dst / "checkpoints" / "last.ckpt"
    saved = json.loads((dst / "results.json").read_text())
    saved["final"]["export_dir"] = str(dst / "export")  # the copy's own export
    (dst / "results.json").write_text(json.dumps(saved))
    return last


@pytest.mark.slow  # training runs and resumes: over ~2 s
def test_resuming_a_finished_run_changes_nothing(finished, tmp_path, data_dir):
    last = _copy(finished, tmp_path / "run")
    before = files(tmp_path / "run")
    res = run(compose_train(tmp_path / "run", data_dir, *BASE, f"ckpt_path={last}"))
    assert res["final"]["stop_reason"] == "target_reached" and "val" in res["final"]
    assert files(tmp_path / "run") == before


@pytest.mark.slow  # training runs and resumes: over ~2 s
def test_a_run_killed_during_its_export_finishes_it_on_resume(tmp_path, data_dir, monkeypatch):
    out = tmp_path / "run"
    export = execute.export_pruned

    def killed(*args, **kwargs):
        raise Killed("killed while exporting")

    monkeypatch.setattr(execute, "export_pruned", killed)
    with pytest.raises(Killed):
        run(compose_train(out, data_dir, *BASE))
    monkeypatch.setattr(execute, "export_pruned", export)
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
    before = files(tmp_path / "run")
    overrides = ["metric=magnitude", "schedule.target_sparsity=0.75", "model.config_overrides.num_hidden_layers=2"]
    with pytest.raises(ValueError, match=r"other settings than this resume: .*metric\._target_.*"
                                         r"model\.config_overrides\.num_hidden_layers \(3 -> 2\).*"
                                         r"schedule\.target_sparsity \(0\.5 -> 0\.75\)"):
        run(compose_train(tmp_path / "run", data_dir, *BASE, *overrides, f"ckpt_path={last}"))
    assert files(tmp_path / "run") == before


@pytest.mark.parametrize("change, named", [
    ("optim.optimizer.lr=0.001", r"optim\.optimizer\.lr \(5e-05 -> 0\.001\)"),
    ("optim.scheduler.warmup_ratio=0.5", r"optim\.scheduler\.warmup_ratio \(0\.06 -> 0\.5\)"),
    ("trainer.limit_train_batches=2", r"trainer\.limit_train_batches \(None -> 2\)"),
])
def test_a_resume_with_another_optimizer_or_batches_per_epoch_is_refused_naming_it(finished, tmp_path, data_dir, change, named):
    """The fine-tuning epochs left would step with another learning rate or schedule, or over other
    batches, than the uninterrupted run (the checkpoint's optimizer state keeps the old rate, while
    results.json would record the new one): refused like a changed recovery.lr, before anything is
    written."""
    last = _copy(finished, tmp_path / "run")
    before = files(tmp_path / "run")
    with pytest.raises(ValueError, match=rf"other settings than this resume: .*{named}"):
        run(compose_train(tmp_path / "run", data_dir, *BASE, change, f"ckpt_path={last}"))
    assert files(tmp_path / "run") == before


def test_a_schedule_without_epochs_resumes_only_from_a_recovery_checkpoint(finished, tmp_path, data_dir):
    """An epoch checkpoint cannot continue a run that trains no epoch: the refusal names the one
    kind it can (a recovery's step-budget checkpoint)."""
    last = _copy(finished, tmp_path / "run")
    with pytest.raises(ValueError, match="trains no epoch.*only checkpoints its runs write are those of a recovery"):
        run(compose_train(tmp_path / "run", data_dir, *BASE, "schedule.baseline_epochs=0",
                          "schedule.epochs_per_round=0", "recovery=least_squares", f"ckpt_path={last}"))


def _strip(rounds):
    return [{k: r[k] for k in ("round", "pruned", "heads_per_layer", "val", "val_before_finetune")} for r in rounds]


@pytest.mark.slow  # training runs and resumes: over ~2 s
def test_resume_after_crash_matches_uninterrupted_run(finished, tmp_path, data_dir):
    """A run that crashes after epoch 2 (round 2 pruned, not yet fine-tuned) refuses to start over
    without ckpt_path, and resumed from its last checkpoint ends where the uninterrupted run
    (`finished`, the same settings) ended."""
    broken = tmp_path / "broken"
    crash = ["+callbacks.crash._target_=tests.helpers.CrashAfterEpoch", "+callbacks.crash.epoch=2"]
    with pytest.raises(Crash):
        run(compose_train(broken, data_dir, *BASE, *crash))
    partial = results(broken)
    assert len(partial["rounds"]) == 2 and "val" not in partial["rounds"][1]
    with pytest.raises(FileExistsError, match="ckpt_path"):
        run(compose_train(broken, data_dir, *BASE))
    saved = torch.load(broken / "checkpoints" / "last.ckpt", weights_only=False)
    assert sum(map(len, saved["headprune_layout"])) == 9  # round 1's 3 heads already left the weights
    run(compose_train(broken, data_dir, *BASE, f"ckpt_path={broken / 'checkpoints' / 'last.ckpt'}"))
    a, b = results(finished), results(broken)
    assert a["pruning"]["physical_effective"] is True  # the checkpoint resumed from holds a shrunken model
    assert _strip(b["rounds"]) == _strip(a["rounds"])
    assert b["final"]["pruned"] == a["final"]["pruned"] and b["final"]["val"] == a["final"]["val"]


# -- checks made before anything is written (no training: a checkpoint written here) -----------------
class _NeedsItsRoundOneFiles:
    """A recovery whose resume needs what round 1 wrote into the run dir (as distillation's teacher)."""

    def __init__(self):
        self.asked = []

    def check_resume(self, run_dir):
        self.asked.append(run_dir)
        if not (run_dir / "teacher" / "config.json").is_file():
            raise FileNotFoundError(f"resuming needs its teacher at {run_dir / 'teacher'}; it is missing")


def _checkpoint(run_dir, rounds: int):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "last.ckpt"
    torch.save({"state_dict": {}, "callbacks": {"HeadPruning": {"rounds": [{"round": i + 1} for i in range(rounds)],
                                                                "baseline": {}}}}, path)
    return path


def test_a_resume_past_round_1_asks_the_recovery_before_anything_is_written(tmp_path):
    """The distillation teacher was checked in on_train_start, after results.json (2 rounds -> 0)
    and .hydra/config.yaml had been rewritten: the recovery's check_resume now runs in
    check_resume, before any write, and only for a checkpoint past round 1 (before it, round 1
    has not written the teacher yet)."""
    from headprune.runs.resume import check_resume

    cfg = {}
    recovery = _NeedsItsRoundOneFiles()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text('{"rounds": [1, 2], "final": {}}')
    before = files(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="needs its teacher"):
        check_resume(cfg, str(_checkpoint(tmp_path / "ckpt2", rounds=2)), tmp_path / "run", epochs=3, recovery=recovery)
    assert recovery.asked == [tmp_path / "run"] and files(tmp_path / "run") == before
    assert check_resume(cfg, str(_checkpoint(tmp_path / "ckpt0", rounds=0)), tmp_path / "run", epochs=3,
                        recovery=recovery) is None  # a baseline-epoch checkpoint: nothing to ask yet
    assert len(recovery.asked) == 1


def test_a_run_that_trains_no_epoch_is_told_to_start_again_with_overwrite(tmp_path):
    """A retraining-free run (0 epochs) killed before any recovery checkpoint has none: the resume
    is refused naming the file such runs write, and starting again without overwrite=true is
    refused naming it, not a resume from a checkpoint there is none of; once a recovery's step
    budget wrote <run dir>/recovery/last.ckpt, the refusal offers that one."""
    from headprune.runs.resume import check_resume
    from headprune.runs.run_dir import refuse_to_overwrite

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "results.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no such file; allowed: a run's recovery/last.ckpt"):
        check_resume({}, str(run_dir / "checkpoints" / "last.ckpt"), run_dir, epochs=0)
    with pytest.raises(FileExistsError) as refused:
        refuse_to_overwrite(run_dir, resuming=False, overwrite=False)
    assert "it wrote no checkpoint to resume from" in str(refused.value) and "ckpt_path" not in str(refused.value)
    (run_dir / "recovery").mkdir()
    (run_dir / "recovery" / "last.ckpt").write_bytes(b"")
    with pytest.raises(FileExistsError, match=r"resume it with ckpt_path=.*recovery/last.ckpt"):
        refuse_to_overwrite(run_dir, resuming=False, overwrite=False)
    assert "pass overwrite=true to run it again" in str(refused.value)
    refuse_to_overwrite(run_dir, resuming=False, overwrite=True)  # the advice works
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"x")
    with pytest.raises(FileExistsError, match=rf"resume it with ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"):
        refuse_to_overwrite(run_dir, resuming=False, overwrite=False)


class _ChecksPassed(Exception):
    """Raised where the run would load its data and model: every start-time check has passed."""


@pytest.mark.parametrize("rounds, refused", [(0, False), (2, True)])
def test_a_distill_resume_is_refused_for_its_teacher_only_past_round_1(rounds, refused, tmp_path, data_dir,
                                                                        monkeypatch):
    """Through headprune-train's checks: a checkpoint from before round 1 (a crash in the baseline
    epochs) has no teacher to reload yet and resumes; one past round 1 whose <run>/teacher is
    gone is refused naming it, with nothing written into the run dir."""
    def reached_setup(*args, **kwargs):
        raise _ChecksPassed

    monkeypatch.setattr(execute, "assemble", reached_setup)
    run_dir = tmp_path / "run"
    last = _checkpoint(run_dir / "checkpoints", rounds)
    before = files(run_dir)
    cfg = compose_train(run_dir, data_dir, *BASE, "recovery=distill", f"ckpt_path={last}")
    with pytest.raises(FileNotFoundError if refused else _ChecksPassed) as raised:
        run(cfg)
    if refused:
        assert f"{run_dir / 'teacher'}" in str(raised.value)
    assert files(run_dir) == before


# -- a resume that would change the numerics (issue 56, item 5) ------------------------------------------
@pytest.mark.parametrize("change, named", [
    ("trainer.accumulate_grad_batches=2", r"trainer\.accumulate_grad_batches \(1 -> 2\)"),
    ("trainer.precision=bf16-true", r"trainer\.precision \('32-true' -> 'bf16-true'\)"),
])
def test_a_resume_that_changes_the_numerics_is_refused_naming_the_setting(finished, tmp_path, data_dir, change, named):
    """More micro-batches per optimizer step, or weights in another dtype, train another model than
    the uninterrupted run: refused like a changed recovery.lr, before anything is written."""
    last = _copy(finished, tmp_path / "run")
    before = files(tmp_path / "run")
    with pytest.raises(ValueError, match=rf"numerics.*{named}"):
        run(compose_train(tmp_path / "run", data_dir, *BASE, change, f"ckpt_path={last}"))
    assert files(tmp_path / "run") == before


@pytest.mark.slow  # a subprocess: the console command as a user runs it (~10 s of start-up)
def test_a_one_process_run_resumed_under_ddp_is_refused_naming_the_world_size(finished, tmp_path, data_dir):
    """`trainer=ddp` (two processes) resuming a one-process run's checkpoint: each optimizer step
    would average twice the examples. The real command line, refused before any process starts
    and before anything is written."""
    import subprocess
    import sys

    last = _copy(finished, tmp_path / "run")
    before = files(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "headprune.apps.train", *BASE, "trainer=ddp", "trainer.devices=2",
                           "trainer.accelerator=cpu", f"data.data_dir={data_dir}", f"hydra.run.dir={tmp_path / 'run'}",
                           f"ckpt_path={last}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "trainer.devices / trainer.strategy (world size 1 -> 2 processes)" in proc.stderr, proc.stderr[-3000:]
    assert files(tmp_path / "run") == before


def test_a_recovery_checkpoint_resumed_with_other_numerics_is_refused(tmp_path):
    """A retraining-free run killed in its recovery's step budget (`recovery/last.ckpt`, the run's
    state beside the weights) holds the runtime it trained with: each changed setting is named."""
    from headprune.engine import Runtime
    from headprune.engine.step_fit import RUN_STATE
    from headprune.runs.resume import check_resume

    path = tmp_path / "recovery" / "last.ckpt"
    path.parent.mkdir()
    saved = Runtime.of({"accelerator": "cpu"}).record()
    torch.save({RUN_STATE: {"pruner": {"config": {}, "runtime": saved}}}, path)
    assert check_resume({}, str(path), tmp_path, epochs=0, runtime=Runtime.of({"accelerator": "cpu"})) is None
    changed = Runtime.of({"accelerator": "cpu", "accumulate_grad_batches": 4, "precision": "bf16-true",
                          "strategy": "ddp", "devices": 2})
    with pytest.raises(ValueError) as refused:
        check_resume({}, str(path), tmp_path, epochs=0, runtime=changed)
    for named in ("trainer.accumulate_grad_batches (1 -> 4)", "trainer.precision ('32-true' -> 'bf16-true')",
                  "trainer.devices / trainer.strategy (world size 1 -> 2 processes)"):
        assert named in str(refused.value)
