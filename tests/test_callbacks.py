"""The pruning callback's fault handling (lightning/callbacks.py): a non-finite loss stops the run,
rolls the model back to the last checkpoint and leaves strict JSON. (Resume after a crash:
test_resume.py; run-dir protection: test_run_dir.py; data-parallel agreement: test_distributed.py.)"""
import math

import pytest
import torch

from headprune.apps.train import run
from tests.helpers import compose_iterative, strict_json


@pytest.mark.slow  # a training run: over ~2 s
def test_nonfinite_loss_stops_rolls_back_and_writes_strict_json(tmp_path, data_dir):
    """lr=1e30 blows the weights up in epoch 2 (the first after round 1): the run stops, the model
    is rolled back to the state the last checkpoint holds (taken after epoch 1), results.json is
    strict JSON with finite numbers, and last.ckpt is the epoch-1 checkpoint, not a blown-up one."""
    blow_up = ["callbacks=default", "+callbacks.lr_bomb._target_=tests.helpers.LrBomb", "+callbacks.lr_bomb.epoch=2"]
    res = run(compose_iterative(tmp_path, data_dir, *blow_up))
    reason = res["final"]["stop_reason"]
    assert reason.startswith("non-finite loss") and "after round 1" in reason and "rolled back" in reason
    saved = strict_json(tmp_path / "results.json")
    assert saved["final"]["stop_reason"] == reason and math.isfinite(saved["final"]["val"]["loss"])
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == 0  # written at the end of epoch 1 (0-based 0), never after the blow-up
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())
    before = saved["rounds"][0]["val_before_finetune"]  # the model the rollback restores, evaluated masked
    assert saved["final"]["val"]["acc"] == before["acc"]
    assert saved["final"]["val"]["loss"] == pytest.approx(before["loss"], abs=1e-5)


@pytest.mark.slow  # a training run of three epochs: 7.0 s wall (quick loop, load 5)
def test_the_callback_runs_the_pruners_loop_at_the_schedules_epochs(tmp_path, data_dir):
    """Baseline after epoch 1, round 1 at its end, its result after epoch 2 (with that epoch's training
    time), round 2, its result after epoch 3: each record carries the training that preceded it, and
    the heads leave the model physically after each round (a loss-threshold schedule instead keeps a
    round's heads until the next round accepts it: test_train)."""
    res = run(compose_iterative(tmp_path, data_dir))
    assert res["baseline"]["train_samples_per_s"] > 0  # the baseline epoch's training, recorded with it
    assert [r["round"] for r in res["rounds"]] == [1, 2] and [r["sparsity"] for r in res["rounds"]] == [0.25, 0.5]
    for record in res["rounds"]:
        assert record["train_seconds"] > 0 and record["val"] != record["val_before_finetune"]
    assert res["pruning"] == {"physical": True, "physical_effective": True}
    assert res["final"]["val"] == res["rounds"][-1]["val"] and res["final"]["stop_reason"] == "target_reached"
