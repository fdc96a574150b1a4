"""Data-parallel pruning (distributed.py, trainer=ddp: two CPU processes, gloo) through the CLI:
ranks agree with each other and with a single process, stop together on a one-rank non-finite
loss, tune least-squares scales together, and finish with the CLI's default trainer settings,
progress bar ON.

Lightning's progress bar runs on rank 0 only; a torchmetrics object logged with prog_bar=True
syncs (all_gather) when the bar reads it, while rank 1 waits at a barrier: the run hangs after
the first round (Lightning issue 21264). The subprocess timeout turns a hang into a failure.
"""
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from headprune.apps.train import run
from tests.helpers import TINY_ITERATIVE, compose_train, results, strict_json

BASE = TINY_ITERATIVE
pytestmark = pytest.mark.slow


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


# One two-process launch read by the next two tests (a launch costs ~30 s of two interpreters
# starting, importing and setting up; these tests had one each). It runs with the CLI's default
# trainer settings: progress bar ON, sanity checks, logger=csv, the default callbacks.
DDP_COMMON = ["model=tiny_bert", "data=sst2", "logger=csv", "data.max_train_samples=64", "data.score_samples=32",
              "data.max_validation_samples=32", "data.eval_batch_size=8", "schedule=iterative",
              "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=0",
              "schedule.epochs_per_round=1", "export=false", "diagnostics.enabled=false"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, data_dir):
    """(run dir, output) of `headprune-train trainer=ddp` (2 CPU processes, gloo) with DDP_COMMON and
    check_consistency=true, which compares masks and weights across ranks after every round and
    every epoch's optimizer steps. The subprocess timeout turns a hang into a failure."""
    out = tmp_path_factory.mktemp("ddp")
    cmd = [sys.executable, "-m", "headprune.apps.train", *DDP_COMMON, "trainer=ddp", "trainer.accelerator=cpu",
           "trainer.devices=2", "check_consistency=true", f"data.data_dir={data_dir}", f"hydra.run.dir={out}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", COLUMNS="120")
    returncode, output = _run(cmd, env, timeout=120)
    assert returncode == 0, output[-6000:]
    return out, output


def test_two_process_ddp_with_the_progress_bar_finishes(ddp_run):
    """The issue's command (trainer=ddp, 2 CPU processes, gloo, logger=csv, default trainer settings
    incl. the progress bar and sanity checks), shrunk to two rounds, finishes instead of hanging
    after the first round, and logs validation and training metrics."""
    out, _ = ddp_run
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["rounds"]) == 2 and saved["final"]["sparsity"] == 0.5
    assert 0.0 <= saved["final"]["val"]["acc"] <= 1.0
    (metrics,) = (out / "csv").glob("*/metrics.csv")
    header = metrics.read_text().splitlines()[0].split(",")
    assert {"val/acc", "val/loss", "train/acc"} <= set(header)


def test_ddp_ranks_agree_and_match_single_process(ddp_run, tmp_path, data_dir):
    """Two CPU processes (gloo): every rank scores half of the scoring slice, the accumulators are
    summed across ranks, both ranks prune the same heads, remove them from the model and re-wrap it,
    and gradients still synchronise (check_consistency, in ddp_run); round 1 (scored before any
    training) equals a single process scoring the whole slice."""
    ddp_dir, single_dir = ddp_run[0], tmp_path / "single"
    run(compose_train(single_dir, data_dir, *DDP_COMMON))  # the single process: this one, one thread like each rank
    ddp, single = results(ddp_dir), results(single_dir)
    assert ddp["config"]["trainer"]["strategy"] == "ddp" and ddp["pruning"]["physical_effective"] is True
    assert ddp["config"]["check_consistency"] is True
    assert ddp["rounds"][0]["pruned"] == single["rounds"][0]["pruned"]
    torch.testing.assert_close(torch.tensor(ddp["rounds"][0]["scores"]), torch.tensor(single["rounds"][0]["scores"]),
                               rtol=1e-4, atol=1e-6)
    assert len(ddp["rounds"]) == 2 and ddp["final"]["sparsity"] == 0.5


def test_ddp_stops_on_every_rank_when_one_rank_sees_a_nonfinite_loss(tmp_path, data_dir):
    """Rank 1 alone gets a NaN loss: both ranks skip the step together (no rank waits for a gradient
    the other does not send), stop, roll back, and results.json is strict JSON."""
    cmd = [sys.executable, "-m", "headprune.apps.train", *BASE, "logger=none", "callbacks=none", "trainer=ddp",
           "+callbacks.nan._target_=tests.helpers.NaNOnRank", "+callbacks.nan.rank=1", "+callbacks.nan.step=4",
           f"data.data_dir={data_dir}", "diagnostics.enabled=false", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    saved = strict_json(tmp_path / "results.json")
    assert saved["final"]["stop_reason"].startswith("non-finite loss") and math.isfinite(saved["final"]["val"]["loss"])


def test_ddp_budget_and_least_squares_agree_across_ranks(tmp_path, data_dir):
    """A FLOPs budget and least-squares mask tuning under DDP: each rank tunes on its shard, the
    normal equations are summed across ranks, so both hold the same scales (check_consistency
    compares masks and weights)."""
    base = [o for o in BASE if not o.startswith("schedule")]
    cmd = [sys.executable, "-m", "headprune.apps.train", *base, "logger=none", "callbacks=none", "trainer=ddp",
           "check_consistency=true", "schedule=one_shot", "schedule.baseline_epochs=1", "schedule.epochs_per_round=0",
           "recovery=least_squares", "budget=flops", "budget.target=0.6", "budget.batch=4", "budget.seq=16",
           f"data.data_dir={data_dir}", "diagnostics.enabled=false", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (round1,) = strict_json(tmp_path / "results.json")["rounds"]
    assert round1["budget"]["predicted_share"] <= 0.6 and "mask_tuning" in round1
