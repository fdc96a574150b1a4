"""Settings that could only fail later fail here, before any training, naming the field and
what is allowed."""
from __future__ import annotations

from omegaconf import DictConfig

from headprune.apps.objectives import OBJECTIVES
from headprune.recovery import Distill, NoRecovery


def check_settings(cfg: DictConfig, schedule, recovery, budget) -> None:
    """What the config alone can tell."""
    for name in ("max_epochs", "min_epochs", "max_steps"):
        if cfg.trainer.get(name) not in (None, -1):
            raise ValueError(f"trainer.{name}={cfg.trainer.get(name)} is not allowed: the schedule sets the number of "
                             "epochs (schedule.baseline_epochs + rounds x schedule.epochs_per_round + "
                             "schedule.recover_epochs); set those instead")
    if schedule.num_rounds and cfg.data.get("score_samples", 1) == 0:
        raise ValueError("data.score_samples=0 leaves no held-out examples to score heads on; allowed: >= 1 "
                         "(or schedule.target_sparsity=0 to train without pruning)")
    trains_after = bool(schedule.epochs_per_round or schedule.recover_epochs)
    if isinstance(recovery, Distill) and schedule.num_rounds and not trains_after:
        raise ValueError("recovery=distill trains after each round, but the schedule has no epochs after pruning "
                         "(schedule.epochs_per_round=0, schedule.recover_epochs=0); allowed: either > 0, or "
                         "recovery=finetune")
    if isinstance(recovery, NoRecovery) and trains_after:
        raise ValueError(f"recovery=none trains nothing after pruning, but schedule.epochs_per_round="
                         f"{schedule.epochs_per_round} and schedule.recover_epochs={schedule.recover_epochs}; allowed: "
                         "both 0, or recovery=finetune")
    names = list(cfg.get("objectives") or ["headline"])
    for name in names:
        if name not in OBJECTIVES:
            raise ValueError(f"objectives: {name!r} is not allowed; allowed: {', '.join(OBJECTIVES)}")
    if "latency_share" in names and budget.kind != "latency":
        raise ValueError("objectives: latency_share is measured under budget=latency only; allowed: kept_share, or "
                         "budget=latency")
    task = cfg.model.get("task", "classification")
    for name, needs in (("val_acc", "classification"), ("val_ppl", "causal_lm")):
        if name in names and task != needs:
            raise ValueError(f"objectives: {name} is not reported by a model.task={task} run")
    if not budget.counts_heads and schedule.can_reject:
        raise ValueError(f"budget={budget.kind} with schedule=until_threshold is not supported: the threshold stops "
                         "by accuracy, the budget by cost; allowed: schedule=one_shot, iterative or cubic")


def check_model(model, schedule, layer_policy, budget) -> None:
    """What needs the model's shape: the target leaves a head, the policy's floor fits a layer, the
    budget's sequence fits the positions."""
    from headprune.heads.adapters import model_shape

    layers, heads = model_shape(model)
    if budget.counts_heads:
        schedule.check_model(layers * heads)
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if not budget.counts_heads and positions and budget.seq > positions:
        raise ValueError(f"budget.seq={budget.seq} exceeds the model's {positions} positions; allowed: at most {positions}")
    floor = getattr(layer_policy, "min_heads_per_layer", 0)
    if schedule.num_rounds and floor > heads:
        raise ValueError(f"layer_policy.min_heads_per_layer={floor} exceeds the model's {heads} heads per layer, so "
                         f"no head could be pruned; allowed: 0..{heads}")
