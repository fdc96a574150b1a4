"""Data-parallel training with the CLI's default trainer settings, progress bar ON.

Lightning's progress bar runs on rank 0 only; a torchmetrics object logged with prog_bar=True
syncs (all_gather) when the bar reads it, while rank 1 waits at a barrier: the run hangs after
the first round (Lightning issue 21264). The subprocess timeout turns a hang into a failure.
"""
import json
import os
import signal
import subprocess
import sys

import pytest


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `cmd`; past `timeout` s its whole process group (both DDP
    ranks) is killed and the test fails, so a hang cannot block the suite."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"two-process DDP did not finish in {timeout} s (a hang): {cmd}\n{output[-3000:]}")
    return proc.returncode, output


def test_two_process_ddp_with_the_progress_bar_finishes(tmp_path, data_dir):
    """The issue's command (trainer=ddp, 2 CPU processes, gloo, logger=csv, default trainer settings
    incl. the progress bar and sanity checks), shrunk to two rounds, finishes (in ~15 s) instead of hanging."""
    cmd = [sys.executable, "-m", "headprune.apps.train", "model=tiny_bert", "data=sst2",
           "data.max_train_samples=128", "data.score_samples=64",
           "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "logger=csv",
           "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=1",
           "export=false", "diagnostics.enabled=false", f"data.data_dir={data_dir}", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", COLUMNS="120")
    returncode, output = _run(cmd, env, timeout=90)
    assert returncode == 0, output[-6000:]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rounds"]) == 2 and saved["final"]["sparsity"] == 0.5
    assert 0.0 <= saved["final"]["val"]["acc"] <= 1.0
    (metrics,) = (tmp_path / "csv").glob("*/metrics.csv")
    header = metrics.read_text().splitlines()[0].split(",")
    assert {"val/acc", "val/loss", "train/acc"} <= set(header)
