"""HeadPruning: the Lightning callback that decides WHEN to score and prune.

What to score with (`metric`), which heads to take (`layer_policy`) and how far to go
(`schedule`) are plain functions/objects handed in by config; this class only calls them at
epoch boundaries and records what happened in results.json and the loggers.

Timeline for baseline_epochs=b, epochs_per_round=e and R rounds: after epoch b the baseline
is evaluated and round 1 prunes; after epoch b + k*e round k's fine-tuned accuracy is
recorded and round k+1 prunes; after epoch b + R*e the last round is recorded. Pruning only
changes the HeadMask buffer, so parameter shapes (and the optimizer) stay valid mid-fit.
"""
from __future__ import annotations

import time
from typing import Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from headprune.evaluation import evaluate
from headprune.heads.mask import HeadMask
from headprune.results import RunResults
from headprune.selection.schedules import Schedule


class HeadPruning(Callback):
    def __init__(self, metric: Callable, schedule: Schedule, layer_policy: Callable,
                 results: RunResults | None = None, heatmaps: bool = True):
        self.metric = metric
        self.schedule = schedule
        self.layer_policy = layer_policy
        self.results = results if results is not None else RunResults(None)
        self.heatmaps = heatmaps
        self.sparsities = schedule.sparsities()

    # -- state (so a resumed fit knows which rounds are done) --------------------------------
    @property
    def rounds(self) -> list[dict]:
        return self.results.data["rounds"]

    def state_dict(self) -> dict:
        return {"baseline": self.results.data["baseline"], "rounds": self.rounds}

    def load_state_dict(self, state_dict: dict) -> None:
        self.results.data["baseline"] = state_dict["baseline"]
        self.results.data["rounds"] = state_dict["rounds"]

    # -- Lightning hooks ---------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._describe_model(pl_module)
        self.step(pl_module, trainer.datamodule, completed_epochs=trainer.current_epoch, trainer=trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.step(pl_module, trainer.datamodule, completed_epochs=trainer.current_epoch + 1, trainer=trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.finish(pl_module, trainer.datamodule, trainer=trainer)

    # -- the schedule, usable without a Trainer ----------------------------------------------
    def run_without_training(self, pl_module: L.LightningModule, datamodule) -> dict:
        """Score and prune the model as given, every round back to back (no fine-tuning)."""
        self._describe_model(pl_module)
        self.step(pl_module, datamodule, completed_epochs=0)
        return self.finish(pl_module, datamodule)

    def step(self, pl_module, datamodule, completed_epochs: int, trainer: L.Trainer | None = None) -> None:
        """Do whatever is due after `completed_epochs` training epochs."""
        b, e = self.schedule.baseline_epochs, self.schedule.epochs_per_round
        limit = 1 if trainer is not None and trainer.fast_dev_run else None
        while True:
            k = len(self.rounds)
            if completed_epochs != b + k * e or k > len(self.sparsities):
                return
            data = self.results.data
            if not data["baseline"]:
                data["baseline"] = {"val": self._evaluate(pl_module, datamodule, limit)}
                self.results.save()
            elif "val" not in self.rounds[-1]:
                self._record_val(pl_module, datamodule, limit, trainer)
            if k == len(self.sparsities):
                return
            self._prune_round(pl_module, datamodule, k, limit, trainer)

    def finish(self, pl_module, datamodule, trainer: L.Trainer | None = None) -> dict:
        """Fill in anything not yet evaluated (e.g. a fit stopped early) and write `final`."""
        limit = 1 if trainer is not None and trainer.fast_dev_run else None
        data = self.results.data
        if not data["baseline"]:
            data["baseline"] = {"val": self._evaluate(pl_module, datamodule, limit)}
        if self.rounds and "val" not in self.rounds[-1]:
            self._record_val(pl_module, datamodule, limit, trainer)
        mask: HeadMask = pl_module.head_mask
        final_val = self.rounds[-1]["val"] if self.rounds else data["baseline"]["val"]
        data["final"] = {"sparsity": mask.sparsity(), "heads_per_layer": mask.heads_per_layer(),
                         "pruned": mask.pruned(), "rounds_completed": len(self.rounds),
                         "rounds_planned": len(self.sparsities), "val": final_val}
        self.results.save()
        if self.heatmaps and self.results.output_dir is not None:
            from headprune.plots import close, head_heatmap

            close(head_heatmap(mask.mask, f"kept heads (sparsity {mask.sparsity():.2f})",
                               self.results.output_dir / "head_mask.png", cmap="Greys_r", vmin=0, vmax=1))
        return data

    # -- internals ---------------------------------------------------------------------------
    def _describe_model(self, pl_module) -> None:
        mask: HeadMask = pl_module.head_mask
        self.results.data["model"] = {"layers": mask.num_layers, "heads": mask.num_heads}

    def _evaluate(self, pl_module, datamodule, limit) -> dict:
        return evaluate(pl_module.model, datamodule.val_dataloader(), pl_module.device, max_batches=limit)

    def _record_val(self, pl_module, datamodule, limit, trainer) -> None:
        record = self.rounds[-1]
        record["val"] = self._evaluate(pl_module, datamodule, limit)
        self.results.save()
        self._log(trainer, {"prune/round": record["round"], "prune/sparsity": record["sparsity"],
                            "prune/val_acc": record["val"]["acc"], "prune/val_loss": record["val"]["loss"],
                            **{f"prune/heads_layer_{i}": n for i, n in enumerate(record["heads_per_layer"])}})

    def _prune_round(self, pl_module, datamodule, k: int, limit, trainer) -> None:
        mask: HeadMask = pl_module.head_mask
        total = mask.mask.numel()
        already = total - int(mask.alive().sum())
        n_prune = self.schedule.heads_after(k, total) - already
        start = time.perf_counter()
        loader = datamodule.score_dataloader()
        scores = self.metric(pl_module.model, mask, loader, **({"max_batches": limit} if limit else {}))
        score_seconds = time.perf_counter() - start
        heads = self.layer_policy(scores, mask.alive(), max(n_prune, 0)) if n_prune > 0 else []
        mask.prune(heads)
        record = {"round": k + 1, "sparsity": mask.sparsity(), "n_pruned": len(heads),
                  "heads_per_layer": mask.heads_per_layer(), "pruned": sorted([list(h) for h in heads]),
                  "score_seconds": round(score_seconds, 3), "scores": scores.tolist(),
                  "val_before_finetune": self._evaluate(pl_module, datamodule, limit)}
        self.rounds.append(record)
        if self.schedule.epochs_per_round == 0:
            record["val"] = record["val_before_finetune"]
            self._log(trainer, {"prune/round": record["round"], "prune/sparsity": record["sparsity"],
                                "prune/val_acc": record["val"]["acc"]})
        self.results.save()
        self._log_heatmap(trainer, mask, record["round"])

    def _log(self, trainer, metrics: dict) -> None:
        if trainer is None:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _log_heatmap(self, trainer, mask: HeadMask, round_no: int) -> None:
        if trainer is None or not self.heatmaps:
            return
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                from headprune.plots import close, head_heatmap

                fig = head_heatmap(mask.mask, f"kept heads after round {round_no}", cmap="Greys_r", vmin=0, vmax=1)
                logger.log_image(key="prune/head_mask", images=[fig], step=trainer.global_step)
                close(fig)
