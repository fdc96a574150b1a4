"""`run(spec)`: one training/pruning run from its `RunSpec` (what `headprune-train` runs, and what
the Python API calls): every check before anything is written, then the Pruner's loop (on its own
when nothing trains, inside a Trainer's fit when something does), the export, and the LLM
evaluations of the saved export as a user loads it. Returns the results document (results.json)."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import lightning as L
from lightning.pytorch.callbacks import Checkpoint

from headprune.data import self_calibration
from headprune.engine import FitPlan, Runtime
from headprune.evaluation import llm_suite
from headprune.lightning.loggers import LogSink, SinkLogger, finish_wandb, log_evaluation, log_stages
from headprune.lightning.observer import run_untrained
from headprune.results import RunResults
from headprune.runs import run_dir
from headprune.runs.assembly import Setup, assemble
from headprune.runs.export import export_pruned, load_export
from headprune.runs.resume import check_resume
from headprune.runs.spec import RunSpec
from headprune.tasks import headline

log = logging.getLogger(__name__)

# what a run calls once every check has passed, with its run dir: writes the caller's record of
# the run there (the Hydra app: .hydra/ and train.log) and returns a log handler to close at the end
Record = Callable[[Path], "logging.Handler | None"]


def run(spec: RunSpec, record: Record | None = None) -> dict:
    """Run `spec`; returns the results document. The machine is checked for the trainer settings
    (`engine.UnavailableRuntime` when it cannot give them), the KV modes and evaluations for the
    run, the run dir refused or checked, a resume checked against its checkpoint, the data and the
    model (and a teacher) loaded and checked, all before anything is written into the run dir;
    log lines until then reach the log file `record` opens afterwards."""
    output_dir, ckpt_path = spec.output.output_dir, spec.output.ckpt_path
    buffered, log_file = run_dir.LogBuffer(), None
    try:
        runtime = Runtime.of(spec.trainer.settings)  # a GPU, device count or precision this machine lacks: refused here
        spec.kv_modes.check(spec.schedule, spec.layer_policy, spec.recovery, spec.budget,
                            block_size=spec.data.block_size, rearrange=spec.pruning.rearrange,
                            world_size=runtime.world_size, resuming=bool(ckpt_path),
                            score_samples=getattr(spec.data, "score_samples", None))
        spec.evaluation.check(spec.task)
        run_dir.refuse_to_overwrite(output_dir, resuming=bool(ckpt_path), overwrite=spec.output.overwrite)
        if ckpt_path:
            finished = check_resume(spec.record(), ckpt_path, output_dir, spec.schedule.total_epochs(), spec.recovery,
                                    runtime=runtime)
            if finished is not None:
                return finished
        start = time.perf_counter()
        if not spec.trains and runtime.world_size > 1:
            _launch(runtime)  # the other ranks start here and run the same command (a Trainer's fit launches its own)
        setup = assemble(spec, runtime)
        spec.evaluation.check_model(setup.module.model, setup.datamodule)
        setup.stages["load"] = round(time.perf_counter() - start, 3)
        run_dir.check_writable(output_dir)
        run_dir.retire_old_export(output_dir, resuming=bool(ckpt_path), overwrite=spec.output.overwrite)
        log_file = record(output_dir) if record is not None else None
    finally:
        buffered.release(into=log_file)
    try:
        return _execute(spec, setup)
    finally:
        if log_file is not None:
            logging.getLogger().removeHandler(log_file)
            log_file.close()


def _launch(runtime: Runtime) -> None:
    """The data-parallel processes of a run that trains no epoch: Lightning Fabric starts the other
    ranks (re-running this command, as a Trainer's fit does) and the process group; every rank then
    scores its shard of the calibration slice, and each recovery's fit joins this process group."""
    from lightning.fabric import Fabric

    fabric = Fabric(**{k: v for k, v in runtime.trainer_kwargs().items()
                       if k in ("accelerator", "devices", "strategy", "precision")})
    fabric.launch()
    runtime.rank, runtime.world_size = fabric.global_rank, fabric.world_size


def _execute(spec: RunSpec, setup: Setup) -> dict:
    """The run: the Pruner's loop on its own when nothing trains (no Trainer is built), inside a
    Trainer's fit (the callback calls the same loop at each epoch end) when something does; then
    the export, and the LLM evaluations of the saved export as a user loads it."""
    module, datamodule, pruner, pruning = setup.module, setup.datamodule, setup.pruner, setup.pruning
    schedule, budget, results = pruner.schedule, pruner.budget, pruner.results
    output_dir, ckpt_path = spec.output.output_dir, spec.output.ckpt_path
    loggers = spec.loggers()
    epochs = schedule.total_epochs()
    runtime = setup.runtime
    log.info("schedule: %d baseline epoch(s), %d round(s) to %s, %d epoch(s) per round -> %d epochs%s",
             schedule.baseline_epochs, schedule.num_rounds, budget.describe(schedule), schedule.epochs_per_round, epochs,
             "" if spec.trains else " (nothing trains: no Trainer)")
    stages = setup.stages
    results.data["stages"] = stages
    # data.calibration=self|mix: the dense model samples its calibration blocks (or the run dir's cache holds them)
    calibration = self_calibration.prepare(datamodule, module.model, setup.tokenizer, output_dir,
                                          rank_zero=run_dir.is_rank_zero())
    if calibration:
        results.data["calibration"] = calibration
        if "generated" in calibration:
            stages["self_calibration"] = calibration["generated"]["seconds"]
    trainer: L.Trainer | None = None
    try:
        if spec.trains:
            callbacks = [pruning, *spec.callbacks()]
            trainer = spec.trainer.build(callbacks=callbacks, logger=loggers or False, max_epochs=max(epochs, 1),
                                         enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks))
        sink = LogSink.of_trainer(trainer) if trainer is not None else LogSink(loggers)
        writer = trainer.is_global_zero if trainer is not None else runtime.rank == 0
        pruner.fit_plan = FitPlan(runtime=runtime, loggers=[SinkLogger(sink)] if sink.loggers else [])
        if writer:
            sink.log_hyperparams({**(results.data.get("config") or {}), "runtime": results.data["runtime"]})
        if setup.evaluation.enabled and setup.evaluation.dense and writer:
            with runtime.autocast():
                _evaluate(results, "dense", setup, spec, module.model, sink)
        start = time.perf_counter()
        if trainer is None:
            # no autocast around the pipeline: scoring and the reconstructions (least squares, refit)
            # read float32 activations (under bf16 autocast SmolLM2's refit ended at 308.8 instead of
            # 80.66: experiments/llm_iterative/autocast_bug); a recovery's steps run in the precision
            # through their fit
            run_untrained(pruner, module, datamodule, sink, physical=spec.pruning.physical,
                          diagnostics=pruning.diagnostics, runtime=runtime, ckpt_path=ckpt_path,
                          check_consistency=pruning.check_consistency)
        else:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
            # Lightning's teardown moved the module to the CPU (Strategy.teardown): the export's
            # evaluation and the budget's measurements run where the model trained
            module.to(runtime.device)
            if "val" not in results.data["final"]:  # resumed at its last epoch (killed during the export)
                log.info("the checkpoint is at the run's last epoch: finishing the run")
                pruning.finish(module, datamodule, trainer)
        stages["train_and_prune"] = round(time.perf_counter() - start, 3)
        if spec.output.export and writer:
            start = time.perf_counter()
            export_pruned(module, output_dir / "export", results, setup.baseline_params, tokenizer=setup.tokenizer)
            stages["export"] = round(time.perf_counter() - start, 3)
            measured = budget.after_export(pruner.dense, module.model, results.data.get("rounds", []))
            if measured:
                results.data["final"].update(measured)
            if setup.evaluation.enabled:
                with runtime.autocast():
                    _evaluate(results, "pruned", setup, spec, load_export(output_dir / "export", module.model), sink)
            results.save()
        if writer:
            log_stages(sink, stages)
    finally:
        finish_wandb(loggers)  # a failed job in a sweep still finishes its wandb run
    final = results.data["final"]
    name, base_value = headline(results.data["baseline"]["val"])
    log.info("baseline val %s %s -> final val %s %s at sparsity %.2f (results: %s)", name, base_value,
             *headline(final["val"]), final["sparsity"], results.path)
    return results.data


def _evaluate(results: RunResults, which: str, setup: Setup, spec: RunSpec, model, sink: LogSink) -> None:
    """results.json `evaluation.<which>`: the LLM evaluations of `model` (the dense model in memory,
    or the export loaded from its folder: `source` says which, `llm_suite.SOURCES`), also sent to
    the loggers."""
    start = time.perf_counter()
    block = results.data.setdefault("evaluation", llm_suite.header(setup.evaluation, setup.datamodule))
    block[which] = {"source": llm_suite.SOURCES[which],
                    **llm_suite.evaluate_llm(model, setup.tokenizer, setup.datamodule, setup.evaluation,
                                             spec.data.data_dir)}
    if which == "pruned":
        block[which]["model"] = str(results.data["final"].get("export_dir"))
    llm_suite.ruler_floor(block)
    setup.stages[f"evaluate_{which}"] = round(time.perf_counter() - start, 3)
    results.save()
    log_evaluation(sink, which, block[which])
