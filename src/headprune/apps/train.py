"""`headprune-train`: fine-tune, score, prune, repeat — composed by Hydra from conf/train.yaml.

Returns the final validation accuracy (classification; higher is better) or perplexity (causal
LM; lower is better) so Hydra sweepers can optimise it.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks import Checkpoint
from omegaconf import DictConfig, OmegaConf

from headprune.apps.components import build, instantiate_group
from headprune.apps import run_dir
from headprune.apps.config_paths import config_dir
from headprune.apps.config_schema import register_schemas
from headprune.apps.objectives import objectives
from headprune.apps.preflight import check_model, check_settings
from headprune.apps.resume import check_resume
from headprune.data import self_calibration
from headprune.deploy.fold import fold
from headprune.engine import FitPlan, Runtime, UnavailableRuntime
from headprune.evaluation import llm_suite
from headprune.evaluation.llm_suite import EvaluationSettings
from headprune.deploy.hf import load_pruned, save_pruned
from headprune.heads.hybrid import layer_report
from headprune.heads.surgery import count_params
from headprune.lightning.callbacks import HeadPruning
from headprune.lightning.loggers import LogSink, SinkLogger, finish_wandb, log_evaluation, log_stages
from headprune.lightning.observer import run_untrained
from headprune.lightning.module import HeadPruneModule
from headprune.results import RunResults
from headprune.models import load_tokenizer
from headprune.selection.kv_modes import KVModes
from headprune.selection.pruner import Pruner
from headprune.scoring.attention import end_of_sentence_ids
from headprune.tasks import Task, get_task, headline, max_positions

log = logging.getLogger(__name__)
register_schemas()


def run(cfg: DictConfig) -> dict:
    """Run one training/pruning job described by `cfg`; returns the results document. Every
    setting, the data, the model (and a teacher) are checked, and the run dir refused or checked,
    before anything is written into it; log lines until then reach train.log afterwards."""
    output_dir = Path(cfg.paths.output_dir)
    ckpt_path = cfg.get("ckpt_path")
    buffered, log_file = run_dir.LogBuffer(), None
    try:
        schedule = build(cfg.schedule)
        metric = build(cfg.metric)
        layer_policy = build(cfg.layer_policy)
        recovery = build(cfg.recovery)
        budget = build(cfg.budget)
        task = _task(cfg)  # the run's Task, built once here and handed to everything below
        schedule.check_metrics(task.val_metrics, task.name)
        check_settings(cfg, schedule, layer_policy, recovery, budget, task)
        runtime = Runtime.of(cfg.trainer)  # a GPU, device count or precision this machine lacks: refused here
        kv_modes = build(cfg.kv_modes) if cfg.get("kv_modes") else KVModes()
        kv_modes.check(schedule, layer_policy, recovery, budget, block_size=cfg.data.get("block_size"),
                       rearrange=bool(cfg.pruning.rearrange), world_size=runtime.world_size, resuming=bool(ckpt_path))
        evaluation = llm_suite.settings(cfg)
        evaluation.check(task)
        run_dir.refuse_to_overwrite(output_dir, resuming=bool(ckpt_path), overwrite=bool(cfg.get("overwrite", False)))
        if ckpt_path:
            finished = check_resume(cfg, ckpt_path, output_dir, schedule.total_epochs(), recovery)
            if finished is not None:
                return finished
        start = time.perf_counter()
        if not _trains(cfg, schedule) and runtime.world_size > 1:
            _launch(runtime)  # the other ranks start here and run the same command (a Trainer's fit launches its own)
        setup = _setup(cfg, output_dir, schedule, metric, layer_policy, recovery, budget, task, runtime, kv_modes)
        setup.evaluation = evaluation
        evaluation.check_model(setup.module.model, setup.datamodule)
        setup.stages["load"] = round(time.perf_counter() - start, 3)
        log_file = run_dir.prepare(output_dir, cfg)
    finally:
        buffered.release(into=log_file)
    try:
        return _run(cfg, output_dir, setup)
    finally:
        if log_file is not None:
            logging.getLogger().removeHandler(log_file)
            log_file.close()


@dataclass
class Setup:
    """What a run needs once every check has passed; nothing of it has written a file yet."""

    module: HeadPruneModule
    datamodule: object
    tokenizer: object
    pruner: Pruner
    pruning: HeadPruning
    baseline_params: dict
    runtime: Runtime = field(default_factory=Runtime)
    evaluation: EvaluationSettings = field(default_factory=EvaluationSettings)
    stages: dict = field(default_factory=dict)  # seconds per stage, for results.json


def _trains(cfg: DictConfig, schedule) -> bool:
    """Whether the run trains epochs under a Trainer (else it builds none)."""
    return schedule.total_epochs() > 0 or bool(cfg.trainer.get("fast_dev_run", False))


def _launch(runtime: Runtime) -> None:
    """The data-parallel processes of a run that trains no epoch: Lightning Fabric starts the other
    ranks (re-running this command, as a Trainer's fit does) and the process group; every rank then
    scores its shard of the calibration slice, and each recovery's fit joins this process group."""
    from lightning.fabric import Fabric

    fabric = Fabric(**{k: v for k, v in runtime.trainer_kwargs().items()
                       if k in ("accelerator", "devices", "strategy", "precision")})
    fabric.launch()
    runtime.rank, runtime.world_size = fabric.global_rank, fabric.world_size


def _setup(cfg: DictConfig, output_dir: Path, schedule, metric, layer_policy, recovery, budget, task: Task,
           runtime: Runtime | None = None, kv_modes: KVModes | None = None) -> Setup:
    """Data, model (and teacher) loaded and checked against the settings (first of all, the model's
    head against `task`); the run's objects built, each given `task`. A run without a Trainer places
    the model where `runtime` says (a Trainer places it itself)."""
    runtime = runtime or Runtime()
    trains = _trains(cfg, schedule)
    L.seed_everything(cfg.seed, workers=True)
    tokenizer = load_tokenizer(cfg.model.pretrained)
    select = {"select_samples": schedule.selection_samples()} if schedule.selection_samples() else {}
    datamodule = build(cfg.data, tokenizer=tokenizer, **select)
    datamodule.setup("fit")
    model = instantiate(cfg.model)(num_labels=datamodule.num_labels)
    check_model(model, schedule, layer_policy, budget, task)  # its head does model.task, before any work
    if not trains:
        runtime.place(model)
    kv_modes = kv_modes or KVModes()
    kv_modes.check_model(model, task)
    recovery.check_model(model)
    self_calibration.check_datamodule(datamodule, model, trains=trains or recovery.needs_train_data)
    metric = _with_eos_ids(metric, cfg.metric, model, tokenizer)
    _check_block_size(datamodule, model)
    labels = _name_labels(model, datamodule)
    baseline_params = count_params(model)
    module = HeadPruneModule(model, num_labels=datamodule.num_labels, task=task,
                             optimizer=instantiate(cfg.optim.optimizer),
                             scheduler=instantiate(cfg.optim.scheduler) if cfg.optim.get("scheduler") else None,
                             recovery=recovery, **_gates_in_finetune(cfg.metric))
    if not trains:
        module.head_mask.to(runtime.device)
    results = RunResults(output_dir, config=OmegaConf.to_container(cfg, resolve=True))
    results.data["runtime"] = runtime.record()
    hybrid = layer_report(model)
    if hybrid:  # the model layers the mask's rows are, and the attention-free layers left alone
        results.data["hybrid_layers"] = hybrid
    if labels:
        results.data["labels"] = labels
    if select:
        results.data["stop_rule_reads"] = (f"selection slice: {select['select_samples']} training examples held out "
                                           "(never the validation set reported in val)")
    pruner = Pruner(model, metric, schedule, layer_policy, budget, recovery, mask=module.head_mask,
                    rearrange=bool(cfg.pruning.rearrange), results=results, kv_modes=kv_modes,
                    dense_device=cfg.pruning.get("dense_device", "run"), task=task,
                    dense_factory=lambda: runtime.place(instantiate(cfg.model)(num_labels=datamodule.num_labels)))
    pruning = HeadPruning(pruner, diagnostics=_diagnostics_options(cfg),
                          check_consistency=bool(cfg.get("check_consistency", False)),
                          physical=bool(cfg.pruning.physical))
    return Setup(module, datamodule, tokenizer, pruner, pruning, baseline_params, runtime)


def _run(cfg: DictConfig, output_dir: Path, setup: Setup) -> dict:
    """The run: the Pruner's loop on its own when nothing trains (no Trainer is built), inside a
    Trainer's fit (the callback calls the same loop at each epoch end) when something does; then
    the export, and the LLM evaluations of the saved export as a user loads it."""
    module, datamodule, pruner, pruning = setup.module, setup.datamodule, setup.pruner, setup.pruning
    schedule, budget, results = pruner.schedule, pruner.budget, pruner.results
    loggers = instantiate_group(cfg.get("logger"))
    epochs = schedule.total_epochs()
    trains = _trains(cfg, schedule)
    runtime = setup.runtime
    log.info("schedule: %d baseline epoch(s), %d round(s) to %s, %d epoch(s) per round -> %d epochs%s",
             schedule.baseline_epochs, schedule.num_rounds, budget.describe(schedule), schedule.epochs_per_round, epochs,
             "" if trains else " (nothing trains: no Trainer)")
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
        if trains:
            callbacks = [pruning, *instantiate_group(cfg.get("callbacks"))]
            trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, max_epochs=max(epochs, 1),
                                  enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks))
        sink = LogSink.of_trainer(trainer) if trainer is not None else LogSink(loggers)
        writer = trainer.is_global_zero if trainer is not None else runtime.rank == 0
        pruner.fit_plan = FitPlan(runtime=runtime, loggers=[SinkLogger(sink)] if sink.loggers else [])
        if writer:
            sink.log_hyperparams({**(results.data.get("config") or {}), "runtime": results.data["runtime"]})
        if setup.evaluation.enabled and setup.evaluation.dense and writer:
            with runtime.autocast():
                _evaluate(results, "dense", setup, cfg, module.model, sink)
        start = time.perf_counter()
        if trainer is None:
            # no autocast around the pipeline: scoring and the reconstructions (least squares, refit)
            # read float32 activations (under bf16 autocast SmolLM2's refit ended at 308.8 instead of
            # 80.66: experiments/llm_iterative/autocast_bug); a recovery's steps run in the precision
            # through their fit
            run_untrained(pruner, module, datamodule, sink, physical=bool(cfg.pruning.physical),
                          diagnostics=pruning.diagnostics, runtime=runtime, ckpt_path=cfg.get("ckpt_path"),
                          check_consistency=pruning.check_consistency)
        else:
            trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            if "val" not in results.data["final"]:  # resumed at its last epoch (killed during the export)
                log.info("the checkpoint is at the run's last epoch: finishing the run")
                pruning.finish(module, datamodule, trainer)
        stages["train_and_prune"] = round(time.perf_counter() - start, 3)
        if cfg.get("export", True) and writer:
            start = time.perf_counter()
            export_pruned(module, output_dir / "export", results, setup.baseline_params, tokenizer=setup.tokenizer)
            stages["export"] = round(time.perf_counter() - start, 3)
            measured = budget.after_export(pruner.dense, module.model, results.data.get("rounds", []))
            if measured:
                results.data["final"].update(measured)
            if setup.evaluation.enabled:
                with runtime.autocast():
                    _evaluate(results, "pruned", setup, cfg, _load_export(output_dir / "export", module.model), sink)
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


def _load_export(directory: Path, model) -> object:
    """The saved export, loaded as a user loads it (`load_pruned`: plain `from_pretrained` when the
    layout is uniform), in the run model's dtype and on its device: what the evaluation reads, so
    a save bug cannot hide behind the in-memory model."""
    param = next(model.parameters())
    return load_pruned(directory, device=param.device, dtype=param.dtype).eval()


def _evaluate(results: RunResults, which: str, setup: Setup, cfg: DictConfig, model, sink: LogSink) -> None:
    """results.json `evaluation.<which>`: the LLM evaluations of `model` (the dense model in memory,
    or the export loaded from its folder: `source` says which, `llm_suite.SOURCES`), also sent to
    the loggers."""
    start = time.perf_counter()
    block = results.data.setdefault("evaluation", llm_suite.header(setup.evaluation, setup.datamodule))
    block[which] = {"source": llm_suite.SOURCES[which],
                    **llm_suite.evaluate_llm(model, setup.tokenizer, setup.datamodule, setup.evaluation,
                                             cfg.data.get("data_dir"))}
    if which == "pruned":
        block[which]["model"] = str(results.data["final"].get("export_dir"))
    setup.stages[f"evaluate_{which}"] = round(time.perf_counter() - start, 3)
    results.save()
    log_evaluation(sink, which, block[which])


def _with_eos_ids(metric, metric_cfg: DictConfig, model, tokenizer):
    """metric=confidence excludes the end-of-sentence token: give it the tokenizer's id ([SEP] for
    BERT, whose config names none) unless metric.eos_token_ids names it."""
    if not metric_cfg.get("exclude_eos", False) or metric_cfg.get("eos_token_ids") is not None:
        return metric
    return partial(metric, eos_token_ids=end_of_sentence_ids(model, tokenizer))


def _name_labels(model, datamodule) -> dict | None:
    """The label mapping of a classification run, put into the model's config (id2label /
    label2id travel with every checkpoint and export) and returned for results.json."""
    label_ids = getattr(datamodule, "label_ids", None)
    if not label_ids:
        return None
    id2label = {i: str(raw) for raw, i in sorted(label_ids.items(), key=lambda kv: kv[1])}
    model.config.id2label = id2label
    model.config.label2id = {raw: i for i, raw in id2label.items()}
    return {"label2id": {raw: i for i, raw in id2label.items()}, "id2label": {str(i): raw for i, raw in id2label.items()}}


def _task(cfg: DictConfig) -> Task:
    """The run's Task, from model.task, checked against the data config (a causal-LM data module
    sets `task: causal_lm` in its class, text classification has none); the model is checked
    against it once loaded (`preflight.check_model`)."""
    task = get_task(cfg.model.get("task", "classification"))
    target = get_class(cfg.data._target_)
    data_task = get_task(getattr(target, "task", "classification"))
    if data_task is not task:
        raise ValueError(f"model.task={task.name} does not fit data={cfg.data.get('name') or cfg.data._target_}, which "
                         f"holds {data_task.name} data; allowed: model.task={data_task.name}, or a {task.name} data "
                         "config")
    return task


def _check_block_size(datamodule, model) -> None:
    """A causal-LM block must fit the model's position embeddings."""
    block = getattr(datamodule, "block_size", None)
    positions = max_positions(model.config)
    if block is not None and positions is not None and block > positions:
        raise ValueError(f"data.block_size={block} exceeds the model's {positions} positions; allowed: at most "
                         f"{positions} (or raise the model's n_positions / max_position_embeddings)")


def export_pruned(module: HeadPruneModule, directory: Path, results: RunResults, baseline_params: dict,
                  tokenizer=None) -> None:
    """Fold the mask into the trained model (`deploy.fold`: gate values other than 0 and 1 scale
    their heads' output-projection columns, closed L0 gates and pruned heads leave the model) and
    save it with `save_pruned`, recording the dense model it came from (`model.pretrained`, a folder
    made absolute; none for a random-init model, which no name rebuilds) so headprune-bench compares
    the export with that model; record the export folder and parameter counts in results.json."""
    results.data["final"].update(fold(module.model, module.head_mask))
    model_cfg = results.data.get("config", {}).get("model") or {}
    origin = None if model_cfg.get("random_init") else model_cfg.get("pretrained")
    if origin is not None and Path(origin).expanduser().is_dir():
        origin = str(Path(origin).expanduser().resolve())
    save_pruned(module.model, directory, tokenizer=tokenizer, overwrite=True,  # the run owns its export folder
                origin=origin)
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
def main(cfg: DictConfig) -> float | list[float]:
    try:
        data = run(cfg)
    except UnavailableRuntime as err:  # a usage error: exit 2, nothing written
        print(f"headprune-train: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return objectives(data, cfg.get("objectives") or ["headline"])


if __name__ == "__main__":
    main()
