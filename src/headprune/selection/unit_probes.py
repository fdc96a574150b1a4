"""Single-unit probes (`kv_modes=measured`, issue 54): the calibration loss rise of each KV unit
alone removed and alone windowed, every other unit as the mask has it, measured fast.

What a probe costs: a change to unit u of layer l changes the input of every later layer, so
blocks l..L-1 and the head run again for each probe, exactly; the blocks before l do not change.
In block forwards over the calibration tokens T, a layer of U units probed in M modes costs
U x M x (L - l) blocks and U x M heads, so the whole measurement costs about
U x M x L^2 / 2 blocks x T tokens (probes x layers x tokens, times the depth a probe reruns).

What is not repeated:

- the blocks before layer l: each calibration block's hidden states are carried through the
  unchanged model once, layer by layer (`recovery.blockwise.capture` / `run_block`, as
  `selection.measured.Probe.carried` carries them), and every probe of layer l starts from them;
- the blocks after layer l: the probes of one layer run together, their hidden states stacked
  as rows of one batch (`PROBE_TOKENS` tokens a call), the block arguments repeated to match;
- the head and the loss: computed over token chunks (`HEAD_TOKENS`) with a contiguous
  cross-entropy, never the (T, vocabulary) logits of a long block at once (at 4096 tokens on
  SmolLM2 the whole-block logits and `Task.loss`'s class-major cross-entropy cost as much as
  ten blocks), and skipped where no token is scored (the first copy of a retrieval block).

A layer that slides its own window (Gemma 3's sliding layers, Mistral's `sliding_window`:
`heads.sliding`) is never windowed again (`costs.tables.mode_options` offers its units full or
removed), so its units are not probed windowed: their window rise is 0.

The loss is the causal LM's per-token mean over the next-token targets of every block
(`tasks.target_weights`), as `selection.measured.Probe.loss` reads it; the rises equal the
whole-model measurement's to float rounding (tests/test_kv_modes_pipeline.py keeps that
measurement as the reference).
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from headprune.heads.mask import HeadMask
from headprune.heads.sliding import native_windows
from headprune.heads.windows import KV_LAYOUT_ATTR, REMOVED, WINDOW, KVLayout, KVWindows, FULL
from headprune.recovery.blockwise import BlockInputs, capture, eval_mode, run_block
from headprune.selection.measured import start_at

log = logging.getLogger(__name__)
PROBE_TOKENS = 32768  # tokens (probes x rows x T) the blocks after a probed layer run on in one call
HEAD_TOKENS = 1024  # tokens per head call: logits (rows, HEAD_TOKENS, vocabulary) at a time
MODES = (REMOVED, WINDOW)


def single_unit(n_layers: int, n_units: int, layer: int, unit: int, sink: int, window: int) -> KVLayout:
    """Every unit full but unit `unit` of layer `layer`, windowed."""
    modes = [[FULL] * n_units for _ in range(n_layers)]
    modes[layer][unit] = WINDOW
    return KVLayout(tuple(tuple(m) for m in modes), sink, window)


def stacked(value, rows: int, copies: int):
    """`value` (a block argument: tensor, tuple of them, or anything else) with every tensor whose
    first dimension is the batch's `rows` (and that has more than one dimension) repeated
    `copies` times along it: the arguments of `copies` stacked copies of the batch."""
    if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[0] == rows and copies > 1:
        return value.repeat(copies, *([1] * (value.dim() - 1)))
    if isinstance(value, tuple):
        return tuple(stacked(v, rows, copies) for v in value)
    return value


def stacked_inputs(inputs: BlockInputs, copies: int) -> BlockInputs:
    """`inputs` for `copies` copies of the batch stacked along the rows (`stacked`)."""
    rows = inputs.hidden.shape[0]
    return BlockInputs(stacked(inputs.hidden, rows, copies),
                       [{k: stacked(v, rows, copies) for k, v in kwargs.items()} for kwargs in inputs.kwargs])


def next_targets(batch: dict) -> torch.Tensor:
    """(B, T-1) the token each position predicts, -100 where it scores nothing (unlabelled, or
    padding: `tasks.target_weights`)."""
    targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
    if "attention_mask" in batch:
        targets = targets.masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
    return targets


@torch.no_grad()
def head_losses(model: nn.Module, batch: dict, hidden: torch.Tensor, copies: int) -> list[float]:
    """Per copy, the summed next-token cross-entropy of the model's head on `hidden` (copies x B,
    T, E), the last block's output for `copies` stacked copies of `batch`: the model's forward
    with every block passing its chunk of `hidden` through (`measured.start_at`) applies what
    follows the blocks (final norm, output projection, the family's logit transforms), one
    chunk of `HEAD_TOKENS` positions at a time; chunks without a scored target are skipped."""
    ids = batch["input_ids"]  # (B, T)
    targets = next_targets(batch)  # (B, T-1)
    n_layers = len(_blocks(model))
    totals = torch.zeros(hidden.shape[0], dtype=torch.float64, device=hidden.device)
    for first in range(0, targets.shape[1], HEAD_TOKENS):
        chunk = targets[:, first:first + HEAD_TOKENS]  # (B, C)
        if bool((chunk == -100).all()):
            continue
        last = first + chunk.shape[1]
        with start_at(model, n_layers, hidden[:, first:last]):
            logits = model(input_ids=stacked(ids[:, first:last], ids.shape[0], copies), use_cache=False).logits
        wanted = stacked(chunk, ids.shape[0], copies)  # (copies x B, C)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), wanted.flatten(), ignore_index=-100,
                                 reduction="none").view(wanted.shape)  # (copies x B, C)
        totals += losses.double().sum(1)
    return [float(t) for t in totals.view(copies, -1).sum(1)]


def _blocks(model: nn.Module):
    from headprune.heads.adapters import get_adapter

    return get_adapter(model).blocks(model)


@torch.no_grad()
def tail_losses(model: nn.Module, inputs: BlockInputs, batch: dict, start: int,
                outputs: list[torch.Tensor]) -> list[float]:
    """Per entry of `outputs` (each (B, T, E), a version of block `start - 1`'s output), the
    summed next-token loss after blocks `start`..L-1 and the head: as many entries as
    `PROBE_TOKENS` allows run as the rows of one batch."""
    per_call = max(1, PROBE_TOKENS // max(outputs[0].shape[:2].numel(), 1))
    n_layers = len(_blocks(model))
    sums: list[float] = []
    prepared: dict[int, BlockInputs] = {}
    for first in range(0, len(outputs), per_call):
        group = outputs[first:first + per_call]
        copies = len(group)
        if copies not in prepared:
            prepared[copies] = stacked_inputs(inputs, copies)
        rows = prepared[copies]
        hidden = torch.cat(group)  # (copies x B, T, E)
        for layer in range(start, n_layers):
            hidden = run_block(model, layer, rows, hidden)
        sums += head_losses(model, batch, hidden, copies)
    return sums


@torch.no_grad()
def probed_output(model: nn.Module, mask: HeadMask, inputs: BlockInputs, hidden: torch.Tensor, layer: int,
                  heads: list[int], unit: int, n_units: int, mode: str, sink: int, window: int) -> torch.Tensor:
    """Block `layer`'s output (B, T, E) on `hidden` with unit `unit` (query heads `heads`) alone
    removed (its gates zeroed) or windowed (`KVWindows` of that unit alone)."""
    if mode == REMOVED:
        trial = mask.mask.detach().clone()
        trial[layer, heads] = 0.0
        with mask.override(trial):
            return run_block(model, layer, inputs, hidden)
    windows = KVWindows(single_unit(mask.num_layers, n_units, layer, unit, sink, window)).attach(model)
    try:
        return run_block(model, layer, inputs, hidden)
    finally:
        windows.detach()


@torch.no_grad()
def unit_rises(model: nn.Module, mask: HeadMask, batches: list[dict], units: list[list[int]], sink: int,
               window: int, modes: tuple[str, ...] = MODES, layers=None) -> tuple[dict[str, list[list[float]]], float]:
    """({mode: rise[l][u]}, base loss): per layer and unit, the mean next-token loss over
    `batches` (causal LM) with that unit alone in `mode` (removed / window), minus the loss with
    every unit as `mask` has it (module docstring). `layers`: the layers probed (None: every
    one); the others' rises are NaN (a benchmark of part of the measurement). A natively sliding
    layer's units are not probed windowed (module docstring): their window rise is 0."""
    if getattr(model, KV_LAYOUT_ATTR, None) is not None:
        raise ValueError("kv_modes=measured measures a model without windows; this one has a KV layout attached")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unit probes measure modes {', '.join(MODES)}; got {bad}")
    n_layers, n_units = mask.num_layers, len(units)
    sums = {mode: [[0.0] * n_units for _ in range(n_layers)] for mode in modes}
    base_sum, count = 0.0, 0.0
    sliding = [native is not None for native in native_windows(model.config)]  # (L,): windows of its own
    probes = [(u, mode) for u in range(n_units) for mode in modes]
    with eval_mode(model):
        for i, batch in enumerate(batches):
            inputs = capture(model, batch)
            hidden = inputs.hidden  # (B, T, E) entering block 0, then each next block
            count += float((next_targets(batch) != -100).sum())
            for layer in range(n_layers):
                if layers is not None and layer not in layers:
                    hidden = run_block(model, layer, inputs, hidden)
                    continue
                began = time.perf_counter()
                here = [(u, mode) for u, mode in probes if not (sliding[layer] and mode == WINDOW)]
                outputs = [probed_output(model, mask, inputs, hidden, layer, units[u], u, n_units, mode, sink, window)
                           for u, mode in here]
                totals = tail_losses(model, inputs, batch, layer + 1, outputs) if here else []
                for (u, mode), total in zip(here, totals):
                    sums[mode][layer][u] += total
                hidden = run_block(model, layer, inputs, hidden)
                log.info("kv_modes=measured: block %d, layer %d: %d probes (%.1f s)", i, layer, len(here),
                         time.perf_counter() - began)
            base_sum += tail_losses(model, inputs, batch, n_layers, [hidden])[0]
    count = max(count, 1.0)
    base = base_sum / count

    def rise(total: float, layer: int, mode: str) -> float:
        if layers is not None and layer not in layers:
            return float("nan")
        return 0.0 if sliding[layer] and mode == WINDOW else total / count - base

    return {mode: [[rise(s, l, mode) for s in per_unit] for l, per_unit in enumerate(per_layer)]
            for mode, per_layer in sums.items()}, base
