"""`headprune-train`: fine-tune, score, prune, repeat — composed by Hydra from conf/train.yaml.

Returns the final validation accuracy so Hydra sweepers can optimise it.
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from headprune.config_paths import config_dir
from headprune.lightning.callbacks import HeadPruning
from headprune.lightning.module import HeadPruneModule
from headprune.models import load_tokenizer
from headprune.results import RunResults

log = logging.getLogger(__name__)


def _instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every `_target_` entry of a name -> config mapping (loggers, callbacks)."""
    if not group:
        return []
    return [instantiate(c) for c in group.values() if isinstance(c, DictConfig) and "_target_" in c]


def run(cfg: DictConfig) -> dict:
    """Run one training/pruning job described by `cfg`; returns the results document."""
    L.seed_everything(cfg.seed, workers=True)
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    schedule = instantiate(cfg.schedule)
    metric = instantiate(cfg.metric)
    layer_policy = instantiate(cfg.layer_policy)

    tokenizer = load_tokenizer(cfg.model.pretrained)
    datamodule = instantiate(cfg.data, tokenizer=tokenizer)
    datamodule.setup("fit")
    model = instantiate(cfg.model)(num_labels=datamodule.num_labels)
    module = HeadPruneModule(model, num_labels=datamodule.num_labels,
                             optimizer=instantiate(cfg.optim.optimizer),
                             scheduler=instantiate(cfg.optim.scheduler) if cfg.optim.get("scheduler") else None)

    results = RunResults(output_dir, config=OmegaConf.to_container(cfg, resolve=True))
    pruning = HeadPruning(metric=metric, schedule=schedule, layer_policy=layer_policy, results=results)
    callbacks = [pruning, *_instantiate_group(cfg.get("callbacks"))]
    loggers = _instantiate_group(cfg.get("logger"))
    epochs = schedule.total_epochs()
    log.info("schedule: %d baseline epoch(s), rounds to sparsities %s, %d epoch(s) per round -> %d epochs",
             schedule.baseline_epochs, schedule.sparsities(), schedule.epochs_per_round, epochs)
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                                     max_epochs=max(epochs, 1))
    if epochs == 0 and not trainer.fast_dev_run:
        pruning.run_without_training(module, datamodule)
    else:
        trainer.fit(module, datamodule=datamodule)
    final = results.data["final"]
    log.info("baseline val acc %.4f -> final val acc %.4f at sparsity %.2f (results: %s)",
             results.data["baseline"]["val"]["acc"], final["val"]["acc"], final["sparsity"], results.path)
    _close_loggers(loggers)
    return results.data


def _close_loggers(loggers: list) -> None:
    for logger in loggers:
        experiment_finish = getattr(getattr(logger, "experiment", None), "finish", None)
        if callable(experiment_finish) and type(logger).__name__ == "WandbLogger":
            experiment_finish()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> float:
    return float(run(cfg)["final"]["val"]["acc"])


if __name__ == "__main__":
    main()
