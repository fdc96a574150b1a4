"""Fault handling: exact resume after a crash, non-finite losses, run-dir protection, and
data-parallel pruning that agrees across ranks and with a single process."""
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch.callbacks import Callback

from headprune.apps.config_paths import config_dir
from headprune.apps.train import run
from tests.conftest import compose_train

BASE = ["model=tiny_bert", "logger=none", "data.max_train_samples=96", "data.score_samples=32",
        "data.max_validation_samples=64", "trainer.num_sanity_val_steps=0",
        "schedule=iterative", "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=1",
        "schedule.epochs_per_round=1", "export=false"]


class Crash(RuntimeError):
    pass


class CrashAfterEpoch(Callback):
    """Simulates a preempted job: raises at the end of epoch `epoch` (1-based), before that
    epoch's checkpoint is written."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch + 1 == self.epoch:
            raise Crash(f"simulated crash after epoch {self.epoch}")


def _cfg(out, data_dir, *overrides):
    return compose_train(out, data_dir, *BASE, *overrides)


def _results(out):
    return json.loads((out / "results.json").read_text())


def _strip(rounds):
    return [{k: r[k] for k in ("round", "pruned", "heads_per_layer", "val", "val_before_finetune")} for r in rounds]


def test_resume_after_crash_matches_uninterrupted_run(tmp_path, data_dir):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    run(_cfg(whole, data_dir))
    crash = ["+callbacks.crash._target_=tests.test_faults.CrashAfterEpoch", "+callbacks.crash.epoch=2"]
    with pytest.raises(Crash):
        run(_cfg(broken, data_dir, *crash))
    partial = _results(broken)
    assert len(partial["rounds"]) == 2 and "val" not in partial["rounds"][1]
    with pytest.raises(FileExistsError, match="ckpt_path"):
        run(_cfg(broken, data_dir))
    saved = torch.load(broken / "checkpoints" / "last.ckpt", weights_only=False)
    assert sum(map(len, saved["headprune_layout"])) == 9  # round 1's 3 heads already left the weights
    run(_cfg(broken, data_dir, f"ckpt_path={broken / 'checkpoints' / 'last.ckpt'}"))
    a, b = _results(whole), _results(broken)
    assert a["pruning"]["physical_effective"] is True  # the checkpoint resumed from holds a shrunken model
    assert _strip(b["rounds"]) == _strip(a["rounds"])
    assert b["final"]["pruned"] == a["final"]["pruned"] and b["final"]["val"] == a["final"]["val"]


def _strict(path):
    """results.json parsed as strict JSON: NaN or Infinity in it is a failure."""
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_nonfinite_loss_stops_rolls_back_and_writes_strict_json(tmp_path, data_dir):
    """lr=1e30 blows the weights up in epoch 2 (the first after round 1): the run stops, the model
    is rolled back to the state the last checkpoint holds (taken after epoch 1), results.json is
    strict JSON with finite numbers, and last.ckpt is the epoch-1 checkpoint, not a blown-up one."""
    blow_up = ["callbacks=default", "+callbacks.lr_bomb._target_=tests.test_faults.LrBomb", "+callbacks.lr_bomb.epoch=2"]
    res = run(_cfg(tmp_path, data_dir, *blow_up))
    reason = res["final"]["stop_reason"]
    assert reason.startswith("non-finite loss") and "after round 1" in reason and "rolled back" in reason
    saved = _strict(tmp_path / "results.json")
    assert saved["final"]["stop_reason"] == reason and math.isfinite(saved["final"]["val"]["loss"])
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == 0  # written at the end of epoch 1 (0-based 0), never after the blow-up
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())
    before = saved["rounds"][0]["val_before_finetune"]  # the model the rollback restores, evaluated masked
    assert saved["final"]["val"]["acc"] == before["acc"]
    assert saved["final"]["val"]["loss"] == pytest.approx(before["loss"], abs=1e-5)


class LrBomb(Callback):
    """Sets the learning rate to 1e30 when epoch `epoch` (1-based) starts: the next steps blow up."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch + 1 == self.epoch:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 1e30
            trainer.lr_scheduler_configs.clear()  # keep it there


class NaNOnRank(Callback):
    """Poisons one embedding row on rank `rank` before step `step`: only that rank's loss is NaN."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.get_input_embeddings().weight[batch["input_ids"][0, 1]] = float("nan")


def test_ddp_ranks_agree_and_match_single_process(tmp_path, data_dir):
    """Two CPU processes (gloo): every rank scores half of the scoring slice, the accumulators are
    summed across ranks, both ranks prune the same heads, remove them from the model and re-wrap it,
    and gradients still synchronise (check_consistency compares masks and weights across ranks after
    every round and every epoch's optimizer steps); round 1 (scored before any training) equals a
    single process scoring the whole slice."""
    common = ["model=tiny_bert", "logger=none", "callbacks=none", "data.max_train_samples=64",
              "data.score_samples=32", "data.max_validation_samples=32", "data.eval_batch_size=8",
              "trainer.num_sanity_val_steps=0", "schedule=iterative",
              "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=0",
              "schedule.epochs_per_round=1", "export=false", f"data.data_dir={data_dir}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    cmd = [sys.executable, "-m", "headprune.apps.train", *common, "trainer=ddp", "check_consistency=true",
           f"hydra.run.dir={ddp_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    proc = subprocess.run([sys.executable, "-m", "headprune.apps.train", *common, f"hydra.run.dir={single_dir}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ddp, single = _results(ddp_dir), _results(single_dir)
    assert ddp["config"]["trainer"]["strategy"] == "ddp" and ddp["pruning"]["physical_effective"] is True
    assert ddp["rounds"][0]["pruned"] == single["rounds"][0]["pruned"]
    torch.testing.assert_close(torch.tensor(ddp["rounds"][0]["scores"]), torch.tensor(single["rounds"][0]["scores"]),
                               rtol=1e-4, atol=1e-6)
    assert len(ddp["rounds"]) == 2 and ddp["final"]["sparsity"] == 0.5


def test_ddp_stops_on_every_rank_when_one_rank_sees_a_nonfinite_loss(tmp_path, data_dir):
    """Rank 1 alone gets a NaN loss: both ranks skip the step together (no rank waits for a gradient
    the other does not send), stop, roll back, and results.json is strict JSON."""
    cmd = [sys.executable, "-m", "headprune.apps.train", *BASE, "logger=none", "callbacks=none", "trainer=ddp",
           "+callbacks.nan._target_=tests.test_faults.NaNOnRank", "+callbacks.nan.rank=1", "+callbacks.nan.step=4",
           f"data.data_dir={data_dir}", "diagnostics.enabled=false", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    saved = _strict(tmp_path / "results.json")
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
    (round1,) = _strict(tmp_path / "results.json")["rounds"]
    assert round1["budget"]["predicted_share"] <= 0.6 and "mask_tuning" in round1


def test_failed_job_in_multirun_does_not_stop_the_others(tmp_path, data_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "headprune.apps.train", "-m", "model=tiny_bert", "debug=fast", "logger=wandb",
           "data.max_train_samples=32", "data.score_samples=16", f"data.data_dir={data_dir}",
           "schedule.target_sparsity=1.5,0.25", f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "schedule.target_sparsity=1.5" in proc.stderr + proc.stdout
    done = _results(tmp_path / "1")
    assert done["config"]["schedule"]["target_sparsity"] == 0.25 and done["final"]["rounds_completed"] == 1
    assert not (tmp_path / "0" / "results.json").exists()


def test_wandb_falls_back_to_offline_when_not_logged_in(monkeypatch, tmp_path, caplog):
    from headprune.lightning import loggers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setattr(loggers, "wandb_logged_in", lambda: False)
    logger = loggers.wandb_logger(save_dir=str(tmp_path))
    assert logger._offline is True
    assert sum("logging offline" in r.getMessage() for r in caplog.records) == 1


def test_joblib_launcher_sweep(tmp_path, data_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "headprune.apps.train", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
           "model=tiny_bert", "debug=fast", "data.max_train_samples=32", "data.score_samples=16",
           f"data.data_dir={data_dir}", "layer_policy=global,uniform", f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    policies = {_results(tmp_path / str(i))["config"]["layer_policy"]["_target_"].rsplit(".", 1)[1] for i in (0, 1)}
    assert policies == {"GlobalPolicy", "UniformPolicy"}


def test_wandb_goes_offline_when_logged_in_but_unreachable(monkeypatch, tmp_path, caplog):
    from headprune.lightning import loggers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    assert not loggers.wandb_reachable(timeout=1.0)
    logger = loggers.wandb_logger(save_dir=str(tmp_path))
    assert logger._offline is True
    assert sum("server is unreachable" in r.getMessage() for r in caplog.records) == 1
    with socket.socket() as server:  # and one that answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert loggers.wandb_reachable(timeout=1.0)


def test_wandb_runs_of_a_sweep_share_group_and_tags(tmp_path):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from headprune.lightning import loggers

    assert loggers.hydra_run_identity() == (None, None, [])
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            identities = []
            for policy in ("global", "uniform"):
                cfg = compose("train", overrides=["metric=entropy", f"layer_policy={policy}",
                                                  f"hydra.sweep.dir={tmp_path}/sweep"], return_hydra_config=True)
                with open_dict(cfg):
                    cfg.hydra.mode = RunMode.MULTIRUN
                    cfg.hydra.job.override_dirname = f"layer_policy={policy},metric=entropy"
                HydraConfig.instance().set_config(cfg)
                logger = loggers.wandb_logger(save_dir=str(tmp_path), offline=True, tags=["mine"])
                identities.append(logger._wandb_init)
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
    assert identities[0]["group"] == identities[1]["group"] == f"{tmp_path}/sweep"[-128:]
    assert identities[1]["name"] == "layer_policy=uniform,metric=entropy"
    assert identities[0]["tags"] == ["model:minilm", "data:sst2", "metric:entropy", "schedule:iterative",
                                     "layer_policy:global", "mine"]


def test_last_checkpoint_survives_a_kill_between_write_and_rename(tmp_path, data_dir, monkeypatch):
    """A failure after the new checkpoint is written and before it replaces last.ckpt (where a kill
    could strike) leaves the previous, complete last.ckpt, and the run resumes from it."""
    from headprune.lightning.checkpoints import LastCheckpoint

    commit, calls = LastCheckpoint._commit, []

    def killed_on_second_save(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            assert src.is_file()  # the new checkpoint is written, only the rename is missing
            raise Crash("killed between writing the new checkpoint and renaming it")
        commit(src, dst)

    monkeypatch.setattr(LastCheckpoint, "_commit", staticmethod(killed_on_second_save))
    with pytest.raises(Crash):
        run(_cfg(tmp_path, data_dir, "callbacks=default"))
    monkeypatch.setattr(LastCheckpoint, "_commit", staticmethod(commit))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_file() and not last.is_symlink()
    assert torch.load(last, weights_only=False)["epoch"] == 0  # the first epoch's, complete
    res = run(_cfg(tmp_path, data_dir, "callbacks=default", f"ckpt_path={last}"))
    assert res["final"]["stop_reason"] == "target_reached"


def test_a_refused_run_leaves_the_folder_as_it_was(tmp_path, data_dir):
    """The second run lands on the first run's folder without overwrite=true: it is refused before
    anything is written, so .hydra/ and train.log still describe the first run."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    first = [sys.executable, "-m", "headprune.apps.train", "model=tiny_bert", "debug=fast", "data.max_train_samples=32",
             "data.score_samples=16", f"data.data_dir={data_dir}", f"hydra.run.dir={tmp_path}"]
    assert subprocess.run(first, env=env, capture_output=True, timeout=300).returncode == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert tmp_path / ".hydra" / "config.yaml" in before and tmp_path / "train.log" in before
    proc = subprocess.run([*first, "seed=7"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "already holds a run's results.json" in proc.stderr + proc.stdout
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_an_unwritable_run_dir_is_named_before_training(tmp_path, data_dir, monkeypatch):
    import headprune.apps.run_dir as run_dir

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(run_dir.tempfile, "TemporaryFile", refuse)
    with pytest.raises(PermissionError, match=r"the run dir .* cannot be written: Permission denied"):
        run(_cfg(tmp_path / "ro", data_dir))
    assert not (tmp_path / "ro" / "results.json").exists()


@pytest.mark.parametrize("override,pattern", [
    ("data.score_samples=0", r"data\.score_samples=0 leaves no held-out examples"),
    ("layer_policy.min_heads_per_layer=5", r"layer_policy\.min_heads_per_layer=5 exceeds the model's 4 heads"),
    ("+trainer.max_epochs=3", r"trainer\.max_epochs=3 is not allowed: the schedule sets the number of epochs"),
    ("schedule.target_sparsity=0.99", r"schedule\.target_sparsity=0\.99 removes all 12 heads.*at most 0\.9167"),
])
def test_settings_that_could_only_fail_later_fail_at_start(override, pattern, tmp_path, data_dir):
    extra = ["layer_policy.min_heads_per_layer=0"] if "target_sparsity" in override else []
    with pytest.raises(ValueError, match=pattern):
        run(_cfg(tmp_path, data_dir, override, *extra))
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "checkpoints").exists()
