"""`recovery=lora`: low-rank adapters (LoRA, Hu et al. 2022, with peft) on the kept attention and
MLP projections, trained for a fixed budget of steps on the training text right after each round
masks its heads, then merged into the weights: the checkpoint and the export stay plain models
(LLM-Pruner's and FLAP's recovery of pruned LLMs).

The loss is the next-token cross-entropy, or with `alpha > 0` the distillation mix of distill.py
(KL to the unpruned model's next-token distribution; the teacher is `Pruner.dense`, saved once
to `<run dir>/teacher` for a resume). Every `nn.Linear` / `Conv1D` inside the transformer blocks
gets an adapter unless `target_modules` names a subset (by module name, e.g. [q_proj, v_proj]).

Head gating stays exact: the mask's hook sits on the output projection's input, and peft wraps
that projection, so while the adapters are in, every hook of a wrapped module moves to its wrapper
(the adapter of the output projection sees the gated heads, never a pruned head's output; after
physical removal with uneven KV groups, the query padding wraps the adapter's output too), and
back after the merge.
Merged adapters leave the weights only, so a resumed run (after any round) needs nothing but the
teacher.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Iterator, List, Optional

from torch import nn

from headprune.heads.adapters import PROJECTION_TYPES, get_adapter, stores_in_out
from headprune.recovery.base import RecoveryContext
from headprune.recovery.distill import Distilling
from headprune.recovery.trainable import trainable

log = logging.getLogger(__name__)


@dataclass
class Lora(Distilling):
    """`recovery=lora` settings (distillation's, `Distilling`, plus the adapters'); `alpha` is the
    weight of the distillation term (0: next-token loss only, no teacher kept)."""

    rank: int = 8
    lora_alpha: float = 16.0
    dropout: float = 0.05
    target_modules: Optional[List[str]] = None
    alpha: float = 0.0
    temperature: float = 1.0
    steps: int = 100
    lr: float = 2e-4

    record_key: ClassVar[str] = "lora"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"recovery.rank={self.rank!r} must be an integer >= 1")
        if self.steps < 1:
            raise ValueError(f"recovery.steps={self.steps!r} must be >= 1: recovery=lora trains that many steps after "
                             "each round (to skip recovery: recovery=none)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"recovery.dropout={self.dropout!r} must be in [0, 1)")

    def check_model(self, student: nn.Module) -> None:
        lora_targets(student, self.target_modules)  # names that match nothing fail now
        super().check_model(student)

    def after_round(self, ctx: RecoveryContext, record: dict) -> None:
        with lora_adapters(ctx.model, self) as modules:
            self.train_and_record(ctx, record, {"rank": self.rank, "modules": modules})


@contextmanager
def lora_adapters(model: nn.Module, settings: Lora) -> Iterator[int]:
    """Adapters of `settings` on `model` (the only parameters that train) for the block's
    duration; on exit they are merged into the weights and the plain modules, hooks and
    requires_grad flags are back. Yields the number of adapted modules.

    Every hook on an adapted module (the mask's gate on the output projection; physical
    removal's query padding and context gathering for uneven KV groups) moves onto peft's wrapper
    while the adapters are in, so the adapter's path sees what the base module sees, and moves
    back before the merge (its handles stay valid: the same ids return to the same module)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = lora_targets(model, settings.target_modules)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.lora_alpha, lora_dropout=settings.dropout,
                        target_modules=targets, fan_in_fan_out=stores_in_out(model.get_submodule(targets[0])))
    wrappers = []
    with trainable(model, lambda name: False):  # peft's adapters, created next, are all that trains
        try:
            inject_adapter_in_model(config, model)
            model.train(model.training)  # peft's new dropout modules start in training mode, whatever the model's
            wrappers = [model.get_submodule(name) for name in targets]
            for wrapper in wrappers:
                move_hooks(wrapper.get_base_layer(), wrapper)
            yield len(targets)
        finally:
            for wrapper in wrappers:
                move_hooks(wrapper, wrapper.get_base_layer())
            merge_lora(model)
            if hasattr(model, "peft_config"):  # inject_adapter_in_model's bookkeeping: nothing of peft stays
                del model.peft_config


HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
         "_forward_hooks_always_called")


def move_hooks(source: nn.Module, target: nn.Module) -> None:
    """Every forward (pre-)hook of `source` onto `target`, in order, under the same ids."""
    for name in HOOKS:
        getattr(target, name).update(getattr(source, name))
        getattr(source, name).clear()


def lora_targets(model: nn.Module, names: list[str] | None = None) -> list[str]:
    """Full names of the Linear / Conv1D modules inside the transformer blocks (embeddings and the
    LM head excluded), only those whose own name is in `names` when given."""
    blocks = {id(b) for b in get_adapter(model).blocks(model)}
    prefixes = tuple(f"{n}." for n, m in model.named_modules() if id(m) in blocks)
    found = [n for n, m in model.named_modules() if n.startswith(prefixes) and isinstance(m, PROJECTION_TYPES)
             and "lora_" not in n and not n.endswith("base_layer")]
    if names is None:
        return found
    short = sorted({n.rsplit(".", 1)[-1] for n in found})
    unknown = [n for n in names if n not in short]
    if unknown or not names:
        raise ValueError(f"recovery.target_modules={list(names)}: {unknown or 'empty'} is not a projection of this model; "
                         f"allowed: any of {short} (or null: all of them)")
    return [n for n in found if n.rsplit(".", 1)[-1] in names]


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA adapter into its base weight and put the base module back in its place;
    returns how many were merged."""
    from peft.tuners.lora import LoraLayer

    wrapped = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    for name, module in wrapped:
        module.merge()
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module.get_base_layer())
    return len(wrapped)
