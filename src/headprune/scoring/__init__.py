"""Head-importance metrics. Every metric is a plain function
`fn(model, mask, dataloader, **options) -> (layers, heads) tensor`, higher = more important,
with pruned heads scored 0 (selection never ranks them again). A metric that computes a task's
loss or logits (taylor, fisher, lrp, l0_gates) has a `task` parameter: a run passes it its Task
(`score`); called by hand without one, it reads the model's head once per call."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from headprune.scoring.attention import confidence_importance, entropy_importance
from headprune.scoring.fisher import fisher_importance
from headprune.scoring.l0 import l0_gates_importance
from headprune.scoring.lrp import lrp_importance
from headprune.scoring.magnitude import magnitude_importance
from headprune.scoring.random_baseline import random_importance
from headprune.scoring.refit_error import refit_error_importance
from headprune.scoring.taylor import taylor_importance


@dataclass(frozen=True)
class MetricInfo:
    """What a metric measures. `raw` names the raw statistic and `raw_high` says what a HIGH
    raw value suggests ("keep", "prune" or "neither"); the score a metric returns is always
    oriented so that higher = more important. `uses` lists what scoring needs. `stacks`: the metric
    scores every site of a model with several attention stacks (T5, Whisper, BART: tests/test_stacks.py);
    one that reads one sequence's tokens per layer says False and calls `heads.stacks.refuse_several_stacks`,
    whose message names the metrics with `stacks` (`stacked_metrics`)."""

    fn: Callable[..., torch.Tensor]
    raw: str
    raw_high: str
    uses: str
    stacks: bool = True


METRIC_INFO: dict[str, MetricInfo] = {
    "taylor": MetricInfo(taylor_importance, "|sum_t c_h . dL/dc_h| per example (Michel et al. 2019)", "keep",
                         "labels, one forward+backward per batch"),
    "fisher": MetricInfo(fisher_importance, "squared per-example gradient of the loss w.r.t. the head gate "
                         "(Kwon et al. 2022)", "keep", "labels, one forward+backward per batch"),
    "lrp": MetricInfo(lrp_importance, "per-layer share of the target logit's relevance (Voita et al. 2019)",
                      "keep", "one forward+backward per batch"),
    "entropy": MetricInfo(entropy_importance, "mean attention entropy over real queries; score = -entropy",
                          "prune", "attention maps (eager), forward only", stacks=False),
    "confidence": MetricInfo(confidence_importance, "mean max attention weight over real queries (Voita et al.)",
                             "keep", "attention maps (eager), forward only", stacks=False),
    "magnitude": MetricInfo(magnitude_importance, "L2 norm of the head's Q/K/V/O weight slices", "keep",
                            "weights only"),
    "refit_error": MetricInfo(refit_error_importance, "error the output projection's refit leaves without the unit "
                              "(grouped OBS on the contexts' Gram inverse, SlimGPT); greedy per layer", "keep",
                              "forward only, one Gram matrix per layer", stacks=False),
    "random": MetricInfo(random_importance, "seeded U(0, 1)", "neither", "nothing"),
    "l0_gates": MetricInfo(l0_gates_importance, "P(Hard-Concrete gate open) (Voita et al. 2019)", "keep",
                           "gates trained in fine-tuning, else `steps` forward+backward passes",
                           stacks=False),  # not checked on several stacks
}

METRICS: dict[str, Callable[..., torch.Tensor]] = {name: info.fn for name, info in METRIC_INFO.items()}


def stacked_metrics() -> list[str]:
    """The metrics that score every site of a model with several attention stacks (`MetricInfo.stacks`)."""
    return [name for name, info in METRIC_INFO.items() if info.stacks]


def metric_name(fn: Callable) -> str | None:
    """The registered name of `fn` (a metric function or a partial of one), else None."""
    target = getattr(fn, "func", fn)
    return next((name for name, f in METRICS.items() if f is target), None)


def get_metric(name: str) -> Callable[..., torch.Tensor]:
    if name not in METRICS:
        raise ValueError(f"metric={name!r} is not a known metric; allowed: {', '.join(sorted(METRICS))}")
    return METRICS[name]


def takes_task(fn: Callable) -> bool:
    """Whether metric `fn` (a function or a partial of one) has a `task` parameter."""
    try:
        return "task" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


def score(metric: Callable, model, mask, dataloader, task=None, **options) -> torch.Tensor:
    """`metric`'s scores, given the run's `task` when the metric has a `task` parameter (a metric
    that computes no loss has none and needs none)."""
    if task is not None and takes_task(metric):
        options["task"] = task
    return metric(model, mask, dataloader, **options)


def score_heads(model, dataloader, metric: str = "taylor", mask=None, **options) -> torch.Tensor:
    """Score every head of `model` on `dataloader` with the metric called `metric`.

    `mask` is the model's HeadMask if it has one; otherwise a temporary all-ones mask is
    attached for the duration of the call.
    """
    from headprune.heads.mask import HeadMask

    fn = get_metric(metric)
    if mask is not None:
        return fn(model, mask, dataloader, **options)
    device = next(model.parameters()).device
    temp = HeadMask.for_model(model).to(device)
    try:
        return fn(model, temp, dataloader, **options)
    finally:
        temp.detach()
