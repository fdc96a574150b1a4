"""lightning/loggers.py: wandb offline fallbacks, a sweep's runs grouped and tagged, and what a
run hands to wandb."""
import socket

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from headprune.apps.config_paths import config_dir
from headprune.apps.train import run


def test_wandb_falls_back_to_offline_when_not_logged_in(monkeypatch, tmp_path, caplog):
    from headprune.lightning import loggers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setattr(loggers, "wandb_logged_in", lambda: False)
    logger = loggers.wandb_logger(save_dir=str(tmp_path))
    assert logger._offline is True
    assert sum("logging offline" in r.getMessage() for r in caplog.records) == 1


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


@pytest.mark.slow  # 7 s of CPU (an offline wandb run)
def test_wandb_logger_offline(cfg_factory, tmp_path, monkeypatch):
    """What headprune hands to wandb (per-round metrics, the mask heatmap, the run summary) is
    caught at wandb's public API (`Run.log`, `run.summary.update`), in this process, as the
    calls happen: nothing depends on how fast wandb's writer flushes its file. End to end, the
    offline run's folder and record file exist after the run."""
    from wandb.sdk.wandb_run import Run
    from wandb.sdk.wandb_summary import Summary

    logged, summarised = [], []
    run_log, summary_update = Run.log, Summary.update

    def spy_log(self, data, *args, **kwargs):
        logged.append(dict(data))
        return run_log(self, data, *args, **kwargs)

    def spy_update(self, d=None, **kwargs):
        summarised.append(dict(d or {}))
        return summary_update(self, d, **kwargs)

    monkeypatch.setattr(Run, "log", spy_log)
    monkeypatch.setattr(Summary, "update", spy_update)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = cfg_factory("model=tiny_bert", "logger=wandb", "callbacks=none", "data.max_train_samples=32",
                      "data.score_samples=16", "data.max_validation_samples=32", "schedule=one_shot",
                      "schedule.target_sparsity=0.25")
    res = run(cfg)
    keys = {k for data in logged for k in data}
    assert {"prune/val_acc", "prune/sparsity", "prune/heads_layer_0", "prune/head_mask"} <= keys, keys
    (round_metrics,) = [d for d in logged if d.get("prune/round") == 1]
    (baseline,) = [d for d in logged if d.get("prune/round") == 0]
    assert baseline["prune/val_acc"] == res["baseline"]["val"]["acc"] and baseline["prune/sparsity"] == 0
    assert round_metrics["prune/val_acc"] == res["rounds"][0]["val"]["acc"]
    summary = {k: v for d in summarised for k, v in d.items()}
    assert summary["final/sparsity"] == 0.25
    assert summary["final/acc_drop"] == pytest.approx(res["baseline"]["val"]["acc"] - res["final"]["val"]["acc"])
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(offline.glob("run-*.wandb")), "no offline run record file"
