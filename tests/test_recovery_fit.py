"""A recovery's step budget through the CLI, as users run it: killed (SIGKILL, a real process)
between two of its checkpoints and resumed with `ckpt_path=<run dir>/recovery/last.ckpt`, it ends
with the weights and results of the uninterrupted run, in one process and under two-process DDP
(gloo); DDP ranks hold the same weights after the recovery and match one process that accumulates
the same micro-batches. Progress bar on (the CLI default)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from headprune.apps.train import run
from headprune.engine.step_fit import checkpoint_step
from tests.helpers import TINY_LM_MODEL, compose_train

pytestmark = pytest.mark.slow

STEPS, EVERY = 48, 12
KL = [*TINY_LM_MODEL, "logger=csv", "callbacks=none", "data.max_train_samples=48", "data.score_samples=8",
      "data.max_validation_samples=8", "data.block_size=32", "data.batch_size=4", "schedule=one_shot",
      "schedule.baseline_epochs=0", "schedule.epochs_per_round=0", "schedule.target_sparsity=0.5",
      "recovery=distill", f"recovery.steps={STEPS}", f"recovery.checkpoint_every={EVERY}", "recovery.alpha=1.0",
      "recovery.lr=1e-3", "diagnostics.enabled=false", "trainer.accelerator=cpu"]
DDP = ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "check_consistency=true"]


def _cli(out, data_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "headprune.apps.train", *KL, *extra, f"data.data_dir={data_dir}",
            f"hydra.run.dir={out}"]


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", COLUMNS="120")


def _finish(cmd: list[str], timeout: float = 180) -> str:
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"did not finish in {timeout} s (a hang): {cmd}\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode == 0, output[-6000:]
    return output


def _kill_after_first_checkpoint(cmd: list[str], out, timeout: float = 180) -> int:
    """Start `cmd`, SIGKILL its whole process group (every DDP rank) as soon as the recovery's first
    checkpoint is in place, and return the step that checkpoint holds."""
    ckpt = out / "recovery" / "last.ckpt"
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ckpt.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no recovery checkpoint appeared (exit code {proc.returncode})")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return checkpoint_step(ckpt)


def _same_weights(a, b) -> None:
    left, right = load_file(str(a / "export" / "model.safetensors")), load_file(str(b / "export" / "model.safetensors"))
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


def _recovery(run_dir) -> dict:
    return json.loads((run_dir / "results.json").read_text())["rounds"][0]


def test_a_killed_recovery_resumes_to_the_uninterrupted_weights(tmp_path, data_dir):
    whole = run(compose_train(tmp_path / "whole", data_dir, *KL))
    killed = tmp_path / "killed"
    step = _kill_after_first_checkpoint(_cli(killed, data_dir), killed)
    assert 0 < step < STEPS and not (killed / "export").exists()  # killed mid-recovery, before the export
    resumed = run(compose_train(killed, data_dir, *KL, f"ckpt_path={killed / 'recovery' / 'last.ckpt'}"))
    _same_weights(tmp_path / "whole", killed)
    assert resumed["rounds"][0]["distill"]["resumed_at_step"] == step
    for key in ("loss_first", "loss_last", "tokens", "steps"):
        assert resumed["rounds"][0]["distill"][key] == whole["rounds"][0]["distill"][key]
    assert resumed["final"]["val"] == whole["final"]["val"] and resumed["final"]["pruned"] == whole["final"]["pruned"]
    assert checkpoint_step(killed / "recovery" / "last.ckpt") == STEPS


@pytest.fixture(scope="module")
def ddp_recovery(tmp_path_factory, data_dir):
    """Run dir of an uninterrupted two-process DDP recovery (check_consistency=true: the ranks'
    masks and weights are compared after the round's recovery, collectively)."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    output = _finish(_cli(out, data_dir, *DDP))
    assert "Epoch 0" in output  # the progress bar ran
    return out


def test_ddp_recovery_matches_one_process_accumulating_the_same_batches(ddp_recovery, tmp_path, data_dir):
    """Rank r of step s reads micro-batch 2s + r: one process accumulating two micro-batches a step
    computes the same mean gradient, so the weights agree to float rounding."""
    run(compose_train(tmp_path, data_dir, *KL, "trainer.accumulate_grad_batches=2"))
    ddp, one = _recovery(ddp_recovery)["distill"], _recovery(tmp_path)["distill"]
    assert ddp["world_size"] == 2 and one["accumulate_grad_batches"] == 2 and ddp["tokens"] == one["tokens"]
    left = load_file(str(ddp_recovery / "export" / "model.safetensors"))
    right = load_file(str(tmp_path / "export" / "model.safetensors"))
    for key in left:
        torch.testing.assert_close(left[key], right[key], atol=2e-5, rtol=1e-4)
    assert abs(ddp["loss_last"] - one["loss_last"]) < 1e-4
    runtime = json.loads((ddp_recovery / "results.json").read_text())["runtime"]
    assert runtime["world_size"] == 2 and runtime["strategy"] == "ddp"


def test_a_killed_ddp_recovery_resumes_to_the_uninterrupted_weights(ddp_recovery, tmp_path, data_dir):
    killed = tmp_path / "killed"
    step = _kill_after_first_checkpoint(_cli(killed, data_dir, *DDP), killed)
    assert 0 < step < STEPS
    _finish(_cli(killed, data_dir, *DDP, f"ckpt_path={killed / 'recovery' / 'last.ckpt'}"))
    _same_weights(ddp_recovery, killed)
    assert _recovery(killed)["distill"]["resumed_at_step"] == step
    assert _recovery(killed)["distill"]["loss_last"] == _recovery(ddp_recovery)["distill"]["loss_last"]


class _Killed(RuntimeError):
    pass


def _untimed(value):
    """`value` without its wall-clock figures (keys naming seconds), which no two runs share."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def test_an_iterative_run_resumes_in_its_second_rounds_chain(tmp_path, data_dir, monkeypatch):
    """Two rounds, each a refit then KL steps (recovery=chain): a run stopped in round 2's KL steps
    (after a checkpoint) resumes there: round 1 is not redone, round 2's refit is not run again, the
    KL steps continue at the checkpoint's step, and the weights and rounds equal the uninterrupted run's."""
    from headprune.engine import step_fit

    base = [o for o in KL if not o.startswith(("recovery", "logger", "schedule.target_sparsity"))]
    settings = [*base, "logger=none", "schedule=iterative", "schedule.target_sparsity=0.5", "schedule.step=0.25",
                "recovery=chain", "recovery.options.distill.steps=8", "+recovery.options.distill.checkpoint_every=3",
                "recovery.options.distill.alpha=1.0", "+recovery.options.distill.lr=1e-3"]
    whole = run(compose_train(tmp_path / "whole", data_dir, *settings))
    original = step_fit.StepModule.training_step

    def stop_in_round_two(self, batch, batch_idx):
        if self.label.startswith("round 2") and self.trainer.global_step == 5:
            raise _Killed
        return original(self, batch, batch_idx)

    monkeypatch.setattr(step_fit.StepModule, "training_step", stop_in_round_two)
    with pytest.raises(_Killed):
        run(compose_train(tmp_path / "broken", data_dir, *settings))
    monkeypatch.setattr(step_fit.StepModule, "training_step", original)
    assert checkpoint_step(tmp_path / "broken" / "recovery" / "last.ckpt") == 3
    resumed = run(compose_train(tmp_path / "broken", data_dir, *settings,
                                f"ckpt_path={tmp_path / 'broken' / 'recovery' / 'last.ckpt'}"))
    _same_weights(tmp_path / "whole", tmp_path / "broken")
    assert [r["pruned"] for r in resumed["rounds"]] == [r["pruned"] for r in whole["rounds"]]
    assert _untimed(resumed["rounds"][0]) == _untimed(whole["rounds"][0])  # round 1 came back from the checkpoint
    assert _untimed(resumed["rounds"][1]["refit"]) == _untimed(whole["rounds"][1]["refit"])
    assert resumed["rounds"][1]["distill"]["resumed_at_step"] == 3
    assert resumed["rounds"][1]["distill"]["loss_last"] == whole["rounds"][1]["distill"]["loss_last"]
    assert resumed["final"]["val"] == whole["final"]["val"]
