"""Learned L0 head gates (Voita et al. 2019; Hard-Concrete gates of Louizos et al. 2018).

Each head gets a stochastic gate (heads/hard_concrete.py) trained to keep the task loss low
while an L0 penalty (weight x expected number of open gates) pushes gates shut. The score is
the probability that a gate is open, P(z != 0): raw HIGH = KEEP.

Two ways to get trained gates, both configured in one place (`metric=l0_gates`):
- during fine-tuning (`metric.finetune=true`): HeadPruneModule attaches the gates to its
  HeadMask and trains them with the model (the Voita setting), adding `metric.penalty` x the
  expected number of open gates to the loss, at learning rate `metric.lr`; this metric then
  just reads them.
- otherwise, at scoring time: fresh gates are trained for `steps` Adam steps (learning rate
  `lr`, penalty weight `penalty`) on the scoring batches, cycled, with the model frozen and in
  eval mode; gate noise comes from a generator seeded with `seed` (under data parallelism the
  gradients are averaged over ranks, so every rank learns the same gates). This is a short, cheap
  approximation of the fine-tuning setting: it ranks heads by how much the frozen model's loss
  needs them, and the gates are removed afterwards.
"""
from __future__ import annotations

from itertools import islice

import torch
from torch import nn

from headprune.distributed import all_reduce_sum, rank_and_world
from headprune.heads.hard_concrete import HardConcreteGates
from headprune.heads.mask import HeadMask
from headprune.tasks import Task, task_for, to_device
from headprune.scoring.reduce import finish_scores, scoring_mode


def train_gates(model: nn.Module, mask: HeadMask, dataloader, steps: int = 100, lr: float = 0.05,
                penalty: float = 0.01, seed: int = 0, max_batches: int | None = None,
                task: Task | None = None) -> HardConcreteGates:
    """Fresh Hard-Concrete gates trained on `dataloader` with the model's weights untouched, on
    `task`'s loss (the run's Task; None: the model's head's)."""
    for field, value in (("steps", steps), ("lr", lr)):
        if not value > 0:
            raise ValueError(f"metric.{field}={value!r} must be > 0")
    if penalty < 0:
        raise ValueError(f"metric.penalty={penalty!r} must be >= 0")
    task = task_for(model, task)
    batches = list(islice(dataloader, max_batches))
    if not batches:
        raise ValueError("l0_gates got an empty scoring dataloader (data.score_samples=0?)")
    device = mask.mask.device
    gates = HardConcreteGates(mask.num_layers, mask.num_heads).to(device)
    optimizer = torch.optim.Adam(gates.parameters(), lr=lr)
    generator = torch.Generator(device).manual_seed(int(seed))
    mask.stochastic = gates
    try:
        with scoring_mode(model), gates.sampling(generator):
            for step in range(int(steps)):
                batch = to_device(batches[step % len(batches)], device)
                loss = task.model_loss(model, batch).mean()
                loss = loss + penalty * gates.expected_l0()
                (grad,) = torch.autograd.grad(loss, [gates.log_alpha])
                gates.log_alpha.grad = all_reduce_sum(grad) / rank_and_world()[1]  # one set of gates on every rank
                optimizer.step()
    finally:
        mask.stochastic = None
    return gates


def l0_gates_importance(model: nn.Module, mask: HeadMask, dataloader, steps: int = 100, lr: float = 0.05,
                        penalty: float = 0.01, seed: int = 0, finetune: bool = False,
                        max_batches: int | None = None, task: Task | None = None) -> torch.Tensor:
    """(layers, heads) gate open-probabilities; pruned heads score 0. With `finetune` the gates
    trained with the model (HeadMask.stochastic) are read, and their absence is an error;
    otherwise gates already on the mask are read, or fresh ones trained on the frozen model."""
    gates = mask.stochastic
    if gates is None and finetune:
        raise ValueError("metric.finetune=true reads the gates trained during fine-tuning, but the model has none: "
                         "build HeadPruneModule with l0_penalty=metric.penalty > 0 (headprune-train does)")
    if gates is None:
        gates = train_gates(model, mask, dataloader, steps, lr, penalty, seed, max_batches, task)
    return finish_scores(gates.open_probability().detach(), mask)
