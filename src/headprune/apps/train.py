"""`headprune-train`: fine-tune, score, prune, repeat — composed by Hydra from conf/train.yaml.

Returns the final validation accuracy (classification; higher is better) or perplexity (causal
LM; lower is better) so Hydra sweepers can optimise it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from headprune.apps.components import instantiate_group
from headprune.apps.config_paths import config_dir
from headprune.apps.config_schema import register_schemas
from headprune.heads.surgery import count_params, prune_heads, save_pruned, scale_heads
from headprune.lightning.callbacks import HeadPruning
from headprune.lightning.loggers import finish_wandb
from headprune.lightning.module import HeadPruneModule
from headprune.lightning.results import RunResults
from headprune.models import load_tokenizer
from headprune.tasks import VAL_METRICS, check_task, headline

log = logging.getLogger(__name__)
register_schemas()


def run(cfg: DictConfig) -> dict:
    """Run one training/pruning job described by `cfg`; returns the results document."""
    L.seed_everything(cfg.seed, workers=True)
    output_dir = Path(cfg.paths.output_dir)
    ckpt_path = cfg.get("ckpt_path")
    _refuse_to_overwrite(output_dir, resuming=bool(ckpt_path), overwrite=bool(cfg.get("overwrite", False)))
    output_dir.mkdir(parents=True, exist_ok=True)

    schedule = instantiate(cfg.schedule)
    metric = instantiate(cfg.metric)
    layer_policy = instantiate(cfg.layer_policy)
    task = _task(cfg)
    schedule.check_metrics(VAL_METRICS[task], task)

    tokenizer = load_tokenizer(cfg.model.pretrained)
    datamodule = instantiate(cfg.data, tokenizer=tokenizer)
    datamodule.setup("fit")
    model = instantiate(cfg.model)(num_labels=datamodule.num_labels)
    _check_block_size(datamodule, model)
    baseline_params = count_params(model)
    module = HeadPruneModule(model, num_labels=datamodule.num_labels, task=task,
                             optimizer=instantiate(cfg.optim.optimizer),
                             scheduler=instantiate(cfg.optim.scheduler) if cfg.optim.get("scheduler") else None,
                             **_gates_in_finetune(cfg.metric))

    results = RunResults(output_dir, config=OmegaConf.to_container(cfg, resolve=True))
    pruning = HeadPruning(metric=metric, schedule=schedule, layer_policy=layer_policy, results=results,
                          diagnostics=_diagnostics_options(cfg),
                          check_consistency=bool(cfg.get("check_consistency", False)),
                          physical=bool(cfg.pruning.physical))
    callbacks = [pruning, *instantiate_group(cfg.get("callbacks"))]
    loggers = instantiate_group(cfg.get("logger"))
    epochs = schedule.total_epochs()
    log.info("schedule: %d baseline epoch(s), rounds to sparsities %s, %d epoch(s) per round -> %d epochs",
             schedule.baseline_epochs, schedule.sparsities(), schedule.epochs_per_round, epochs)
    try:
        trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                                         max_epochs=max(epochs, 1))
        if epochs == 0 and not trainer.fast_dev_run:
            pruning.run_without_training(module, datamodule)
        else:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        if cfg.get("export", True) and trainer.is_global_zero:
            export_pruned(module, output_dir / "export", results, baseline_params, tokenizer=tokenizer)
    finally:
        finish_wandb(loggers)  # a failed job in a sweep still finishes its wandb run
    final = results.data["final"]
    name, base_value = headline(results.data["baseline"]["val"])
    log.info("baseline val %s %.4f -> final val %s %.4f at sparsity %.2f (results: %s)",
             name, base_value, *headline(final["val"]), final["sparsity"], results.path)
    return results.data


def _task(cfg: DictConfig) -> str:
    """model.task, checked against the data config: a causal-LM data module sets `task: causal_lm`
    in its class, text classification has none."""
    task = check_task(cfg.model.get("task", "classification"))
    target = get_class(cfg.data._target_)
    data_task = getattr(target, "task", "classification")
    if data_task != task:
        raise ValueError(f"model.task={task} does not fit data={cfg.data.get('name') or cfg.data._target_}, which "
                         f"holds {data_task} data; allowed: model.task={data_task}, or a {task} data config")
    return task


def _check_block_size(datamodule, model) -> None:
    """A causal-LM block must fit the model's position embeddings."""
    block = getattr(datamodule, "block_size", None)
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if block is not None and positions is not None and block > positions:
        raise ValueError(f"data.block_size={block} exceeds the model's {positions} positions; allowed: at most "
                         f"{positions} (or raise the model's n_positions / max_position_embeddings)")


def _refuse_to_overwrite(output_dir: Path, resuming: bool, overwrite: bool) -> None:
    """A finished or running run's folder is never written over by a new run, unless asked to
    (`overwrite=true`) or resuming it (`ckpt_path=...`). Only rank 0 checks: other DDP ranks start
    while rank 0 already owns the folder."""
    if resuming or overwrite or os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("NODE_RANK", "0") != "0":
        return
    if (output_dir / "results.json").exists():
        raise FileExistsError(f"{output_dir} already holds a run's results.json; choose another hydra.run.dir, "
                              "resume it with ckpt_path=<its checkpoints/last.ckpt>, or pass overwrite=true")


def export_pruned(module: HeadPruneModule, directory: Path, results: RunResults, baseline_params: dict,
                  tokenizer=None) -> None:
    """Physically remove every head the mask pruned from the trained model (in place) and save it
    with `save_pruned`; record the export folder and parameter counts in results.json.

    Learned L0 gates are folded in first, so the export computes what the evaluated model did:
    heads whose test-time gate is 0 are removed too, the others' outputs are scaled by their gate."""
    mask = module.head_mask
    if mask.stochastic is not None:
        gates = mask.stochastic.deterministic() * mask.mask  # (L, H)
        closed = int(((gates == 0) & mask.alive()).sum())
        if closed:
            log.info("export: %d heads whose learned gate is closed are removed as well", closed)
        scale_heads(module.model, gates)
        mask.mask.copy_((gates > 0).to(mask.mask))
        mask.stochastic = None
        results.data["final"]["l0_gates_folded"] = {"closed_heads": closed, "heads_per_layer": mask.heads_per_layer()}
    prune_heads(module.model, mask.pruned())
    save_pruned(module.model, directory, tokenizer=tokenizer)
    results.data["baseline"]["params"] = baseline_params
    results.data["final"].update(export_dir=str(directory), params=count_params(module.model))
    results.save()
    log.info("pruned model exported to %s (%s)", directory, results.data["final"]["params"])


def _gates_in_finetune(metric_cfg: DictConfig) -> dict:
    """HeadPruneModule's L0-gate options: `metric=l0_gates metric.finetune=true` learns the gates
    with the model at `metric.penalty` and `metric.lr`; otherwise none."""
    if not metric_cfg.get("finetune", False):
        return {}
    return {"l0_penalty": metric_cfg.penalty, "l0_lr": metric_cfg.lr}


def _diagnostics_options(cfg: DictConfig) -> dict | None:
    """head_diagnostics options from the `diagnostics` block, or None when it is off."""
    block = cfg.get("diagnostics")
    if not block or not block.get("enabled", True):
        return None
    return {k: v for k, v in OmegaConf.to_container(block, resolve=True).items() if k != "enabled"}


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> float:
    return float(headline(run(cfg)["final"]["val"])[1])


if __name__ == "__main__":
    main()
