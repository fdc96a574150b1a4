"""Settings that could only fail later fail here, before any training, naming the field and
what is allowed."""
from __future__ import annotations

from omegaconf import DictConfig

from headprune.recovery.distill import Distill


def check_settings(cfg: DictConfig, schedule, distill: Distill | None) -> None:
    """What the config alone can tell."""
    for name in ("max_epochs", "min_epochs", "max_steps"):
        if cfg.trainer.get(name) not in (None, -1):
            raise ValueError(f"trainer.{name}={cfg.trainer.get(name)} is not allowed: the schedule sets the number of "
                             "epochs (schedule.baseline_epochs + rounds x schedule.epochs_per_round + "
                             "schedule.recover_epochs); set those instead")
    if schedule.num_rounds and cfg.data.get("score_samples", 1) == 0:
        raise ValueError("data.score_samples=0 leaves no held-out examples to score heads on; allowed: >= 1 "
                         "(or schedule.target_sparsity=0 to train without pruning)")
    if distill is not None and schedule.num_rounds and not (schedule.epochs_per_round or schedule.recover_epochs):
        raise ValueError("recovery=distill trains after each round, but the schedule has no epochs after pruning "
                         "(schedule.epochs_per_round=0, schedule.recover_epochs=0); allowed: either > 0, or "
                         "recovery=finetune")


def check_model(model, schedule, layer_policy) -> None:
    """What needs the model's shape: the target leaves a head, the policy's floor fits a layer."""
    from headprune.heads.adapters import model_shape

    layers, heads = model_shape(model)
    schedule.check_model(layers * heads)
    floor = getattr(layer_policy, "min_heads_per_layer", 0)
    if schedule.num_rounds and floor > heads:
        raise ValueError(f"layer_policy.min_heads_per_layer={floor} exceeds the model's {heads} heads per layer, so "
                         f"no head could be pruned; allowed: 0..{heads}")
