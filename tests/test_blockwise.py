"""The calibration helpers every layer-by-layer reconstruction shares (recovery/blockwise.py)."""
import pytest
import torch
from torch import nn

from headprune.recovery.blockwise import calibration_batches, eval_mode


def test_eval_mode_restores_each_models_own_mode_even_on_error():
    training, frozen = nn.Linear(2, 2).train(), nn.Linear(2, 2).eval()
    with pytest.raises(RuntimeError, match="inside"):
        with eval_mode(training, frozen):
            assert not training.training and not frozen.training
            raise RuntimeError("inside")
    assert training.training and not frozen.training


def test_calibration_batches_keep_the_first_max_batches_and_refuse_none():
    loader = [{"input_ids": torch.full((1, 3), i)} for i in range(4)]
    kept = calibration_batches(loader, torch.device("cpu"), 2, "x")
    assert [int(b["input_ids"][0, 0]) for b in kept] == [0, 1]
    assert len(calibration_batches(loader, torch.device("cpu"), None, "x")) == 4
    with pytest.raises(ValueError, match=r"the refit got no calibration examples \(data.score_samples=0\?\)"):
        calibration_batches([], torch.device("cpu"), None, "the refit")
