"""`headprune-bench`: how much faster and smaller head pruning makes a model, measured, next to
what the FLOP count promises; composed by Hydra from conf/bench.yaml.

Returns the attention sub-layer speed-up at 50% heads removed (NaN when not measured), so
sweepers can optimise it.
"""
from __future__ import annotations

import copy
import datetime
import logging
import os
from pathlib import Path

import hydra
import torch
import transformers
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from headprune import load_pruned
from headprune.bench.config import apply_quick, check, register_bench_schema
from headprune.bench.decoder import bench_decoder, build_decoder
from headprune.bench.encoder import bench_encoder
from headprune.bench.report import summary, write_reports
from headprune.bench.runtime import bench_onnxruntime
from headprune.costs.timing import Clock
from headprune.bench.train_step import bench_train_step
from headprune.bench.variants import build_variants, exported_variants
from headprune.apps.components import instantiate_group
from headprune.apps.config_paths import config_dir
from headprune.lightning.loggers import finish_wandb
from headprune.tasks import is_causal_lm

log = logging.getLogger(__name__)
register_bench_schema()


def run(cfg: DictConfig) -> dict:
    """Run the benchmark described by `cfg`; returns the bench.json document."""
    cfg = apply_quick(cfg)
    bench = cfg.bench
    check(bench)
    device = torch.device("cuda" if bench.device == "cuda" or (bench.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(bench.threads)
    dtype = getattr(torch, bench.dtype)
    clock, rounds = Clock(device), {"warmup": bench.warmup, "repeats": bench.repeats}
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results = {"meta": _meta(cfg, device), "encoder": [], "train_step": [], "onnxruntime": [], "decoder": []}

    exported = load_pruned(bench.pruned_dir) if bench.pruned_dir else None
    exported_is_lm = exported is not None and is_causal_lm(exported)
    for section, bench_fn in (("encoder", bench_encoder), ("train_step", bench_train_step)):
        settings = bench[section]
        if not settings.enabled:
            continue
        if exported is not None and not exported_is_lm:
            variants = _exported(exported, _kinds(settings), device, dtype, cfg.seed)
            name = f"exported:{bench.pruned_dir}"
        else:
            dense = instantiate(cfg.model)(num_labels=2).eval().to(device, dtype)
            variants = build_variants(dense, _kinds(settings), list(bench.layouts))
            name = _model_name(cfg.model)
        results[section] = bench_fn(variants, list(settings.batches), list(settings.seqs), clock, seed=cfg.seed,
                                    model_name=name, **rounds)
        del variants
    if bench.onnxruntime.enabled and device.type == "cpu" and not exported_is_lm:
        ort = bench.onnxruntime
        if exported is not None:
            variants, name = _exported(exported, {}, device, dtype, cfg.seed), f"exported:{bench.pruned_dir}"
        else:
            dense = instantiate(cfg.model)(num_labels=2).eval().to(device, dtype)
            variants, name = build_variants(dense, {"pruned": list(ort.sparsities)}, ["uniform"]), _model_name(cfg.model)
        results["onnxruntime"] = bench_onnxruntime(variants, list(ort.batches), list(ort.seqs), clock, seed=cfg.seed,
                                                   model_name=name, threads=bench.threads, **rounds)
        del variants
    if bench.decoder.enabled:
        d = bench.decoder
        for name, variants in _decoder_variants(cfg, exported if exported_is_lm else None, device, dtype):
            results["decoder"] += bench_decoder(variants, d.batch, d.prompt_len, d.new_tokens, clock, seed=cfg.seed,
                                                model_name=name, **rounds)
    results["meta"]["load_after"] = _load()
    results["summary"] = summary(results)
    paths = write_reports(results, output_dir)
    _log(cfg, results, paths)
    log.info("bench written to %s", paths["md"])
    return results


def _decoder_variants(cfg: DictConfig, exported, device, dtype):
    """(name, variants) per decoder: the exported LM when given, else every configured model."""
    bench = cfg.bench
    if exported is not None:
        yield f"exported:{bench.pruned_dir}", _exported(exported, _kinds(bench.decoder), device, dtype, cfg.seed)
        return
    for name in bench.decoder.models:
        spec = OmegaConf.to_container(bench.decoder_configs[name], resolve=True)
        dense = build_decoder(spec, bench.decoder.attn_implementation, seed=cfg.seed).to(device, dtype)
        yield name, build_variants(dense, _kinds(bench.decoder), list(bench.layouts))


def _kinds(section: DictConfig) -> dict[str, list[float]]:
    """kind -> sparsities of a section's `variants`, kinds with no sparsity left out."""
    return {kind: list(s) for kind, s in OmegaConf.to_container(section.variants, resolve=True).items() if s}


def _exported(exported, kinds, device, dtype, seed: int):
    """Variants around a loaded pruned model, against a random-init dense model of its config."""
    torch.manual_seed(seed)
    dense = type(exported)(copy.deepcopy(exported.config)).eval().to(device, dtype)
    return exported_variants(dense, exported.eval().to(device, dtype), list(kinds))


def _model_name(model_cfg: DictConfig) -> str:
    if not model_cfg.get("random_init"):
        return model_cfg.pretrained
    overrides = OmegaConf.to_container(model_cfg.get("config_overrides") or {}, resolve=True)
    return f"{model_cfg.pretrained} (random init {overrides})"


def _meta(cfg: DictConfig, device: torch.device) -> dict:
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else os.uname().machine,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "quick": bool(cfg.bench.quick), "load_before": _load(),
            "config": OmegaConf.to_container(cfg.bench, resolve=True),
            "model": OmegaConf.to_container(cfg.model, resolve=True)}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _log(cfg: DictConfig, results: dict, paths: dict) -> None:
    """Send the headline numbers, both tables and the plot to every configured logger."""
    loggers = instantiate_group(cfg.get("logger"))
    metrics = {f"bench/{section}/{key}": float(value)
               for section, block in results["summary"].items()
               for key, value in _flat(block).items() if isinstance(value, (int, float, bool))}
    for logger in loggers:
        logger.log_metrics(metrics)
        for section in ("encoder", "train_step", "onnxruntime", "decoder"):
            rows = results[section]
            if rows and hasattr(logger, "log_table"):
                columns = [k for k, v in rows[0].items() if not isinstance(v, dict)]
                logger.log_table(f"bench/{section}", columns=columns, data=[[r[c] for c in columns] for r in rows])
        if hasattr(logger, "log_image"):
            logger.log_image("bench/plot", images=[str(paths["png"])])
        logger.finalize("success")
    finish_wandb(loggers)


def _flat(block: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in block.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="bench")
def main(cfg: DictConfig) -> float:
    half = run(cfg)["summary"].get("encoder", {}).get("attention_ratio_50")
    return float("nan") if half is None else float(half)


if __name__ == "__main__":
    main()
