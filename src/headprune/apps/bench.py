"""`headprune-bench`: how much faster and smaller head pruning makes a model, measured, next to
what the FLOP count promises; composed by Hydra from conf/bench.yaml.

Returns the attention sub-layer speed-up at 50% heads removed (NaN when not measured), so
sweepers can optimise it.
"""
from __future__ import annotations

import datetime
import logging
import os
import subprocess
from pathlib import Path

import hydra
import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from headprune import load_pruned
from headprune.runs.components import instantiate_group
from headprune.apps.config_paths import config_dir
from headprune.bench.config import apply_quick, check, register_bench_schema
from headprune.bench.report import summary, write_reports
from headprune.bench.sections import SECTIONS, SectionInputs
from headprune.costs.timing import Clock
from headprune.lightning.loggers import finish_wandb
from headprune.results import flatten

log = logging.getLogger(__name__)
register_bench_schema()


def run(cfg: DictConfig) -> dict:
    """Run every enabled section of the benchmark described by `cfg`; returns the bench.json document."""
    cfg = apply_quick(cfg)
    bench = cfg.bench
    check(bench)
    device = torch.device("cuda" if bench.device == "cuda" or (bench.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(bench.threads)
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results = {"meta": _meta(cfg, device), **{name: [] for name in SECTIONS}}
    inputs = SectionInputs(cfg, device, getattr(torch, bench.dtype), Clock(device),
                  exported=load_pruned(bench.pruned_dir) if bench.pruned_dir else None)
    for name, section in SECTIONS.items():
        if section.enabled(inputs):
            results[name] = section.run(inputs)
    results["meta"]["load_after"] = _load()
    results["summary"] = summary(results)
    paths = write_reports(results, output_dir)
    _log(cfg, results, paths)
    log.info("bench written to %s", paths["md"])
    return results


def _meta(cfg: DictConfig, device: torch.device) -> dict:
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else os.uname().machine,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "quick": bool(cfg.bench.quick), "load_before": _load(), "commit": _commit(),
            "config": OmegaConf.to_container(cfg.bench, resolve=True),
            "model": OmegaConf.to_container(cfg.model, resolve=True)}


def _commit() -> str | None:
    """The checkout's commit (+ "-dirty" with uncommitted changes), None outside a git checkout."""
    where = ["git", "-C", str(Path(__file__).resolve().parent)]
    try:
        head = subprocess.run([*where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run([*where, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _log(cfg: DictConfig, results: dict, paths: dict) -> None:
    """Send the headline numbers, both tables and the plot to every configured logger."""
    loggers = instantiate_group(cfg.get("logger"))
    metrics = {f"bench/{section}/{key}": float(value)
               for section, block in results["summary"].items()
               for key, value in flatten(block).items() if isinstance(value, (int, float, bool))}
    for logger in loggers:
        logger.log_metrics(metrics)
        for section in SECTIONS:
            rows = results[section]
            if rows and hasattr(logger, "log_table"):
                columns = [k for k, v in rows[0].items() if not isinstance(v, dict)]
                logger.log_table(f"bench/{section}", columns=columns, data=[[r[c] for c in columns] for r in rows])
        if hasattr(logger, "log_image"):
            logger.log_image("bench/plot", images=[str(paths["png"])])
        logger.finalize("success")
    finish_wandb(loggers)


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="bench")
def main(cfg: DictConfig) -> float:
    half = run(cfg)["summary"].get("encoder", {}).get("attention_ratio_50")
    return float("nan") if half is None else float(half)


if __name__ == "__main__":
    main()
