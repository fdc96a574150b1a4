"""What a resume (`ckpt_path=...`) is checked for before anything is written: the checkpoint can
be read, it was made with the same experiment (the settings that decide what is pruned, how and
on which model), the run it belongs to is not already finished, and, when the checkpoint is past
round 1, the recovery can continue it (a distillation run's saved teacher is there and loads:
`Recovery.check_resume`). A refusal therefore leaves results.json and .hydra/ as they were.

The experiment's settings travel in the checkpoint (the pruning callback's state, `config`);
checkpoints written before they did are compared with the run dir's results.json `config`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping

import torch

from headprune.engine.step_fit import RUN_STATE
from headprune.results import flatten

log = logging.getLogger(__name__)

# the config keys that define an experiment; a resume must not change any of them
DEFINING = ("model", "data", "metric", "schedule", "layer_policy", "budget", "recovery", "pruning", "kv_modes", "optim",
            "seed")
# within those, what may change between the two parts of a run (where files are, how fast it loads,
# where the dense copy and the pruned model's blocks live, whether training recomputes activations)
FREE = ("data.data_dir", "data.num_workers", "budget.cache_dir", "pruning.dense_device", "pruning.model_device",
        "model.gradient_checkpointing", "pruning.verify_surgery")


# the trainer's fields that change what the remaining steps compute, besides the numerics read from
# the runtime (NUMERICS): how many batches an epoch trains on, gradient clipping, deterministic kernels
TRAINER_DEFINING = ("limit_train_batches", "gradient_clip_val", "gradient_clip_algorithm", "deterministic")


def experiment(config: dict) -> dict:
    """The defining settings of a resolved config, flattened to dotted keys."""
    flat = flatten({k: config.get(k) for k in DEFINING}, sep=".")
    trainer = config.get("trainer") or {}
    flat.update({f"trainer.{k}": trainer[k] for k in TRAINER_DEFINING if k in trainer})
    return {k: v for k, v in flat.items() if k not in FREE}


def check_resume(config: Mapping, ckpt_path: str, output_dir: Path, epochs: int, recovery=None,
                 runtime=None) -> dict | None:
    """Refuse a resume that cannot continue this run, whose settings are `config` (`RunSpec.record`:
    the resolved composed config) (naming what differs, or what `recovery`
    needs and lacks), or whose `runtime` (`engine.Runtime`, None: not checked) would train with
    other numerics than the checkpoint's run (`NUMERICS`); return the finished run's results when
    there is nothing left to do (None: go on).
    A run that trains no epoch resumes only from a recovery's step-budget checkpoint
    (`<run dir>/recovery/last.ckpt`), which holds the run's state (`step_fit.RUN_STATE`)."""
    path = Path(ckpt_path)
    if not path.is_file():
        allowed = "a run's recovery/last.ckpt" if epochs == 0 else "a run's checkpoints/last.ckpt"
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such file; allowed: {allowed}")
    checkpoint = _load(path)
    in_recovery = RUN_STATE in checkpoint
    if epochs == 0 and not in_recovery:
        raise ValueError(f"ckpt_path={ckpt_path}: this schedule trains no epoch (baseline_epochs + rounds x "
                         "epochs_per_round + recover_epochs = 0), so the only checkpoints its runs write are those of a "
                         "recovery's step budget (<run dir>/recovery/last.ckpt, every recovery.checkpoint_every steps "
                         "of recovery=distill|lora|chain with steps > 0), and this file is not one; start the run "
                         "again without ckpt_path and with overwrite=true")
    if epochs > 0 and in_recovery:
        raise ValueError(f"ckpt_path={ckpt_path} is a recovery's step-budget checkpoint, which resumes runs that train "
                         "no epoch; this schedule trains epochs: allowed: the run's checkpoints/last.ckpt")
    saved = checkpoint[RUN_STATE]["pruner"].get("config") if in_recovery else _saved_config(checkpoint, output_dir)
    if saved is not None:
        now, before = experiment(dict(config)), experiment(saved)
        if "kv_modes" not in saved:  # a checkpoint from before kv_modes existed: it ran without them
            now = {k: v for k, v in now.items() if not k.startswith("kv_modes.") or k == "kv_modes.choice"}
            before.setdefault("kv_modes.choice", "none")
            if now.get("kv_modes.choice") is None:  # no kv_modes node at all: none
                now["kv_modes.choice"] = "none"
        differ = sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
        if differ:
            shown = ", ".join(f"{k} ({before.get(k)!r} -> {now.get(k)!r})" for k in differ[:8])
            raise ValueError(f"ckpt_path={ckpt_path} was made with other settings than this resume: {shown}"
                             f"{' ...' if len(differ) > 8 else ''}; resume with the run's own settings (its "
                             ".hydra/config.yaml) or start a new run")
    if runtime is not None:
        _check_numerics(runtime, _saved_runtime(checkpoint, in_recovery, output_dir), ckpt_path)
    results = output_dir / "results.json"
    if results.is_file():
        try:
            data = json.loads(results.read_text())
        except json.JSONDecodeError:
            return None
        final = data.get("final") or {}
        if "val" in final and "export_dir" in final and (Path(final["export_dir"]) / "config.json").is_file():
            log.warning("the run in %s is finished (results.json has its final results and %s its export); resuming "
                        "it changes nothing", output_dir, final["export_dir"])
            return data
    check = getattr(recovery, "check_resume", None)
    if check is not None and not in_recovery and rounds_done(checkpoint):  # (a step-budget resume rebuilds it)  # the recovery set itself up in round 1
        check(output_dir)
    return None


# the runtime settings a resume may not change: each makes the resumed steps compute something other
# than the uninterrupted run's (more or fewer examples per optimizer step, weights and activations in
# another dtype); (results.json `runtime` key, the settings that set it, how a change is shown)
NUMERICS = (("accumulate_grad_batches", "trainer.accumulate_grad_batches", "{!r} -> {!r}"),
            ("precision", "trainer.precision", "{!r} -> {!r}"),
            ("world_size", "trainer.devices / trainer.strategy", "world size {} -> {} processes"))


def _check_numerics(runtime, saved: dict | None, ckpt_path: str) -> None:
    """Refuse a resume whose trainer settings change the numerics of the remaining steps (`NUMERICS`),
    naming each setting. What may change: where the files are, the progress bar, the number of data
    workers (docs/guide_resume.md)."""
    if not saved:
        return  # a checkpoint of a run that recorded no runtime (before results.json had one)
    differ = [f"{name} ({shown.format(saved[key], getattr(runtime, key))})" for key, name, shown in NUMERICS
              if key in saved and saved[key] != getattr(runtime, key)]
    if differ:
        raise ValueError(f"ckpt_path={ckpt_path} was trained with other numerics than this resume: {', '.join(differ)}; "
                         "the remaining steps would not compute what the uninterrupted run computes, and results.json "
                         "would describe neither: resume with the run's own trainer settings (its results.json "
                         "`runtime`, .hydra/config.yaml) or start a new run")


def _saved_runtime(checkpoint: dict, in_recovery: bool, output_dir: Path) -> dict | None:
    """The runtime the checkpoint's run recorded (results.json `runtime`): in the checkpoint's pruning
    state, else (checkpoints written before it was there) in the run dir's results.json."""
    if in_recovery:
        state = checkpoint[RUN_STATE]["pruner"]
        if isinstance(state.get("runtime"), dict):
            return state["runtime"]
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and isinstance(state.get("runtime"), dict):
            return state["runtime"]
    results = output_dir / "results.json"
    if results.is_file():
        try:
            saved = json.loads(results.read_text()).get("runtime")
        except (json.JSONDecodeError, AttributeError):
            return None
        return saved if isinstance(saved, dict) else None
    return None


def rounds_done(checkpoint: dict) -> int:
    """The rounds the checkpoint's pruning state records as done (0: it is from before round 1)."""
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and isinstance(state.get("rounds"), list):
            return len(state["rounds"])
    return 0


def _load(path: Path) -> dict:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable checkpoint gets the same clear refusal
        raise ValueError(f"ckpt_path={path} cannot be read as a checkpoint ({type(err).__name__}: {err}); allowed: a "
                         "run's checkpoints/last.ckpt") from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"ckpt_path={path} holds a {type(checkpoint).__name__}, not a checkpoint; allowed: a run's "
                         "checkpoints/last.ckpt")
    return checkpoint


def _saved_config(checkpoint: dict, output_dir: Path) -> dict | None:
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and isinstance(state.get("config"), dict):
            return state["config"]
    results = output_dir / "results.json"
    if results.is_file():
        try:
            return json.loads(results.read_text()).get("config") or None
        except json.JSONDecodeError:
            return None
    return None
