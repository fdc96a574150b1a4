"""A distillation teacher's next-token distributions computed once, so the KL steps train without
running (or holding) the teacher: per training example and position, the log-probabilities of the
teacher's k likeliest tokens at the distillation temperature and the log of the mass of all the
others (`recovery.teacher_logits=cached`, `recovery.teacher_topk=k`).

The KL is then taken over k + 1 outcomes: the k tokens, and "any other token" (the student's mass
outside the teacher's top k):
    KL_k = sum_{i in top k} p_i (log p_i - log q_i) + r (log r - log q_rest)
With k >= the vocabulary it is the exact KL; otherwise it is a lower bound of it (merging outcomes
never increases a KL), tight when the teacher's rest is small. A cache is built for one temperature
and refused for another. It holds N x P x k float32 log-probabilities and int32 token ids (P
scored positions per example): 583 blocks of 512 tokens at k = 64 are ~150 MB. (float16 halves the
log-probabilities' bytes, but its rounding moved six AdamW steps of a tiny model by 6% of their
whole change: AdamW turns small gradient differences into full-size steps.)
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headprune.engine.offload import compute_device
from headprune.engine.step_fit import EXAMPLE_INDEX, training_examples
from headprune.tasks import MODEL_INPUTS, Task, to_device

log = logging.getLogger(__name__)


@dataclass
class TopKTeacher:
    """The cached distributions (module docstring) of examples 0..N-1 of the training data."""

    temperature: float
    k: int
    logp: torch.Tensor  # (N, P, k) float32: the top-k log-probabilities at `temperature`
    index: torch.Tensor  # (N, P, k) int32: their token ids
    rest: torch.Tensor  # (N, P) float32: log of the other tokens' total probability
    seconds: float = 0.0
    batched: bool = False  # the training data were pre-made batches: entry i is batch i's (B, P, ...) rows

    def lookup(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp (B, P, k) float32, index (B, P, k) int64, rest (B, P)) of the examples at `positions`."""
        at = positions.cpu()
        if self.batched:
            at = int(at[0])
        return (self.logp[at].to(device, torch.float32), self.index[at].to(device, torch.int64),
                self.rest[at].to(device))


@torch.no_grad()
def build_teacher_cache(teacher: nn.Module, loader, task: Task, temperature: float, k: int,
                        batch_size: int = 4) -> TopKTeacher:
    """Run `teacher` once over every example of the training `loader` (as `step_fit` indexes them)
    and keep its top-`k` distributions at `temperature`."""
    examples, collate, _, single = training_examples(loader)
    batched = not single
    if batched:
        batch_size = 1  # each "example" is a pre-made batch
    device = compute_device(teacher)
    was_training = teacher.training
    teacher.eval()
    logps, indices, rests = [], [], []
    start = time.perf_counter()
    try:
        for first in range(0, len(examples), batch_size):
            group = list(range(first, min(first + batch_size, len(examples))))
            batch = to_device(collate([examples[i] for i in group]), device)
            logits = teacher(**{key: batch[key] for key in MODEL_INPUTS if key in batch}).logits
            log_p = F.log_softmax(task.positions(logits).float() / temperature, dim=-1)  # (b, P, V)
            top = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
            mass = top.values.exp().sum(-1)  # (b, P)
            logps.append(top.values.cpu())
            indices.append(top.indices.to(torch.int32).cpu())
            rests.append(torch.log1p(-mass.clamp(max=1.0)).clamp_min(-1e4).cpu())  # log(0) -> a finite floor
    finally:
        teacher.train(was_training)
    seconds = time.perf_counter() - start
    join = torch.stack if batched else torch.cat  # (N, B, P, k) for pre-made batches, else (N, P, k)
    cache = TopKTeacher(temperature, k, join(logps), join(indices), join(rests), round(seconds, 3), batched)
    log.info("teacher cache: top-%d log-probabilities %s in %.1f s (%.0f MB)", k, tuple(cache.logp.shape), seconds,
             sum(t.numel() * t.element_size() for t in (cache.logp, cache.index, cache.rest)) / 2 ** 20)
    return cache


def cached_kd_loss(student: torch.Tensor, cache: TopKTeacher, batch: dict, temperature: float,
                   task: Task) -> torch.Tensor:
    """(B,) T^2 x KL_k(teacher || student) over the task's scored positions (module docstring),
    averaged per example as `distill.kd_loss` averages the exact KL."""
    if temperature != cache.temperature:
        raise ValueError(f"the teacher cache was built at temperature {cache.temperature}, the loss asks for "
                         f"{temperature}; build it again")
    logp, index, rest = cache.lookup(batch[EXAMPLE_INDEX], student.device)
    log_q = F.log_softmax(task.positions(student).float() / temperature, dim=-1)  # (B, P, V)
    log_q_top = log_q.gather(-1, index)  # (B, P, k)
    log_q_rest = torch.log1p(-log_q_top.exp().sum(-1).clamp(max=1.0 - 1e-6))  # (B, P)
    p_top, p_rest = logp.exp(), rest.exp()
    kl = (p_top * (logp - log_q_top)).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * log_q_rest  # (B, P)
    return task.per_example(kl * temperature ** 2, batch)
