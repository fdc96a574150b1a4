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

BASE = ["model=tiny_bert", "logger=none", "data.max_train_samples=96", "data.score_samples=32",
        "data.max_validation_samples=64", "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0",
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
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={out}", f"data.data_dir={data_dir}", *BASE, *overrides])
    GlobalHydra.instance().clear()
    return cfg


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


def test_nonfinite_loss_stops_with_reason(tmp_path, data_dir):
    res = run(_cfg(tmp_path, data_dir, "optim.optimizer.lr=1e30", "optim.scheduler.warmup_ratio=0"))
    reason = res["final"]["stop_reason"]
    assert reason.startswith("non-finite loss") and "round" in reason
    assert _results(tmp_path)["final"]["stop_reason"] == reason
    assert math.isfinite(res["final"]["val"]["loss"]) or res["final"]["val"]["loss"] != res["final"]["val"]["loss"]


def test_ddp_ranks_agree_and_match_single_process(tmp_path, data_dir):
    """Two CPU processes (gloo): every rank scores half of the scoring slice, the accumulators are
    summed across ranks, both ranks prune the same heads, remove them from the model and re-wrap it,
    and gradients still synchronise (check_consistency compares masks and weights across ranks after
    every round and every epoch's optimizer steps); round 1 (scored before any training) equals a
    single process scoring the whole slice."""
    common = ["model=tiny_bert", "logger=none", "callbacks=none", "data.max_train_samples=64",
              "data.score_samples=32", "data.max_validation_samples=32", "data.eval_batch_size=8",
              "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", "schedule=iterative",
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

    from headprune.apps.config_paths import config_dir
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
