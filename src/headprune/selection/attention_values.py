"""`kv_modes=attention_mass` and `kv_modes=retrieval`: what each KV unit is worth full and windowed,
training-free, from attention statistics (valuations of `selection.valuations`).

- `attention_mass`: the share of each unit's attention probability on keys outside its sinks and
  recent window (averaged over its query heads and over the queries that have such keys, on the
  calibration blocks; one eager forward per block), so a windowed unit keeps 1 - mass of what it is
  worth full; full is worth the metric's unit score (the sum of its heads' scores, shifted to be
  non-negative, as the cost budgets rank units), or 1 for every unit with `unit_value=uniform`.
- `retrieval`: `attention_mass`, with each unit's share lost to a window the larger of its
  attention mass and its retrieval score (RazorAttention, 2407.15891: "echo" and "induction"
  heads): on one seeded sequence of random tokens repeating with a period longer than sink + window
  (`data.retrieval`), the attention a query head puts on the earlier copy of its current token
  (echo) and on the token after it (induction), keys a window cannot see; a unit scores its most
  retrieving query head's (a KV group must stay full if any of its heads copies from far back).
  Why: the attention mass on natural text keeps full the units that look far back most on average,
  which are not the few that fetch a fact from thousands of tokens back (passkey retrieval fell
  from 0.80 to 0.20 with attention_mass at 2/3 of the KV bytes removed; experiments/llm_kv_modes).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from headprune.data.retrieval import repeated_random_tokens, retrieval_period
from headprune.heads.adapters import get_adapter
from headprune.heads.windows import window_allowed


@torch.no_grad()
def attention_maps(model: nn.Module, inputs: list[torch.Tensor], reduce, choice: str) -> None:
    """Run `model` (eval mode, eager attention: its probabilities) on each of `inputs` (B, T) ids,
    handing each layer's attention probabilities (B, H, Q, K) to `reduce(layer, weights)` as they
    are made, one layer's maps at a time (dropped from the module's output after); `choice` names
    the kv_modes statistic in errors."""
    from headprune.scoring.attention import eager_attention

    adapter = get_adapter(model)

    def hook(layer: int):
        def read(module, args, output):
            if output[1] is None:
                raise ValueError(f"kv_modes={choice} needs the attention probabilities, which this attention module "
                                 "does not return under eager attention")
            reduce(layer, output[1])
            return (output[0], None, *output[2:])
        return read

    handles = [adapter.attention(block).register_forward_hook(hook(l)) for l, block in enumerate(adapter.blocks(model))]
    # only the attention maps are read: a head that takes `logits_to_keep` computes one position's
    # logits, not (B, T, vocab) ones (4.3 GB for Gemma 3's 262k vocabulary at 4096 tokens)
    head = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    was_training = model.training
    model.eval()
    try:
        with eager_attention(model):
            for ids in inputs:
                model(input_ids=ids, use_cache=False, **head)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()


def attention_mass(model: nn.Module, batches: list[dict], units: list[list[int]], sink: int,
                   window: int) -> list[list[float]]:
    """mass[l][u]: the mean share of unit u's attention probability (its query heads, the queries
    at slots >= sink + window, every block) on keys outside its sinks and window; eager attention
    for the pass (its probabilities), one layer's maps at a time."""
    adapter = get_adapter(model)
    n_layers = len(adapter.blocks(model))
    sums = [torch.zeros(adapter.num_heads(model.config), dtype=torch.float64) for _ in range(n_layers)]
    count = [0]

    def reduce(layer: int, weights: torch.Tensor) -> None:  # weights (B, H, Q, K)
        q = weights.shape[-2]
        if q <= sink + window:
            raise ValueError(f"kv_modes=attention_mass: blocks of {q} tokens have no key outside sink + window = "
                             f"{sink + window}")
        slots = torch.arange(q, device=weights.device)
        outside = ~window_allowed(slots[sink + window:], slots, sink, window)  # (Q', K)
        outside &= slots[None, :] <= slots[sink + window:, None]
        mass = (weights[:, :, sink + window:].float() * outside).sum(-1)  # (B, H, Q')
        sums[layer] += mass.sum(dim=(0, 2)).double().cpu()
        if layer == 0:
            count[0] += mass.shape[0] * mass.shape[2]

    attention_maps(model, [batch["input_ids"] for batch in batches], reduce, "attention_mass")
    per_head = [s / max(count[0], 1) for s in sums]
    return [[float(per_head[l][heads].mean()) for heads in units] for l in range(n_layers)]


def retrieval_scores(model: nn.Module, units: list[list[int]], sink: int, window: int, seq: int,
                     device, seed: int = 0) -> tuple[list[list[float]], int]:
    """(scores[l][u], period): per unit, its most retrieving query head's mean attention on the
    earlier copy of the query's token (echo, key i - period) plus the token after it (induction,
    key i - period + 1), over the queries i >= period + sink whose earlier copy exists, on one
    seeded `seq`-token sequence of random tokens repeating every `period` (> sink + window, so
    those keys are outside every window and past the sinks). Eager attention for the pass."""
    period = retrieval_period(seq, sink, window)
    ids = repeated_random_tokens(model.config, seq, period, seed).to(device)
    per_head: dict[int, torch.Tensor] = {}
    queries = torch.arange(period + sink, seq, device=device)  # (Q,)

    def reduce(layer: int, weights: torch.Tensor) -> None:  # weights (1, H, T, T)
        echo = weights[0][:, queries, queries - period].float()  # (H, Q)
        induction = weights[0][:, queries, queries - period + 1].float()  # (H, Q)
        per_head[layer] = (echo + induction).mean(-1).double().cpu()  # (H,)

    attention_maps(model, [ids], reduce, "retrieval")
    return [[float(per_head[l][heads].max()) for heads in units] for l in range(len(per_head))], period


def _full(unit_scores: list[list[float]] | None, units: list[list[int]], unit_value: str,
          layers: int) -> list[list[float]]:
    """What each unit kept full is worth: the metric's unit score, or 1 (`unit_value=uniform`, where
    the round computes no score: `unit_scores` None)."""
    return [[1.0] * len(units) for _ in range(layers)] if unit_value == "uniform" else unit_scores


def mass_values(model: nn.Module, batches: list[dict], units: list[list[int]], sink: int, window: int, *,
                unit_scores: list[list[float]], unit_value: str = "metric") -> tuple[list, list, dict]:
    """kv_modes=attention_mass: (full, windowed = full x (1 - mass), what was measured)."""
    mass = attention_mass(model, batches, units, sink, window)
    full = _full(unit_scores, units, unit_value, len(mass))
    windowed = [[f * (1.0 - m) for f, m in zip(fs, ms)] for fs, ms in zip(full, mass)]
    return full, windowed, {"mass_beyond_window": mass}


def retrieval_values(model: nn.Module, batches: list[dict], units: list[list[int]], sink: int, window: int, *,
                     unit_scores: list[list[float]], unit_value: str = "metric") -> tuple[list, list, dict]:
    """kv_modes=retrieval: (full, windowed = full x (1 - max(mass, retrieval score)), what was
    measured); the retrieval sequence as long as the calibration blocks."""
    mass = attention_mass(model, batches, units, sink, window)
    full = _full(unit_scores, units, unit_value, len(mass))
    seq = int(batches[0]["input_ids"].shape[1])
    retrieval, period = retrieval_scores(model, units, sink, window, seq, batches[0]["input_ids"].device)
    lost = [[max(m, r) for m, r in zip(ms, rs)] for ms, rs in zip(mass, retrieval)]
    windowed = [[f * (1.0 - m) for f, m in zip(fs, ms)] for fs, ms in zip(full, lost)]
    return full, windowed, {"mass_beyond_window": mass, "retrieval": retrieval, "retrieval_period": period}


def check_retrieval(settings, block_size: int | None) -> None:
    """Refuse, before any work, blocks too short for two copies of the retrieval sequence."""
    retrieval_period(block_size, settings.sink, settings.window)
