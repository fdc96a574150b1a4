"""HeadPruning: the Lightning callback that decides WHEN to prune.

What a round does (score, select, prune) is `selection.rounds.prune_round`; what to score with
(`metric`), which heads to take (`layer_policy`) and how far to go (`schedule`) come from config.
This class calls `prune_round` at the epoch boundaries the schedule names
(`Schedule.round_epoch`), evaluates, applies the schedule's stopping rule, and records every
round in results.json and the loggers, with the wall time and throughput of the training that
followed it. With `physical` the pruned heads then leave the model (`lightning/shrink.py`), so
each round's fine-tuning is cheaper than the last; a schedule that may reject a round
(`until_threshold`) keeps the newest round's heads masked until the next round accepts it.
Under `recovery=distill` the first round installs the teacher: a frozen copy of the model as the
baseline epochs left it (saved once to `<run dir>/teacher/`, where a resumed run reloads it), or
the model given as `recovery.teacher`.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from headprune.distributed import all_equal
from headprune.heads.mask import HeadMask
from headprune.heads.optimizer_state import reset_optimizer_state
from headprune.deploy.hf import load_pruned, save_pruned
from headprune.lightning import loggers
from headprune.lightning.results import RunResults
from headprune.lightning.shrink import shrink, shrink_supported
from headprune.selection.rounds import prune_round
from headprune.recovery.least_squares import LeastSquares
from headprune.selection.budgets import Budget
from headprune.selection.schedules import Schedule
from headprune.tasks import evaluate

log = logging.getLogger(__name__)


class HeadPruning(Callback):
    """`diagnostics`: head_diagnostics options, run on the final model (None = off).
    `check_consistency`: assert identical masks (and weights) on every rank after each epoch.
    `physical`: remove pruned heads from the model after each round (where the strategy allows;
    results.json `pruning.physical_effective` says what happened).
    `teacher`: the distillation teacher given as a model (`recovery.teacher`); None with a
    module that distils = a frozen copy of the model when the first round prunes.
    `budget`: a cost budget (flops, latency, kv) replaces the head count: round k keeps at most
    1 - (1 - budget.target) x s_k / s_last of the dense cost, s the schedule's sparsities.
    `least_squares`: tune the surviving heads' scales after each round (`recovery.least_squares`).
    `rearrange`: Kwon et al.'s mask rearrangement by the block Fisher."""

    TEACHER_DIR = "teacher"

    def __init__(self, metric: Callable, schedule: Schedule, layer_policy: Callable,
                 results: RunResults | None = None, diagnostics: dict | None = None,
                 check_consistency: bool = False, physical: bool = True, teacher=None,
                 budget: Budget | None = None, least_squares: LeastSquares | None = None, rearrange: bool = False):
        self.metric = metric
        self.schedule = schedule
        self.layer_policy = layer_policy
        self.results = results if results is not None else RunResults(None)
        self.diagnostics = diagnostics
        self.check_consistency = check_consistency
        self.physical = self._physical = physical
        self.teacher = teacher
        self.budget = budget if budget is not None and not budget.counts_heads else None
        self.least_squares = least_squares
        self.rearrange = rearrange
        self.dense = None  # the model before the first round, without hooks (costs, mask tuning)
        self._costs = None
        self.sparsities = schedule.sparsities()
        self.stop_reason: str | None = None
        self.sensitivity: list[float] | None = None
        self._last_good: torch.Tensor | None = None
        self._pending_rng: dict | None = None
        self._train = {"seconds": 0.0, "samples": 0}  # training since the last record
        self._epoch_start: float | None = None
        self._rollback: dict | None = None
        self._rollback_epoch = 0

    # -- state (so a resumed fit knows which rounds are done) --------------------------------
    @property
    def rounds(self) -> list[dict]:
        return self.results.data["rounds"]

    def state_dict(self) -> dict:
        return {"baseline": self.results.data["baseline"], "rounds": self.rounds, "stop_reason": self.stop_reason,
                "sensitivity": self.sensitivity,
                "last_good": None if self._last_good is None else self._last_good.tolist(),
                "train": dict(self._train), "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.results.data["baseline"] = state_dict["baseline"]
        self.results.data["rounds"] = state_dict["rounds"]
        self.stop_reason = state_dict.get("stop_reason")
        self.sensitivity = state_dict.get("sensitivity")
        last = state_dict.get("last_good")
        self._last_good = None if last is None else torch.tensor(last)
        self._train = dict(state_dict.get("train", self._train))
        self._pending_rng = state_dict.get("rng")  # restored when training restarts, for exact resume

    # -- Lightning hooks ---------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results.writer = trainer.is_global_zero
        if self._pending_rng is not None:
            torch.set_rng_state(self._pending_rng["torch"])
            random.setstate(self._pending_rng["python"])
            self._pending_rng = None
        if self.rounds:  # resumed after the first round: distil from the same teacher again
            self._install_teacher(pl_module, resumed=True)
            if self.least_squares is not None:
                raise ValueError("recovery=least_squares tunes each round against the unpruned model's outputs, which "
                                 "a resumed run no longer has; start the run again (it trains nothing, so it is short)")
            if self.budget is not None:  # costs depend on the config only; a latency table comes from its cache
                self.dense = pl_module.model
                self._measure_costs()
        self._describe_model(pl_module, trainer)
        self.step(pl_module, trainer.datamodule, completed_epochs=trainer.current_epoch, trainer=trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # what a non-finite loss rolls back to: the state the epoch starts from, which is also what
        # the last checkpoint holds (pruning and checkpointing happen at epoch ends); one copy of
        # the weights in host memory
        self._rollback = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()}
        self._rollback_epoch = trainer.current_epoch
        self._epoch_start = time.perf_counter()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._stop_clock()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._stop_clock()
        if self.check_consistency:
            self._check_ranks(pl_module, f"epoch {trainer.current_epoch + 1}")
        self.step(pl_module, trainer.datamodule, completed_epochs=trainer.current_epoch + 1, trainer=trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        self._train["samples"] += int(batch["input_ids"].shape[0])
        bad = getattr(pl_module, "nonfinite_loss", None)
        if bad is None or self.stop_reason is not None:
            return
        after = f"after round {len(self.rounds)}" if self.rounds else "before the first round"
        self.stop_reason = (f"non-finite loss ({bad}) while fine-tuning {after} (epoch {trainer.current_epoch}, "
                            f"step {trainer.global_step}); the step was skipped, training stopped and the model "
                            f"rolled back to the start of epoch {self._rollback_epoch}")
        log.error("%s. The last checkpoint and results.json hold the last good state.", self.stop_reason)
        trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.finish(pl_module, trainer.datamodule, trainer=trainer)

    # -- the schedule, usable without a Trainer ----------------------------------------------
    def run_without_training(self, pl_module: L.LightningModule, datamodule) -> dict:
        """Score and prune the model as given, every round back to back (no fine-tuning)."""
        self._describe_model(pl_module, None)
        self.step(pl_module, datamodule, completed_epochs=0)
        return self.finish(pl_module, datamodule)

    def step(self, pl_module, datamodule, completed_epochs: int, trainer: L.Trainer | None = None) -> None:
        """Do whatever is due after `completed_epochs` training epochs."""
        limit = self._limit(trainer)
        while self.stop_reason is None:
            k = len(self.rounds)
            if k > len(self.sparsities) or completed_epochs != self.schedule.round_epoch(k):
                return
            data = self.results.data
            if not data["baseline"]:
                data["baseline"] = {"val": self._evaluate(pl_module, datamodule, limit),
                                    **self._selection(pl_module, datamodule, limit), **self._take_train_time(pl_module)}
                self.results.save()
            elif "val" not in self.rounds[-1]:
                self._record_val(pl_module, datamodule, limit, trainer)
                if self._check_stop(pl_module, trainer):
                    return
            if k == len(self.sparsities):
                return
            self._prune_round(pl_module, datamodule, k, limit, trainer)

    def finish(self, pl_module, datamodule, trainer: L.Trainer | None = None) -> dict:
        """Fill in anything not yet evaluated (e.g. a fit stopped early) and write `final`."""
        limit = self._limit(trainer)
        data = self.results.data
        if getattr(pl_module, "nonfinite_loss", None) is not None and self._rollback is not None:
            pl_module.load_state_dict(self._rollback)  # the weights the last checkpoint holds, not blown-up ones
        if not data["baseline"]:
            data["baseline"] = {"val": self._evaluate(pl_module, datamodule, limit),
                                **self._selection(pl_module, datamodule, limit)}
        if self.rounds and "val" not in self.rounds[-1]:
            self._record_val(pl_module, datamodule, limit, trainer)
            self._check_stop(pl_module, trainer)
        mask: HeadMask = pl_module.head_mask
        fresh = self.stop_reason is not None or self.schedule.recover_epochs > 0 or not self.rounds
        final_val = self._evaluate(pl_module, datamodule, limit) if fresh else self.rounds[-1]["val"]
        data["final"] = {"sparsity": mask.sparsity(), "heads_per_layer": mask.heads_per_layer(),
                         "pruned": mask.pruned(), "rounds_completed": len(self.rounds),
                         "rounds_planned": len(self.sparsities), "stop_reason": self._final_reason(mask),
                         "val": final_val}
        self.results.save()
        if self.results.output_dir is not None and self.results.writer:
            from headprune.plots import close, head_heatmap

            close(head_heatmap(mask.mask, f"kept heads (sparsity {mask.sparsity():.2f})",
                               self.results.output_dir / "head_mask.png", cmap="Greys_r", vmin=0, vmax=1))
        if self.diagnostics is not None:
            self._diagnose(pl_module, datamodule, limit, trainer)
        loggers.log_run_summary(trainer, data)
        return data

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _limit(trainer) -> int | None:
        return 1 if trainer is not None and trainer.fast_dev_run else None

    def _describe_model(self, pl_module, trainer) -> None:
        mask: HeadMask = pl_module.head_mask
        self.results.data["model"] = {"layers": mask.num_layers, "heads": mask.num_heads}
        supported, why = shrink_supported(trainer)
        if self.physical and not supported:
            log.warning("pruning.physical=true, but %s: pruned heads stay in the model, masked, until the export "
                        "(pruning.physical_effective=false)", why)
        self._physical = self.physical and supported
        self.results.data["pruning"] = {"physical": self.physical, "physical_effective": self._physical,
                                        **({"why_not": why} if self.physical and not supported else {})}

    def _stop_clock(self) -> None:
        if self._epoch_start is not None:
            self._train["seconds"] += time.perf_counter() - self._epoch_start
            self._epoch_start = None

    def _take_train_time(self, pl_module) -> dict:
        """Wall time and throughput of the training batches since the last record, and the part of
        it the distillation teacher's forwards took (none: {})."""
        seconds, samples = self._train["seconds"], self._train["samples"]
        teacher = getattr(pl_module, "teacher_seconds", 0.0)
        self._train = {"seconds": 0.0, "samples": 0}
        pl_module.teacher_seconds = 0.0
        if not samples:
            return {}
        out = {"train_seconds": round(seconds, 3), "train_samples_per_s": round(samples / max(seconds, 1e-9), 2)}
        return out | ({"teacher_seconds": round(teacher, 3)} if teacher else {})

    def _install_teacher(self, pl_module, resumed: bool = False) -> None:
        """Give a distilling module its teacher (see the class docstring); nothing otherwise."""
        if getattr(pl_module, "distill", None) is None or pl_module.teacher is not None:
            return
        if self.teacher is not None:
            pl_module.install_teacher(self.teacher)
            return
        folder = self.results.output_dir / self.TEACHER_DIR if self.results.output_dir is not None else None
        if resumed:
            if folder is None or not folder.is_dir():
                raise FileNotFoundError(f"resuming a recovery=distill run needs its teacher, saved when round 1 pruned, "
                                        f"at {folder}; it is missing")
            pl_module.install_teacher(load_pruned(folder))
            return
        teacher = pl_module.frozen_copy()
        if folder is not None and self.results.writer:
            save_pruned(teacher, folder, overwrite=True)
        pl_module.install_teacher(teacher)
        log.info("distillation teacher: the model after %d baseline epoch(s)%s", self.schedule.baseline_epochs,
                 f", saved to {folder}" if folder is not None else "")

    def _check_ranks(self, pl_module, when: str) -> None:
        """Every rank holds the same mask and the same weights (a collective)."""
        digest = torch.stack([t.detach().double().sum() for t in pl_module.model.parameters()]
                             + [t.detach().double().pow(2).sum() for t in pl_module.model.parameters()])
        if not all_equal(pl_module.head_mask.mask) or not all_equal(digest):
            raise RuntimeError(f"{when}: the head masks or the weights differ between ranks")

    def _final_reason(self, mask: HeadMask) -> str:
        if self.stop_reason is not None:
            return self.stop_reason
        if len(self.rounds) < len(self.sparsities):
            return f"interrupted after {len(self.rounds)} of {len(self.sparsities)} rounds"
        total = mask.mask.numel()
        planned = self.schedule.heads_after(len(self.sparsities) - 1, total) if self.sparsities else 0
        pruned = total - int(mask.alive().sum())
        if pruned >= planned:
            return "target_reached"
        return f"constrained: the layer policy's limits let {pruned} of the {planned} heads the target asks for go"

    def _evaluate(self, pl_module, datamodule, limit) -> dict:
        return evaluate(pl_module.model, datamodule.val_dataloader(), pl_module.device, max_batches=limit)

    def _selection(self, pl_module, datamodule, limit) -> dict:
        """{"selection": metrics on the held-out selection slice} when the stopping rule reads it."""
        if not self.schedule.selection_samples():
            return {}
        return {"selection": evaluate(pl_module.model, datamodule.select_dataloader(), pl_module.device,
                                      max_batches=limit)}

    def _record_val(self, pl_module, datamodule, limit, trainer) -> None:
        record = self.rounds[-1]
        record["val"] = self._evaluate(pl_module, datamodule, limit)
        record.update(self._selection(pl_module, datamodule, limit), **self._take_train_time(pl_module))
        self.results.save()
        loggers.log_round(trainer, record)

    def _check_stop(self, pl_module, trainer) -> bool:
        """Apply the schedule's stopping rule to the last recorded round (on the selection slice)."""
        if not self.schedule.can_reject:
            return False
        reason = self.schedule.stop_reason(self.results.data["baseline"]["selection"], self.rounds[-1]["selection"])
        if reason is None:
            return False
        self.stop_reason = reason
        self.rounds[-1]["rejected"] = True
        if self._last_good is not None:
            pl_module.head_mask.mask.copy_(self._last_good.to(pl_module.head_mask.mask.device))
        log.warning("stopping after round %d (%s); restored the mask of the previous round",
                    self.rounds[-1]["round"], reason)
        if trainer is not None:
            trainer.should_stop = True
        self.results.save()
        return True

    def _prune_round(self, pl_module, datamodule, k: int, limit, trainer) -> None:
        mask: HeadMask = pl_module.head_mask
        if k == 0:
            self._install_teacher(pl_module)
            if self.budget is not None or self.least_squares is not None:
                self.dense = pl_module.frozen_copy()
            if self.budget is not None:
                self._measure_costs()
        if self._physical and self.schedule.can_reject:  # the previous round was accepted: its heads go now
            shrink(pl_module, mask.pruned(), trainer)
        self._last_good = mask.mask.detach().clone().cpu()
        world = trainer.world_size if trainer is not None else 1
        loader = (datamodule.score_dataloader(trainer.global_rank, world) if world > 1
                  else datamodule.score_dataloader())
        sync = (lambda value: trainer.strategy.broadcast(value, src=0)) if world > 1 else None
        result = prune_round(pl_module.model, mask, self.metric, self.layer_policy,
                             self.schedule.heads_to_prune(k, mask.alive()), loader, round_no=k + 1,
                             eval_loader=datamodule.val_dataloader(), sensitivity=self.sensitivity, sync=sync,
                             max_batches=limit, cost_budget=self._cost_budget(k), rearrange=self.rearrange)
        if result.sensitivity is not None:
            self._record_sensitivity(result.sensitivity)
        if self.schedule.reset_optimizer_state and trainer is not None:
            reset_optimizer_state(trainer.optimizers, pl_module.model, result.pruned)
        if self._physical and not self.schedule.can_reject:
            shrink(pl_module, result.pruned, trainer)
        record = result.record()
        if self.least_squares is not None:
            self._tune(pl_module, loader, record, datamodule, limit)
        if self.check_consistency:
            self._check_ranks(pl_module, f"round {k + 1}")
        self.rounds.append(record)
        if self.schedule.epochs_per_round == 0:
            record["val"] = record.get("val_after_mask_tuning", record["val_before_finetune"])
            record.update(self._selection(pl_module, datamodule, limit))
            loggers.log_round(trainer, record)
            self._check_stop(pl_module, trainer)
        self.results.save()
        loggers.log_head_mask(trainer, mask, record["round"])

    def _measure_costs(self) -> None:
        """The cost budget's per-layer costs, on the dense copy (a latency budget times its table)."""
        from headprune.retraining_free import budget_costs

        start = time.perf_counter()
        self._costs, info = budget_costs(self.dense, self.budget)
        self.results.data["budget"] = {"kind": self.budget.kind, "target": self.budget.target,
                                       "batch": self.budget.batch, "seq": self.budget.seq, "unit": self._costs.unit,
                                       "dense_cost": self._costs.dense, **info,
                                       "seconds": round(time.perf_counter() - start, 3)}

    def _cost_budget(self, k: int):
        """(costs, share of the dense cost round k may keep), or None when heads are counted."""
        if self.budget is None:
            return None
        s = self.sparsities
        return self._costs, 1.0 - (1.0 - self.budget.target) * s[k] / s[-1]

    def _tune(self, pl_module, loader, record: dict, datamodule, limit) -> None:
        """Least-squares scales of the surviving heads, then the tuned model's validation metrics."""
        from headprune.recovery.least_squares import tune_scales

        start = time.perf_counter()
        report = tune_scales(pl_module.model, pl_module.head_mask, self.dense, loader, self.least_squares, limit)
        record["mask_tuning"] = {**report, "seconds": round(time.perf_counter() - start, 3)}
        record["val_after_mask_tuning"] = self._evaluate(pl_module, datamodule, limit)
        log.info("round %d: least-squares mask tuning in %.1f s -> val %s", record["round"],
                 record["mask_tuning"]["seconds"], record["val_after_mask_tuning"])

    def _record_sensitivity(self, sensitivity: list[float]) -> None:
        share = self.layer_policy.share
        self.sensitivity = sensitivity
        self.results.data["layer_sensitivity"] = {"share": share, "loss_rise": sensitivity}
        log.info("layer sensitivity (loss rise with %.0f%% of a layer's heads masked): %s",
                 100 * share, [round(s, 4) for s in sensitivity])
        if self.results.output_dir is not None and self.results.writer:
            from headprune.plots import close, layer_profile

            close(layer_profile(sensitivity, "layer sensitivity (validation-loss rise on the scoring slice)",
                                self.results.output_dir / "layer_sensitivity.png"))

    def _diagnose(self, pl_module, datamodule, limit, trainer) -> None:
        """Head diagnostics of the final model on the scoring slice: results.json `diagnostics`,
        PNG heatmaps in the run dir, images in a wandb logger."""
        from headprune.plots import close
        from headprune.scoring import metric_name
        from headprune.scoring.diagnostics import diagnostic_figures, head_diagnostics

        diag = head_diagnostics(pl_module.model, pl_module.head_mask, datamodule.score_dataloader(),
                                tokenizer=getattr(datamodule, "tokenizer", None), max_batches=limit,
                                **self.diagnostics)
        if self.rounds:
            last = self.rounds[-1]
            diag.importance[f"{metric_name(self.metric) or 'metric'}_round{last['round']}"] = torch.tensor(last["scores"])
        self.results.data["diagnostics"] = diag.to_json()
        self.results.save()
        if not self.results.writer:  # every rank computes (collectives), rank 0 draws
            return
        figures = diagnostic_figures(diag, self.results.output_dir)
        loggers.log_figures(trainer, {f"diagnostics/{stem}": fig for stem, fig in figures.items()})
        for fig in figures.values():
            close(fig)
