"""recovery=distill: the loss, the teacher's life cycle (snapshot, saved once, reloaded on resume)
and the runs that use it."""
import math

import pytest
import torch
import torch.nn.functional as F

from headprune.apps.train import run
from headprune.recovery.distill import Distill, distill_loss, hidden_mse, kd_loss
from headprune.tasks import CAUSAL_LM
from tests.helpers import Crash, compose_train

TINY = ["model=tiny_bert", "callbacks=none", "logger=none", "data.max_train_samples=96", "data.score_samples=32",
        "data.max_validation_samples=64", "trainer.num_sanity_val_steps=0",
        "diagnostics.enabled=false", "recovery=distill"]
ITERATIVE = ["schedule=iterative", "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=1",
             "schedule.epochs_per_round=1"]


def _cfg(out, data_dir, *overrides, schedule=ITERATIVE):
    return compose_train(out, data_dir, *TINY, *schedule, *overrides)


# -- the loss --------------------------------------------------------------------------------------
def test_kd_loss_is_the_tempered_kl_from_teacher_to_student():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    expected = F.kl_div(F.log_softmax(s / 2, -1), F.softmax(t / 2, -1), reduction="none").sum(-1) * 4
    torch.testing.assert_close(kd_loss(s, t, {}, temperature=2.0), expected)
    assert float(kd_loss(t, t, {}, 2.0).abs().max()) < 1e-6


def test_causal_lm_kd_averages_over_real_next_token_positions():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 4, 5, generator=g), torch.randn(2, 4, 5, generator=g)
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    per_position = F.kl_div(F.log_softmax(s[:, :-1], -1), F.softmax(t[:, :-1], -1), reduction="none").sum(-1)
    got = kd_loss(s, t, batch, temperature=1.0, task=CAUSAL_LM)
    torch.testing.assert_close(got, torch.stack([per_position[0].mean(), per_position[1, :1].mean()]))


def test_distill_loss_mixes_the_terms():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 2, generator=g), torch.randn(3, 2, generator=g)
    task = torch.rand(3, generator=g)
    hidden_s = (torch.randn(3, 4, 6, generator=g),)
    hidden_t = (torch.randn(3, 4, 6, generator=g),)
    batch = {"input_ids": torch.zeros(3, 4, dtype=torch.long), "attention_mask": torch.ones(3, 4)}
    settings = Distill(alpha=0.25, temperature=3.0, hidden_weight=0.5)
    expected = 0.25 * kd_loss(s, t, batch, 3.0) + 0.75 * task + 0.5 * (hidden_s[0] - hidden_t[0]).pow(2).mean((1, 2))
    torch.testing.assert_close(distill_loss(settings, task, s, t, batch, hidden_s, hidden_t), expected)
    assert float(hidden_mse(hidden_s, hidden_s, batch).abs().max()) == 0.0


@pytest.mark.parametrize("field,value", [("alpha", 1.5), ("temperature", 0.0), ("hidden_weight", -1.0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"recovery\.{field}="):
        Distill(**{field: value})


# -- runs ------------------------------------------------------------------------------------------
@pytest.mark.slow  # distillation runs: over ~2 s
def test_distill_run_saves_its_teacher_once_and_times_it(tmp_path, data_dir):
    res = run(_cfg(tmp_path, data_dir, "recovery.hidden_weight=0.1"))
    assert (tmp_path / "teacher" / "config.json").is_file() and (tmp_path / "teacher" / "headprune_layout.json").is_file()
    assert "teacher_seconds" not in res["baseline"]  # no teacher while the baseline trains
    for r in res["rounds"]:
        assert 0 < r["teacher_seconds"] < r["train_seconds"] and math.isfinite(r["val"]["loss"])
    assert res["pruning"]["physical_effective"] is True and res["final"]["sparsity"] == 0.5


@pytest.mark.slow
def test_distill_changes_training_and_resumes_exactly(tmp_path, data_dir):
    """A crash after round 2 prunes: the resumed run reloads the teacher saved when round 1 pruned
    and ends where an uninterrupted run ends; fine-tuning without distillation ends elsewhere."""
    callbacks = ["callbacks=default"]
    whole = run(_cfg(tmp_path / "whole", data_dir, *callbacks))
    crash = ["+callbacks.crash._target_=tests.helpers.CrashAfterEpoch", "+callbacks.crash.epoch=2"]
    with pytest.raises(Crash):
        run(_cfg(tmp_path / "broken", data_dir, *callbacks, *crash))
    ckpt = torch.load(tmp_path / "broken" / "checkpoints" / "last.ckpt", weights_only=False)
    assert not any(k.startswith("teacher") for k in ckpt["state_dict"])  # the teacher is not in checkpoints
    resumed = run(_cfg(tmp_path / "broken", data_dir, *callbacks,
                       f"ckpt_path={tmp_path / 'broken' / 'checkpoints' / 'last.ckpt'}"))
    assert [r["val"] for r in resumed["rounds"]] == [r["val"] for r in whole["rounds"]]
    assert resumed["final"]["pruned"] == whole["final"]["pruned"]
    plain = run(_cfg(tmp_path / "plain", data_dir, "recovery=finetune"))
    assert [r["val"]["loss"] for r in plain["rounds"]] != [r["val"]["loss"] for r in whole["rounds"]]


@pytest.mark.parametrize("schedule", [
    ["schedule=one_shot"], ["schedule=cubic", "schedule.rounds=2"],
    ["schedule=until_threshold", "schedule.threshold=0.5", "schedule.step=0.25", "schedule.select_samples=16"],
])
@pytest.mark.slow  # distillation runs: over ~2 s
def test_distill_with_every_schedule(schedule, tmp_path, data_dir):
    res = run(_cfg(tmp_path, data_dir, "layer_policy=uniform", "schedule.target_sparsity=0.5",
                   "schedule.baseline_epochs=1", "schedule.epochs_per_round=1", schedule=schedule))
    assert res["rounds"] and all(r["teacher_seconds"] > 0 for r in res["rounds"])


@pytest.mark.slow  # distillation runs: over ~2 s
def test_teacher_from_a_folder(tmp_path, data_dir):
    run(_cfg(tmp_path / "first", data_dir, "recovery=finetune", "schedule.target_sparsity=0.25"))
    res = run(_cfg(tmp_path / "second", data_dir, f"recovery.teacher={tmp_path / 'first' / 'export'}"))
    assert not (tmp_path / "second" / "teacher").exists()  # nothing to save: the folder is the teacher
    assert all(r["teacher_seconds"] > 0 for r in res["rounds"])


@pytest.mark.parametrize("overrides,error,pattern", [
    (["recovery.teacher=/nonexistent/model"], FileNotFoundError, r"recovery\.teacher='/nonexistent/model'"),
    (["schedule.epochs_per_round=0"], ValueError, r"recovery=distill trains after each round"),
])
def test_distill_settings_that_cannot_work_fail_at_start(overrides, error, pattern, tmp_path, data_dir):
    with pytest.raises(error, match=pattern):
        run(_cfg(tmp_path, data_dir, *overrides))
    assert not (tmp_path / "results.json").exists()
