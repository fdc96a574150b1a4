"""A run's LLM evaluations finished or redone after the run (`headprune-evaluate`).

A causal-LM run evaluates the dense model before pruning and its export after it
(`evaluation.llm_suite`, results.json `evaluation.dense` / `evaluation.pruned`). When the run's
process ended between its export and that stage (the out-of-memory killer on a shared machine), or
when an evaluation is wanted again (a new task, more samples), this computes the missing or named
blocks with the same code the run uses, on the same data: the run's own `config` (results.json)
rebuilds the tokenizer and the data module, the dense model is built as the run built it, the export
is loaded from its folder as a user loads it (`load_pruned`). Each block it writes says so
(`by`: the command, when, the torch threads), and its seconds go to `stages.evaluate_<which>`.

Settings may be changed (`evaluation.<field>=<value>`), but dense and pruned must stay comparable:
a changed setting is accepted only when both blocks are computed again. An export folder outside
any run is evaluated with a run's settings and data (`settings_from`) into a file of its own.
Everything is checked before any model is loaded; results.json is rewritten atomically, once, at
the end (a run killed again leaves it as it was).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, fields
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import OmegaConf

from headprune.deploy.hf import load_pruned
from headprune.evaluation import llm_suite
from headprune.models import load_tokenizer
from headprune.atomic import write_json_atomic
from headprune.results import strict
from headprune.runs.components import build
from headprune.tasks import get_task

log = logging.getLogger(__name__)
WHICH = ("dense", "pruned")
RESULTS = "results.json"


def run_of(path: Path) -> Path | None:
    """The run dir `path` is or lies in (a run dir holds results.json; its export/ folder lies in
    it), or None for a folder outside any run."""
    path = Path(path)
    if (path / RESULTS).is_file():
        return path
    if (path.parent / RESULTS).is_file() and (path / "config.json").is_file():
        return path.parent
    return None


def read_run(run: Path) -> dict:
    """The run's results.json, refused by name when it cannot be read or is not a run's."""
    path = Path(run) / RESULTS
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot be read as a run's results ({err}); allowed: the results.json "
                         "headprune-train wrote") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) or "model" not in data["config"]:
        raise ValueError(f"{path}: holds no run config (`config.model`); allowed: a run dir written by headprune-train")
    return data


def settings_of(config: dict, overrides: list[str], where: Path) -> llm_suite.EvaluationSettings:
    """The run's `evaluation:` settings with `overrides` (`evaluation.<field>=<value>`) applied,
    checked as the run checks them; each override refused by name when it is not a field."""
    known = {f.name for f in fields(llm_suite.EvaluationSettings)}
    values = dict(config.get("evaluation") or {})
    for item in overrides:
        key, sep, raw = item.partition("=")
        name = key.removeprefix("evaluation.")
        if not sep or not key.startswith("evaluation.") or name not in known:
            raise ValueError(f"{item!r} is not an evaluation setting; allowed: evaluation.<field>=<value> with a field "
                             f"of {sorted(known)}")
        values[name] = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
    values["enabled"] = True  # evaluating is what was asked for
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: config.evaluation has {unknown}, which this headprune does not know; allowed: "
                         f"{sorted(known)}")
    settings = llm_suite.EvaluationSettings(**values)
    settings.check(get_task(config["model"].get("task", "classification")))
    return settings


def plan(data: dict, settings: llm_suite.EvaluationSettings, which: list[str] | None, redo: bool,
         where: Path, has_export: bool) -> list[str]:
    """Which blocks to compute: those named (`which`), else the missing ones the settings ask for;
    refused when a block is already there without `redo`, when the export is missing, or when a
    changed setting would leave dense and pruned measured differently."""
    block = data.get("evaluation") or {}
    wanted = list(which) if which else [w for w in WHICH if (w != "dense" or settings.dense) and w not in block]
    for w in wanted:
        if w not in WHICH:
            raise ValueError(f"--which {w!r}; allowed: {', '.join(WHICH)}")
    if not wanted:
        raise ValueError(f"{where}: evaluation already holds {', '.join(w for w in WHICH if w in block)}; allowed: "
                         "--redo to compute them again")
    present = [w for w in wanted if w in block]
    if present and not redo:
        raise ValueError(f"{where}: evaluation.{present[0]} is already there; allowed: --redo to compute it again")
    if "pruned" in wanted and not has_export:
        raise ValueError(f"{where}: the run saved no export (final.export_dir, export/), so evaluation.pruned cannot "
                         "be computed; allowed: --which dense, or rerun the run with export=true")
    old = block.get("settings")
    kept = [w for w in WHICH if w in block and w not in wanted]
    if old is not None and kept and old != _recorded(settings):
        changed = sorted(k for k in set(old) | set(_recorded(settings)) if old.get(k) != _recorded(settings).get(k))
        raise ValueError(f"{where}: evaluation settings {changed} differ from those evaluation.{kept[0]} was computed "
                         f"with, so the two would not be comparable; allowed: --which {' --which '.join(WHICH)} --redo "
                         "(both again), or the run's own settings")
    return wanted


def _recorded(settings: llm_suite.EvaluationSettings) -> dict:
    return {k: v for k, v in asdict(settings).items() if k != "enabled"} | {"enabled": True}


def evaluate(path: Path, which: list[str] | None = None, redo: bool = False, overrides: list[str] = (),
             settings_from: Path | None = None, out: Path | None = None, device: str = "cpu",
             command: str = "headprune-evaluate") -> dict:
    """Compute the evaluation blocks of a run dir (or of its export folder) and write them into its
    results.json; or, for an export folder outside any run, evaluate it with the settings and data
    of the run `settings_from` and write `out` (a new file). Returns the document written."""
    path = Path(path)
    run = run_of(path)
    if run is None:
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: neither a run dir (no {RESULTS}) nor a model folder (no config.json); allowed: "
                             "a headprune-train run dir, its export/ folder, or a save_pruned folder with --settings RUN")
        if settings_from is None or out is None:
            raise ValueError(f"{path} is an export outside any run: its evaluation needs a run's settings and data "
                             "(--settings RUN) and a file to write (--out FILE)")
        return _evaluate_folder(path, Path(settings_from), Path(out), overrides, device, command)
    if settings_from is not None or out is not None:
        raise ValueError(f"{path} lies in the run {run}: its evaluation goes into that run's {RESULTS}; allowed: "
                         "--settings and --out only for an export outside any run")
    if path != run and which is None:
        which = ["pruned"]  # an export folder: its own evaluation
    data = read_run(run)
    settings = settings_of(data["config"], list(overrides), run / RESULTS)
    export = Path(data.get("final", {}).get("export_dir") or run / "export")
    if not export.is_dir():  # the run dir was moved or copied: its export/ beside results.json
        export = run / "export"
    wanted = plan(data, settings, which, redo, run / RESULTS, has_export=(export / "config.json").is_file())
    tokenizer, datamodule = _data(data["config"])
    block = data.setdefault("evaluation", {})
    block.update(llm_suite.header(settings, datamodule))
    stages = data.setdefault("stages", {})
    for w in wanted:
        model = _dense(data["config"], datamodule, device) if w == "dense" else _export(export, data["config"], device)
        settings.check_model(model, datamodule)
        block[w], stages[f"evaluate_{w}"] = _run(model, tokenizer, datamodule, settings, data["config"], w, command)
        if w == "pruned":
            block[w]["model"] = str(export)
        del model
    write_json_atomic(run / RESULTS, strict(data))
    log.info("evaluation %s written to %s", ", ".join(wanted), run / RESULTS)
    return data


def _evaluate_folder(folder: Path, settings_from: Path, out: Path, overrides, device: str, command: str) -> dict:
    """An export outside any run, evaluated with the run `settings_from`'s settings and data, into `out`."""
    run = run_of(settings_from)
    if run is None:
        raise ValueError(f"--settings {settings_from}: not a run dir (no {RESULTS}); allowed: a headprune-train run dir")
    if out.exists():
        raise ValueError(f"--out {out} already exists; allowed: a new file (nothing is overwritten)")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: its folder {out.parent} does not exist")
    config = read_run(run)["config"]
    settings = settings_of(config, list(overrides), run / RESULTS)
    tokenizer, datamodule = _data(config)
    model = _export(folder, config, device)
    settings.check_model(model, datamodule)
    block = llm_suite.header(settings, datamodule)
    block["pruned"], seconds = _run(model, tokenizer, datamodule, settings, config, "pruned", command)
    block["pruned"]["model"] = str(folder)
    doc = {"settings_from": str(run / RESULTS), "evaluation": block, "stages": {"evaluate_pruned": seconds}}
    write_json_atomic(out, strict(doc, out.name))
    return doc


def _data(config: dict):
    tokenizer = load_tokenizer(config["model"]["pretrained"])
    datamodule = build(OmegaConf.create(config["data"]), tokenizer=tokenizer)
    datamodule.setup("fit")
    return tokenizer, datamodule


def _dtype(config: dict) -> torch.dtype:
    return getattr(torch, str(config["model"].get("dtype") or "float32"))


def _dense(config: dict, datamodule, device: str):
    """The dense model built as the run built it (its `model:` node)."""
    model = build(OmegaConf.create(config["model"]))(num_labels=datamodule.num_labels)
    return model.to(device).eval()


def _export(folder: Path, config: dict, device: str):
    return load_pruned(folder, device=torch.device(device), dtype=_dtype(config)).eval()


def _run(model, tokenizer, datamodule, settings, config: dict, which: str, command: str) -> tuple[dict, float]:
    start = time.perf_counter()
    block = {"source": llm_suite.SOURCES[which],
             **llm_suite.evaluate_llm(model, tokenizer, datamodule, settings, config["data"].get("data_dir"))}
    block["by"] = {"command": command, "at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                   "threads": torch.get_num_threads()}
    return block, round(time.perf_counter() - start, 3)
