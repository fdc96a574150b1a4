"""Settings that could only fail later fail here, before any training, naming the field and
what is allowed: `check_settings` when a `RunSpec` is built (what the settings alone can tell),
`check_model` once the model is loaded (what needs its shape)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from headprune.engine.offload import check_dense_device, check_model_device
from headprune.runs.objectives import OBJECTIVES
from headprune.selection.pruner import training_of
from headprune.tasks import check_model_task, get_task

if TYPE_CHECKING:
    from headprune.runs.spec import RunSpec


def check_settings(spec: RunSpec) -> None:
    """What the settings alone can tell: the model's task fits the data, the schedule's stop rule
    is one the task reports, the recovery and the budget fit the schedule and the policy (each
    checks its own fit), the dense copy's and the pruned model's places fit the budget and the
    training, and the objectives exist."""
    task, data = spec.task, spec.data
    if get_task(data.task) is not task:
        raise ValueError(f"model.task={task.name} does not fit data={data.name or data.load}, which holds "
                         f"{data.task} data; allowed: model.task={data.task}, or a {task.name} data config")
    schedule, recovery, budget = spec.schedule, spec.recovery, spec.budget
    schedule.check_metrics(task.val_metrics, task.name)
    if schedule.num_rounds and data.score_samples == 0:
        raise ValueError("data.score_samples=0 leaves no held-out examples to score heads on; allowed: >= 1 "
                         "(or schedule.target_sparsity=0 to train without pruning)")
    recovery.check(schedule)
    if schedule.num_rounds and data.score_samples is not None:
        recovery.check_calibration(int(data.score_samples))
    if recovery.needs_train_data and schedule.num_rounds and data.max_train_samples == 0:
        steps = getattr(recovery, "steps_setting", None) or f"recovery.steps={getattr(recovery, 'steps', None)}"
        raise ValueError(f"recovery={type(recovery).__name__.lower()} trains {steps} steps on the training blocks, but "
                         "data.max_train_samples=0 leaves none; allowed: data.max_train_samples > 0 or null")
    budget.check(schedule, spec.layer_policy)
    check_dense_device(spec.pruning.dense_device, budget.kind)
    check_model_device(spec.pruning.model_device, budget.kind,
                       training_of(schedule, recovery) or ("trainer.fast_dev_run" if spec.trains else None))
    names = list(spec.objectives)
    for name in names:
        if name not in OBJECTIVES:
            raise ValueError(f"objectives: {name!r} is not allowed; allowed: {', '.join(OBJECTIVES)}")
    if "latency_share" in names and "latency" not in budget.reports:
        raise ValueError("objectives: latency_share is measured under budget=latency only; allowed: kept_share, or "
                         "budget=latency")
    for name in names:
        if name.startswith("val_") and name.removeprefix("val_") not in task.val_metrics:
            raise ValueError(f"objectives: {name} is not reported by a model.task={task.name} run; allowed: "
                             f"{', '.join('val_' + m for m in task.val_metrics)} or a task-free objective")


def check_model(model, spec: RunSpec) -> None:
    """What needs the model's shape: its head does the run's task (model.task), the budget fits
    the model (a head remains, the sequence fits the positions, a KV cache exists), the policy's
    floor fits a layer."""
    from headprune.heads.adapters import model_shape

    from headprune.heads.hybrid import blockwise_refusal

    task, schedule, layer_policy, budget = spec.task, spec.schedule, spec.layer_policy, spec.budget
    check_model_task(model, task, "model.task")
    layers, heads = model_shape(model)
    budget.check_model(model, schedule, task)
    refusal = getattr(layer_policy, "measures_layout", False) and blockwise_refusal(
        model, f"layer_policy={layer_policy.name}", "layer_policy=global, uniform, depth_prior or sensitivity")
    if refusal:
        raise ValueError(refusal)
    floor = getattr(layer_policy, "min_heads_per_layer", 0)
    if schedule.num_rounds and floor > heads:
        raise ValueError(f"layer_policy.min_heads_per_layer={floor} exceeds the model's {heads} heads per layer, so "
                         f"no head could be pruned; allowed: 0..{heads}")
