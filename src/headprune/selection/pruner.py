"""Pruner: one object that owns a pruning run's state and runs its schedule, with or without a
Trainer (Torch-Pruning's MetaPruner, composer's split of science and timing).

    pruner = Pruner(model, get_metric("taylor"), Iterative(target_sparsity=0.5), GlobalPolicy())
    report = pruner.run(Loaders(score=score_loader, val=val_loader), finetune=my_finetune)

One loop drives every run: `advance(completed_epochs, loaders)` does whatever the schedule has
due after that many training epochs (the baseline record, the last round's metrics after its
fine-tuning, the next rounds). `run` calls it with no Trainer (every retraining-free run, and
`finetune` callables); the Lightning callback (`lightning.callbacks.HeadPruning`) calls it at
each epoch end of a fit, and adds what only a Trainer has (mid-fit physical removal, rollback).
A round (`step`) scores the heads, picks within the budget and the layer policy (`prune_round`;
with `kv_modes`, each KV unit's mode: `selection.kv_modes`), masks them, lets the recovery act
(`after_round`, through a `RecoveryContext`) and records the round in `results`. After it, `awaiting_finetune` says whether the round's result waits for
fine-tuning epochs (`record_finetuned`, which also applies the stopping rule); `finish` writes
`final`. What the driving code adds at fixed points (physical removal, loggers) it gives as a
`RunObserver`. The state a run needs to continue (rounds, stop reason, sensitivity profile, last
accepted mask, the budget's cost table, `awaiting_finetune`) is in `state_dict()`.

`task` is the run's Task (headprune.tasks): its loss is what the metrics, the measured policies
and the recoveries compute and train on, its metrics are every `val`. headprune-train passes the
one it built from `model.task` and checked against the model; a Pruner built by hand without one
reads the model's head once, here (`checked_task`), never again during the run.

`dense` is the one frozen copy of the unpruned model, taken when round 1 prunes if the recovery
or the budget needs it (distillation teacher, least-squares targets, latency tables); a resumed
run gets it back from the recovery (the saved teacher) or from `dense_factory` (a model of the
same shape, for timing).

`model_device=cpu` (a run without training) keeps the pruned model's blocks in host memory and
streams them to the device one at a time (`engine.offload`); `dense_device=cpu` does the same for
`dense`. results.json `model_device` and `dense_copy` say where each lived and, streamed, the most
blocks on the device at once over the run.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from headprune.costs.tables import LayerCosts
from headprune.engine.offload import (check_dense_device, check_model_device, compute_device, dense_copy, hold_dense,
                                      residency, stream_model)
from headprune.engine.step_fit import FitPlan
from headprune.heads.adapters import LAYOUT_ATTR, head_layout
from headprune.heads.mask import HeadMask
from headprune.heads.stacks import mask_sites, site_record
from headprune.heads.windows import KV_LAYOUT_ATTR, KVLayout, KVWindows
from headprune.recovery import Recovery, make_recovery
from headprune.recovery.base import AFTER_RECOVERY, RecoveryContext
from headprune.results import RunResults
from headprune.selection.budgets import Budget, make_budget
from headprune.selection.kv_modes import KVModes
from headprune.selection.rounds import prune_round
from headprune.selection.run_interface import Loaders, RunObserver
from headprune.tasks import Task, checked_task

log = logging.getLogger(__name__)
# results.json final.val_source: `val` (the headline, the sweep objective) is the run's Task's
# evaluation of the model in this process's memory, its mask applied (or the masked heads removed
# physically); a causal-LM run's `evaluation.pruned` block reads the saved export instead
VAL_SOURCE = "in_memory_masked"
RECOVERY_DIR = "recovery"  # <run dir>/recovery/last.ckpt: the newest checkpoint of a recovery's step budget


def training_of(schedule, recovery: Recovery) -> str | None:
    """What trains the model in a run with `schedule` and `recovery` (for refusals of settings
    that only run without training), or None when nothing does."""
    if schedule.total_epochs() > 0:
        return (f"the schedule ({schedule.total_epochs()} epoch(s): schedule.baseline_epochs, epochs_per_round, "
                "recover_epochs)")
    if recovery.needs_train_data:
        steps = getattr(recovery, "steps_setting", None) or f"recovery.steps={getattr(recovery, 'steps', None)}"
        return f"the recovery's step budget ({steps})"
    return None


class Pruner:
    """A run's pruning state and its steps (module docstring). `max_batches` bounds every pass (a
    smoke run); `observer` is told of each round (`RunObserver`); `task`: the run's Task, or a name
    (`model.task`), checked against the model's head (None: the head's)."""

    def __init__(self, model: nn.Module, metric: Callable, schedule, layer_policy, budget: Budget | dict | None = None,
                 recovery: Recovery | str | None = None, *, mask: HeadMask | None = None, rearrange: bool = False,
                 results: RunResults | None = None, max_batches: int | None = None,
                 dense_factory: Callable[[], nn.Module] | None = None, observer: RunObserver | None = None,
                 dense_device: str = "run", kv_modes: KVModes | None = None, task: Task | str | None = None,
                 model_device: str = "run"):
        self.model = model
        self.task = checked_task(model, task, "task")
        self.metric, self.schedule, self.layer_policy = metric, schedule, layer_policy
        self.budget, self.recovery = make_budget(budget), make_recovery(recovery)
        check_model_device(model_device, self.budget.kind, training_of(schedule, self.recovery))
        self.model_device = model_device  # run | cpu: where the pruned model's blocks live (engine.offload)
        if model_device == "cpu":
            stream_model(model)
        self.mask = mask if mask is not None else HeadMask.for_model(model).to(compute_device(model))
        self.rearrange, self.max_batches, self.dense_factory = rearrange, max_batches, dense_factory
        self.results = results if results is not None else RunResults(None)
        self.observer = observer if observer is not None else RunObserver()
        self.kv_modes = kv_modes if kv_modes is not None else KVModes()  # per-unit KV modes (selection.kv_modes)
        self.awaiting_finetune = False  # the last round's result waits for its fine-tuning epochs
        self.sparsities = schedule.sparsities()
        self.dense: nn.Module | None = None
        check_dense_device(dense_device, self.budget.kind)
        self.dense_device = dense_device  # run | cpu: where `dense` lives (engine.offload)
        self.costs: LayerCosts | None = None
        self.stop_reason: str | None = None
        self.sensitivity: list[float] | None = None
        self.last_good: torch.Tensor | None = None
        # where a recovery's step budget trains (the run's runtime, loggers; checkpoints in
        # <run dir>/recovery when the run has a folder); set by the driving code
        self.fit_plan = FitPlan()
        self._resume_from: Path | None = None  # a step-fit checkpoint the current round continues from

    # -- state --------------------------------------------------------------------------------
    @property
    def rounds(self) -> list[dict]:
        return self.results.data["rounds"]

    @property
    def num_rounds(self) -> int:
        return len(self.sparsities)

    def state_dict(self) -> dict:
        return {"baseline": self.results.data["baseline"], "rounds": self.rounds, "stop_reason": self.stop_reason,
                "sensitivity": self.sensitivity, "last_good": None if self.last_good is None else self.last_good.tolist(),
                "costs": None if self.costs is None else self.costs.to_json(), "budget": self.results.data.get("budget"),
                "awaiting_finetune": self.awaiting_finetune,
                "config": self.results.data.get("config"),  # what a resume is checked against
                "runtime": self.results.data.get("runtime")}  # (the numerics: runs.resume.NUMERICS)

    def load_state_dict(self, state: dict) -> None:
        self.results.data["baseline"], self.results.data["rounds"] = state["baseline"], state["rounds"]
        self.stop_reason, self.sensitivity = state.get("stop_reason"), state.get("sensitivity")
        self.last_good = None if state.get("last_good") is None else torch.tensor(state["last_good"])
        self.costs = None if state.get("costs") is None else LayerCosts.from_json(state["costs"])
        if state.get("budget") is not None:
            self.results.data["budget"] = state["budget"]
        awaiting = state.get("awaiting_finetune")  # checkpoints before it was state: a round without `val`
        self.awaiting_finetune = bool(awaiting if awaiting is not None else self.rounds and "val" not in self.rounds[-1])

    def resume(self) -> None:
        """A run continues after round 1: what round 1 set up comes back (the recovery's teacher, a
        dense model for the budget; the cost table came with the state)."""
        restored = self.recovery.resume(self.context(Loaders(score=None)))
        if restored is not None:
            self.dense = self._hold(restored)
        if self.dense is None and self.budget.needs_dense:
            if self.dense_factory is None:
                raise ValueError(f"resuming a budget={self.budget.kind} run needs a dense model of the same shape "
                                 "(dense_factory)")
            self.dense = self._hold(self.dense_factory())
        if self.costs is None and not self.budget.counts_heads:
            self._measure_costs()

    def context(self, loaders: Loaders, record: dict | None = None) -> RecoveryContext:
        """What the recovery sees of this run; during round `record` a step budget's fit checkpoints
        the run's state with it (`run_state`)."""
        fit = None
        if record is not None:
            output = self.results.output_dir
            fit = dataclasses.replace(self.fit_plan, seed=record["round"], resume_from=self._resume_from,
                                      run_state=lambda: self.run_state(record),
                                      checkpoint_dir=self.fit_plan.checkpoint_dir or (
                                          output / RECOVERY_DIR if output is not None else None))
        return RecoveryContext(self.model, self.mask, loaders, dense=self.dense, run_dir=self.results.output_dir,
                               writer=self.results.writer, max_batches=self.max_batches, fit=fit, task=self.task)

    def run_state(self, record: dict) -> dict:
        """What a recovery checkpoint taken during round `record` holds besides the weights, so a
        killed run continues there (`resume_in_round`): the run's state, the round's record so far,
        the mask, the physical head layout and the KV modes' layout (windows attached by the round)."""
        kv_layout = getattr(self.model, KV_LAYOUT_ATTR, None)
        return {"pruner": self.state_dict(), "record": record, "mask": self.mask.mask.detach().cpu().clone(),
                "layout": head_layout(self.model) if getattr(self.model, LAYOUT_ATTR, None) is not None else None,
                "kv_layout": kv_layout.to_json() if kv_layout is not None else None}

    def resume_in_round(self, state: dict, checkpoint: Path, loaders: Loaders) -> dict:
        """Continue a run killed during a recovery's step budget from that fit's checkpoint (`state`
        is its `run_state`): the model as loaded is the unpruned model (a run that trains no epoch
        starts from it), so the dense copy, the costs and the recovery's setup are made as round 1
        made them; then the checkpoint's layout, mask and KV windows, and the round's recovery continues
        at the checkpoint's step (the stages it finished are not run again). Returns the round's record."""
        from headprune.heads.surgery import apply_layout

        self.load_state_dict(state["pruner"])
        self._start(loaders)
        if state["layout"] is not None:
            apply_layout(self.model, state["layout"])
        self.mask.mask.copy_(state["mask"].to(self.mask.mask.device))
        if state.get("kv_layout") is not None:  # the round attached these (KV modes) before its recovery trained
            KVWindows(KVLayout.from_json(state["kv_layout"], where="the checkpoint's kv_layout")).attach(self.model)
        self._resume_from = Path(checkpoint)
        log.info("resuming round %d's recovery from %s", state["record"]["round"], checkpoint)
        return self._recover(len(self.rounds), loaders, state["record"])

    def stop(self, reason: str) -> None:
        """End the run after the current round (e.g. a non-finite training loss): `final` says why."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.results.save()

    def attach(self, observer: RunObserver, writer: bool | None = None) -> None:
        """The driving code's observer of this run; `writer`: whether this process writes the run's
        files (False on data-parallel ranks other than 0)."""
        self.observer = observer
        if writer is not None:
            self.results.writer = writer

    def limit_batches(self, max_batches: int | None) -> None:
        """Bound every scoring, calibration and evaluation pass (a smoke run: 1)."""
        self.max_batches = max_batches

    def describe(self, **entries: Any) -> None:
        """Top-level results.json entries about the run (the model's shape, physical removal)."""
        self.results.data.update(entries)

    # -- the loop -----------------------------------------------------------------------------
    def due(self, completed_epochs: int) -> bool:
        """Whether anything is due after `completed_epochs` training epochs."""
        k = len(self.rounds)
        return self.stop_reason is None and k <= self.num_rounds and completed_epochs == self.schedule.round_epoch(k)

    def advance(self, completed_epochs: int, loaders: Loaders | Callable[[], Loaders], *,
                sync: Callable[[Any], Any] | None = None, **train_stats) -> bool:
        """Whatever the schedule has due after `completed_epochs` training epochs: the baseline
        record, the last round's metrics after its fine-tuning, then every round that prunes at
        this epoch (all of them when nothing trains). `loaders` may be a callable, built only when
        something is due; `sync(value)` makes a value rank 0's on every data-parallel rank;
        `train_stats`: figures of the training just done, recorded with its result. True when the
        run stopped (the stopping rule, or `stop`)."""
        made = None
        while self.due(completed_epochs):
            if made is None:
                made = loaders() if callable(loaders) else loaders
            if not self.results.data["baseline"]:
                self.record_baseline(made, **train_stats, **self.recovery.take_train_stats())
            elif self.awaiting_finetune:
                if self.record_finetuned(made, **train_stats, **self.recovery.take_train_stats()):
                    break
            train_stats = {}
            if len(self.rounds) == self.num_rounds:
                break
            self.step(len(self.rounds), made, sync=sync)
        return self.stop_reason is not None

    def run(self, loaders: Loaders, finetune: Callable[[nn.Module, int], None] | None = None,
            sync: Callable[[Any], Any] | None = None) -> dict:
        """The whole run with no Trainer: `advance` at each round's epoch, `finetune(model, k)` in
        between when the schedule fine-tunes after round k (use `loss(batch)` inside it for the
        recovery's training loss; without it nothing trains), then `finish`. Baseline epochs are
        the caller's: the run starts where round 1 prunes."""
        epoch = self.schedule.round_epoch(len(self.rounds))
        while not self.advance(epoch, loaders, sync=sync) and self.awaiting_finetune:
            k = len(self.rounds) - 1
            if finetune is not None:
                finetune(self.model, k)
            epoch = self.schedule.round_epoch(k + 1)
        return self.finish(loaders)

    # -- steps --------------------------------------------------------------------------------
    def evaluate(self, loader) -> dict | None:
        if loader is None:
            return None
        return self.task.evaluate(self.model, loader, self.mask.mask.device, max_batches=self.max_batches)

    def selection(self, loaders: Loaders) -> dict:
        """{"selection": metrics on the held-out selection slice} when the stopping rule reads it."""
        return {"selection": self.evaluate(loaders.select)} if self.schedule.selection_samples() else {}

    def record_baseline(self, loaders: Loaders, **extra) -> dict:
        self.results.data["baseline"] = {"val": self.evaluate(loaders.val), **self.selection(loaders), **extra}
        self.results.save()
        self.observer.baseline(self.results.data["baseline"])
        return self.results.data["baseline"]

    def step(self, k: int, loaders: Loaders, sync: Callable[[Any], Any] | None = None) -> dict:
        """Round k (0-based): score, pick within the budget and the policy, mask, recover, record."""
        if k == 0:
            self._start(loaders)
        self.observer.before_round(k)
        self.last_good = self.mask.mask.detach().clone().cpu()
        goal = self.budget.goal(self.schedule, k, self.mask.alive(), self.costs)
        result = prune_round(self.model, self.mask, self.metric, self.layer_policy, goal.n_prune, loaders.score,
                             round_no=k + 1, eval_loader=loaders.val, sensitivity=self.sensitivity, sync=sync,
                             max_batches=self.max_batches, rearrange=self.rearrange,
                             cost_budget=(goal.costs, goal.share) if goal.share is not None else None,
                             task=self.task, kv_modes=self.kv_modes)
        if result.sensitivity is not None:
            self._record_sensitivity(result.sensitivity)
        self.observer.pruned(result)
        return self._recover(k, loaders, result.record())

    def _recover(self, k: int, loaders: Loaders, record: dict) -> dict:
        """Round k's recovery and its record (the second half of `step`)."""
        try:
            self.recovery.after_round(self.context(loaders, record), record)
        finally:
            self._resume_from = None
        self.rounds.append(record)
        self.awaiting_finetune = self.schedule.epochs_per_round > 0
        if not self.awaiting_finetune:  # nothing trains before the next round: this is its result
            record["val"] = record.get(AFTER_RECOVERY, record.get("val_before_finetune"))
            record.update(self.selection(loaders))
            self.check_stop()
            self.observer.recorded(record)
        self.results.save()
        return record

    def record_finetuned(self, loaders: Loaders, **extra) -> bool:
        """The last round's metrics after its fine-tuning; True when the stopping rule ends the run."""
        record = self.rounds[-1]
        record["val"] = self.evaluate(loaders.val)
        record.update(self.selection(loaders), **extra)
        self.awaiting_finetune = False
        self.results.save()
        stopped = self.check_stop()
        self.observer.recorded(record)
        return stopped

    def check_stop(self) -> bool:
        """Apply the schedule's stopping rule to the last round (on the selection slice); a
        rejected round's heads come back (the previous round's mask)."""
        if not self.schedule.can_reject:
            return False
        reason = self.schedule.stop_reason(self.results.data["baseline"]["selection"], self.rounds[-1]["selection"])
        if reason is None:
            return False
        self.stop_reason = reason
        self.rounds[-1]["rejected"] = True
        if self.last_good is not None:
            self.mask.mask.copy_(self.last_good.to(self.mask.mask.device))
        log.warning("stopping after round %d (%s); restored the mask of the previous round", self.rounds[-1]["round"],
                    reason)
        self.results.save()
        return True

    def loss(self, batch: dict) -> torch.Tensor:
        """The recovery's mean training loss on one batch (task loss, or distillation once a teacher is in)."""
        return self.recovery.training_loss(self.model, batch, self.task)[1].mean()

    def finish(self, loaders: Loaders, evaluate_final: bool | None = None) -> dict:
        """Fill in anything not yet evaluated and write `final` (with the kept-heads plot); its `val`
        is of the masked model in memory (`val_source`, `VAL_SOURCE`)."""
        data = self.results.data
        if not data["baseline"]:
            self.record_baseline(loaders)
        if self.rounds and self.awaiting_finetune:
            self.record_finetuned(loaders)
        fresh = evaluate_final if evaluate_final is not None else (
            self.stop_reason is not None or self.schedule.recover_epochs > 0 or not self.rounds)
        mask = self.mask
        data["final"] = {"sparsity": mask.sparsity(), "heads_per_layer": mask.heads_per_layer(),
                         "pruned": mask.pruned(), "rounds_completed": len(self.rounds),
                         "rounds_planned": self.num_rounds, "stop_reason": self.final_reason(),
                         "val": self.evaluate(loaders.val) if fresh else self.rounds[-1]["val"],
                         "val_source": VAL_SOURCE}
        data["final"].update(site_record(self.model, mask))  # several attention stacks: rows named, heads by stack
        self._record_placement()
        if self.costs is not None:  # the kept layout's share of the dense cost (with KV modes: the layout too)
            data["final"].update(self.kv_modes.final_record(self.model, self.budget, self.costs, mask.alive()))
        self.results.save()
        if self.results.output_dir is not None and self.results.writer:
            from headprune.plots import close, head_heatmap

            close(head_heatmap(mask.mask, f"kept heads (sparsity {mask.sparsity():.2f})",
                               self.results.output_dir / "head_mask.png", cmap="Greys_r", vmin=0, vmax=1,
                               rows=mask_sites(mask)))
        self.observer.finished(data)
        return data

    def final_reason(self) -> str:
        if self.stop_reason is not None:
            return self.stop_reason
        if len(self.rounds) < self.num_rounds:
            return f"interrupted after {len(self.rounds)} of {self.num_rounds} rounds"
        last = self.rounds[-1] if self.rounds else {}
        if not self.budget.counts_heads:
            return f"budget not met: {last['shortfall']}" if last.get("shortfall") else "target_reached"
        total = self.mask.mask.numel()
        planned = self.schedule.heads_after(self.num_rounds - 1, total) if self.num_rounds else 0
        pruned = total - int(self.mask.alive().sum())
        if pruned >= planned:
            return "target_reached"
        return f"constrained: the layer policy's limits let {pruned} of the {planned} heads the target asks for go"

    # -- internals ----------------------------------------------------------------------------
    def _start(self, loaders: Loaders) -> None:
        """Before round 1: the dense copy (when needed), the budget's costs, the recovery's setup."""
        if self.dense is None and (self.recovery.needs_dense or self.budget.needs_dense):
            self.dense = self.mask.unmasked_copy(self.model, lambda model: dense_copy(model, self.dense_device))
            self.results.data["dense_copy"] = {"where": self.dense_device, "device": str(compute_device(self.dense)),
                                               "dtype": str(next(self.dense.parameters()).dtype).removeprefix("torch.")}
        if self.costs is None and not self.budget.counts_heads:
            self._measure_costs()
        self.recovery.before_first_round(self.context(loaders))
        if self.dense is not None and not (self.recovery.keeps_dense or self.budget.needs_dense):
            self.dense = None  # what the recovery needed of it is taken (a cached teacher): free its memory

    def _record_placement(self) -> None:
        """results.json `model_device` (where the pruned model lived; streamed: its blocks' residency
        trace over the run) and the streamed dense copy's trace in `dense_copy`."""
        self.results.data["model_device"] = {"where": self.model_device, "device": str(compute_device(self.model)),
                                             **residency(self.model)}
        if self.dense is not None and "dense_copy" in self.results.data:
            self.results.data["dense_copy"].update(residency(self.dense))

    def _hold(self, dense: nn.Module) -> nn.Module:
        """A reloaded dense model (the saved teacher, a model for the budget) placed beside the run's
        model as `dense_device` says, in its dtype."""
        return hold_dense(dense, compute_device(self.model), next(self.model.parameters()).dtype, self.dense_device)

    def _measure_costs(self) -> None:
        start = time.perf_counter()
        self.costs, info = self.kv_modes.measure(self.budget, self.dense if self.dense is not None else self.model)
        self.results.data["budget"] = {**self.budget.record(), "unit": self.costs.unit, "dense_cost": self.costs.dense,
                                       **info, "seconds": round(time.perf_counter() - start, 3)}

    def _record_sensitivity(self, sensitivity: list[float]) -> None:
        share = self.layer_policy.share
        self.sensitivity = sensitivity
        self.results.data["layer_sensitivity"] = {"share": share, "loss_rise": sensitivity}
        log.info("layer sensitivity (loss rise with %.0f%% of a layer's heads masked): %s", 100 * share,
                 [round(s, 4) for s in sensitivity])
        if self.results.output_dir is not None and self.results.writer:
            from headprune.plots import close, layer_profile

            close(layer_profile(sensitivity, "layer sensitivity (validation-loss rise on the scoring slice)",
                                self.results.output_dir / "layer_sensitivity.png"))
