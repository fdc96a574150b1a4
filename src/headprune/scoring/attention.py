"""Attention-distribution metrics: entropy and confidence (Voita et al. 2019).

Both read each head's attention map p (a distribution over keys for every query) and
average a per-query statistic over the real (non-pad) query tokens of an example, then over
examples. Padded keys carry no probability (the model masks them), and the statistics only
sum over real keys.

- entropy: raw H = -sum_k p_k log p_k. HIGH raw entropy = near-uniform attention = PRUNE
  first; the score is -H so that higher means more important, as for every metric.
- confidence: raw max_k p_k over the keys that are not the end-of-sentence token (Voita et al.
  2019 exclude EOS: many heads park their attention there as a no-op, which says nothing about
  how committed they are). HIGH = a head that commits to one token = KEEP; the score is the raw
  value. `exclude_eos=false` takes the maximum over every real key, end of sentence included.
  The end-of-sentence ids are `eos_token_ids`, else the model config's `sep_token_id` /
  `eos_token_id` (headprune-train fills them from the tokenizer: [SEP] for BERT).

Attention maps exist only under eager attention (`output_attentions=True` returns nothing
under sdpa), so the model is switched to eager for the pass and switched back after.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from headprune.heads.adapters import get_adapter, head_layout
from headprune.heads.mask import HeadMask
from headprune.heads.stacks import refuse_several_stacks
from headprune.tasks import MODEL_INPUTS, real_tokens, to_device
from headprune.scoring.reduce import finish_scores, mean_over_ranks


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Eager attention inside the context; the previous implementation (e.g. sdpa) after."""
    previous = model.config._attn_implementation
    if previous == "eager":
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def attention_maps(model: nn.Module, dataloader, device: torch.device,
                   max_batches: int | None = None) -> Iterator[tuple[dict, list[torch.Tensor]]]:
    """Yield (batch, maps) for each batch, in eval mode without gradients.

    maps[l] is (B, h_l, T, T) for the h_l heads layer l physically has (original ids in
    `head_layout(model)[l]`), or None for a layer left with no heads; padded keys are zeroed.
    """
    layout = head_layout(model)
    with_heads = [layer for layer, kept in enumerate(layout) if kept]
    # a partly kept KV group has zero queries padded in: the kernel's maps have a head per slot
    slots = [get_adapter(model).query_slots(model.config, kept)[0] for kept in layout]
    was_training = model.training
    model.eval()
    try:
        with eager_attention(model), torch.no_grad():
            for i, batch in enumerate(dataloader):
                if max_batches is not None and i >= max_batches:
                    break
                batch = to_device(batch, device)
                inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
                attentions = [a for a in model(**inputs, output_attentions=True).attentions if a is not None]
                if len(attentions) != len(with_heads):
                    raise RuntimeError(f"the model returned {len(attentions)} attention maps for "
                                       f"{len(with_heads)} layers with heads: attention maps need eager attention, "
                                       f"and {type(model).__name__} is running "
                                       f"{model.config._attn_implementation!r}")
                keys = real_tokens(batch)[:, None, None, :]  # (B, 1, 1, T)
                maps: list[torch.Tensor | None] = [None] * len(layout)
                for layer, a in zip(with_heads, attentions):
                    maps[layer] = a.float()[:, slots[layer]] * keys  # (B, h_l, T, T)
                yield batch, maps
    finally:
        model.train(was_training)


def query_mean(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B, h, T) per-query values -> (B, h) mean over each example's real query tokens."""
    weights = real[:, None, :].float()  # (B, 1, T)
    return (values * weights).sum(-1) / weights.sum(-1).clamp_min(1.0)


def row_entropy(p: torch.Tensor) -> torch.Tensor:
    """(..., T) distributions over keys -> (...) entropy in nats (0 log 0 = 0)."""
    return -torch.where(p > 0, p * p.clamp_min(1e-30).log(), torch.zeros_like(p)).sum(-1)


def _per_head_statistic(model: nn.Module, mask: HeadMask, dataloader, statistic: Callable,
                        max_batches: int | None) -> torch.Tensor:
    """Mean over examples of `statistic(p, batch) -> (B, h, T)` averaged over real queries, (layers, heads)."""
    from headprune.scoring import stacked_metrics  # the registry imports this module

    refuse_several_stacks(model, "entropy/confidence", "averages attention maps over the real tokens of one "
                          "sequence", stacked_metrics())
    layout = head_layout(model)
    total = torch.zeros_like(mask.mask, dtype=torch.float64)
    count = 0
    for batch, maps in attention_maps(model, dataloader, mask.mask.device, max_batches):
        real = real_tokens(batch)
        for layer, p in enumerate(maps):  # (B, h, T, T)
            if p is not None:
                total[layer, layout[layer]] += query_mean(statistic(p, batch), real).sum(0).double()
        count += real.shape[0]
    return mean_over_ranks(total, count)


def entropy_importance(model: nn.Module, mask: HeadMask, dataloader,
                       max_batches: int | None = None) -> torch.Tensor:
    """(layers, heads) negative mean attention entropy; pruned heads score 0."""
    entropy = _per_head_statistic(model, mask, dataloader, lambda p, batch: row_entropy(p), max_batches)
    return finish_scores(-entropy, mask)


def end_of_sentence_ids(model: nn.Module, tokenizer=None) -> list[int]:
    """The end-of-sentence token ids: the tokenizer's [SEP] / EOS when given, else the config's."""
    source = tokenizer if tokenizer is not None else model.config
    ids = {getattr(source, name, None) for name in ("sep_token_id", "eos_token_id")}
    return sorted(int(i) for i in ids if isinstance(i, int))


def confidence_importance(model: nn.Module, mask: HeadMask, dataloader, exclude_eos: bool = True,
                          eos_token_ids: list[int] | None = None, max_batches: int | None = None) -> torch.Tensor:
    """(layers, heads) mean maximum attention weight (end-of-sentence keys excluded unless
    `exclude_eos=False`); pruned heads score 0."""
    if not exclude_eos:
        return finish_scores(_per_head_statistic(model, mask, dataloader, lambda p, batch: p.amax(-1), max_batches),
                             mask)
    eos = list(eos_token_ids) if eos_token_ids is not None else end_of_sentence_ids(model)
    if not eos:
        raise ValueError(f"metric=confidence excludes the end-of-sentence token, but {type(model).__name__}'s config "
                         "names none (no sep_token_id / eos_token_id); allowed: metric.eos_token_ids=[<id>] or "
                         "metric.exclude_eos=false")

    def max_without_eos(p: torch.Tensor, batch: dict) -> torch.Tensor:
        keep = ~torch.isin(batch["input_ids"], torch.tensor(eos, device=p.device))  # (B, T)
        return (p * keep[:, None, None, :].to(p.dtype)).amax(-1)  # (B, h, T)

    return finish_scores(_per_head_statistic(model, mask, dataloader, max_without_eos, max_batches), mask)
