"""The pruning callback's fault handling (lightning/callbacks.py): a non-finite loss stops the run,
rolls the model back to the last checkpoint and leaves strict JSON. (Resume after a crash:
test_resume.py; run-dir protection: test_run_dir.py; data-parallel agreement: test_distributed.py.)"""
import math

import pytest
import torch

from headprune.apps.train import run
from tests.helpers import compose_iterative, strict_json


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
