"""A causal LM's next-token loss without its (B, T, vocab) logits: the output head run on chunks of
positions, each chunk's logits recomputed in the backward pass (activation checkpointing).

Why: the gradient metrics (Fisher, Taylor, L0 gates) backpropagate the calibration loss. With the
full logits, a 4096-token block of Gemma 3 (262,144 tokens of vocabulary) holds 4.3 GB of float32
logits, as much again for their log-softmax and for their gradient: Gemma-3-270M's Fisher pass was
killed for memory at 17-21 GB on a 23 GB machine (experiments/llm_kv_modes, README.md). Chunked,
one chunk's logits (at most `CHUNK_ELEMENTS` values) exist at a time.

The loss is the same function of the same numbers (a sum of per-token cross-entropies), so it only
applies where the model's logits are its output head on its decoder's last hidden state, with
nothing after (transformers' `logits_to_keep` path). That is checked on every call: the model runs
with `logits_to_keep=1` and its last position's logits must equal the head on the captured hidden
state; a model that post-processes its logits (Gemma 2's soft-capping, Cohere's and Granite's
scaling) or does not take `logits_to_keep` falls back to the full logits (`None` here)."""
from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

# at most this many logits per chunk (float32: 256 MB); batches with fewer logits run whole
CHUNK_ELEMENTS = 2 ** 26


def chunked_token_loss(model: nn.Module, inputs: dict, targets: torch.Tensor,
                       chunk_elements: int | None = None) -> torch.Tensor | None:
    """(B, T-1) next-token cross-entropy (0 where `targets` is -100) of `model` on `inputs`, the
    output head run on chunks of at most `chunk_elements` logits; None when the batch's logits fit
    one chunk or the model's logits are not its head on its decoder's output (module docstring)."""
    chunk_elements = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    ids = inputs["input_ids"]  # (B, T)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = getattr(head, "out_features", None)
    if (vocab is None or ids.numel() * vocab <= chunk_elements or not hasattr(model, "get_decoder")
            or "logits_to_keep" not in inspect.signature(model.forward).parameters):
        return None
    hidden = _hidden_and_check(model, head, inputs)
    if hidden is None:
        return None
    hidden = hidden[:, :-1]  # (B, T-1, D): position t predicts token t+1
    step = max(1, chunk_elements // (ids.shape[0] * vocab))
    losses = [checkpoint(_chunk_loss, head, hidden[:, i:i + step], targets[:, i:i + step], use_reentrant=False)
              for i in range(0, hidden.shape[1], step)]
    return torch.cat(losses, dim=1)  # (B, T-1)


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # (B, C, V)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)  # (B, C)


def _hidden_and_check(model: nn.Module, head: nn.Module, inputs: dict) -> torch.Tensor | None:
    """The decoder's last hidden state (B, T, D), from a forward computing one position's logits;
    None (logged once per model class) when the head on it is not the model's logits."""
    captured = {}

    def grab(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = model.get_decoder().register_forward_hook(grab)
    try:
        last = model(**inputs, use_cache=False, logits_to_keep=1).logits  # (B, 1, V)
    finally:
        handle.remove()
    hidden = captured.get("hidden")
    if hidden is None or hidden.shape[:2] != inputs["input_ids"].shape:
        return _fallback(model, "its decoder's output is not a (B, T, D) hidden state")
    with torch.no_grad():
        mine = head(hidden[:, -1:].detach()).float()
        theirs = last.detach().float()
        if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=0,
                                                            atol=1e-3 * float(theirs.abs().max().clamp_min(1.0))):
            return _fallback(model, "its logits are not its output head on its decoder's last hidden state "
                                    "(soft-capped or scaled logits)")
    return hidden


_WARNED: set[str] = set()


def _fallback(model: nn.Module, why: str) -> None:
    name = type(model).__name__
    if name not in _WARNED:
        _WARNED.add(name)
        log.info("%s: the loss runs on the full (B, T, vocab) logits: %s", name, why)
    return None
