"""Settings that could only fail later fail here, before any training, naming the field and
what is allowed."""
from __future__ import annotations

from omegaconf import DictConfig

from headprune.apps.objectives import OBJECTIVES
from headprune.engine.offload import check_dense_device
from headprune.tasks import Task, check_model_task


def check_settings(cfg: DictConfig, schedule, layer_policy, recovery, budget, task: Task) -> None:
    """What the config alone can tell (the recovery and the budget check their own fit with the
    schedule and the policy); `task`: the run's Task (model.task)."""
    for name in ("max_epochs", "min_epochs", "max_steps"):
        if cfg.trainer.get(name) not in (None, -1):
            raise ValueError(f"trainer.{name}={cfg.trainer.get(name)} is not allowed: the schedule sets the number of "
                             "epochs (schedule.baseline_epochs + rounds x schedule.epochs_per_round + "
                             "schedule.recover_epochs); set those instead")
    if schedule.num_rounds and cfg.data.get("score_samples", 1) == 0:
        raise ValueError("data.score_samples=0 leaves no held-out examples to score heads on; allowed: >= 1 "
                         "(or schedule.target_sparsity=0 to train without pruning)")
    recovery.check(schedule)
    if schedule.num_rounds and cfg.data.get("score_samples") is not None:
        recovery.check_calibration(int(cfg.data.score_samples))
    if recovery.needs_train_data and schedule.num_rounds and cfg.data.get("max_train_samples", None) == 0:
        steps = getattr(recovery, "steps_setting", None) or f"recovery.steps={cfg.recovery.get('steps')}"
        raise ValueError(f"recovery={type(recovery).__name__.lower()} trains {steps} steps on the training blocks, but "
                         "data.max_train_samples=0 leaves none; allowed: data.max_train_samples > 0 or null")
    budget.check(schedule, layer_policy)
    check_dense_device(cfg.pruning.get("dense_device", "run"), budget.kind)
    names = list(cfg.get("objectives") or ["headline"])
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


def check_model(model, schedule, layer_policy, budget, task: Task) -> None:
    """What needs the model's shape: its head does the run's `task` (model.task), the budget fits
    the model (a head remains, the sequence fits the positions, a KV cache exists), the policy's
    floor fits a layer."""
    from headprune.heads.adapters import model_shape

    from headprune.heads.hybrid import blockwise_refusal

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
