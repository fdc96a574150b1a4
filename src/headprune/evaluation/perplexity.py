"""Perplexity of a causal LM on held-out text, in non-overlapping windows of `seq` tokens.

Why fixed windows: perplexity depends on how much context each prediction sees, so numbers at
seq 128 and seq 2048 (both used in the papers) are not comparable; every result names its
`seq`. The text is tokenized once and cut into the same windows for every model and arm
(`Windows.cut`, the one windowing: the first `max_tokens` tokens of the text, or of its
held-out part, `text_windows`), so two perplexities are always over the same tokens.

BOS: with `bos=True` the tokenizer's BOS token is prepended to every window, and all `seq`
tokens of the window are scored (the first one given BOS alone); with `bos=False` the window
is fed as is and its first token, which has no context, is not scored (`seq - 1` targets).
The result records which ("bos") and how many predictions the loss averages over ("targets").

One implementation: `perplexity` runs `CausalLM.evaluate` (headprune.tasks; what `val` runs on the data
module's validation blocks, which are `bos=False` windows of data.block_size from the held-out
part's first token) on the windows' inputs, so `val` and `evaluation` differ only in the windows
and the BOS rule each record names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from headprune.data.language_model import held_out_start, tokenize_corpus
from headprune.tasks import CAUSAL_LM, check_model_task


@dataclass(frozen=True)
class Windows:
    """The token windows one perplexity is measured on: `ids` (W, seq), text tokens only;
    `bos_token_id` is prepended to each window at evaluation time (None: nothing is)."""

    ids: torch.Tensor  # (W, seq)
    seq: int
    bos_token_id: int | None = None

    @property
    def bos(self) -> bool:
        return self.bos_token_id is not None

    @classmethod
    def cut(cls, ids: torch.Tensor, seq: int, bos_token_id: int | None = None,
            max_tokens: int | None = None) -> "Windows":
        """The first `max_tokens` of `ids` (N,) (None: all) cut into non-overlapping `seq`-token
        windows, the incomplete tail dropped: the one windowing of every perplexity."""
        if not isinstance(seq, int) or seq < 2:
            raise ValueError(f"seq={seq!r} must be an integer >= 2 (one input and one target)")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < seq):
            raise ValueError(f"max_tokens={max_tokens!r} must be None or an integer >= seq ({seq})")
        ids = ids[:max_tokens] if max_tokens is not None else ids
        n_windows = len(ids) // seq
        if n_windows == 0:
            raise ValueError(f"the text has {len(ids)} tokens (max_tokens={max_tokens}), less than one window of "
                             f"seq={seq}")
        return cls(ids[:n_windows * seq].view(n_windows, seq), seq, bos_token_id)

    @property
    def targets(self) -> int:
        """How many next-token predictions are scored: every token with BOS, all but each window's
        first without."""
        return self.ids.numel() if self.bos else self.ids.shape[0] * (self.seq - 1)

    def inputs(self) -> torch.Tensor:
        """(W, seq + 1) with BOS first, else (W, seq): what the model is fed."""
        if not self.bos:
            return self.ids
        bos = torch.full((self.ids.shape[0], 1), self.bos_token_id, dtype=self.ids.dtype)
        return torch.cat([bos, self.ids], dim=1)


def text_windows(tokenizer, text: str, seq: int, max_tokens: int | None = None, bos: bool = False,
                 validation_share: float | None = None) -> Windows:
    """Tokenize `text` once (no special tokens) and cut it with `Windows.cut`.

    `validation_share`: take the windows from the held-out part of the tokens, from
    `held_out_start` (as `TextLMDataModule` splits a corpus; None: from token 0).
    `max_tokens`: use only the first `max_tokens` tokens from there (the fixed budget; None:
    all). `bos`: prepend the tokenizer's `bos_token_id` to every window (see the module doc).
    """
    if validation_share is not None and not 0 < validation_share < 1:
        raise ValueError(f"validation_share={validation_share!r} must be None or in (0, 1)")
    bos_token_id = getattr(tokenizer, "bos_token_id", None) if bos else None
    if bos and bos_token_id is None:
        raise ValueError("bos=True but the tokenizer has no bos_token_id; allowed: bos=False")
    ids = tokenize_corpus(tokenizer, text)  # (N,)
    if validation_share is not None:
        ids = ids[held_out_start(len(ids), validation_share):]
    return Windows.cut(ids, seq, bos_token_id, max_tokens)


def perplexity(model: nn.Module, windows: Windows, batch_size: int = 8) -> dict:
    """Mean next-token loss over every window and its exponential, in batches of windows.

    Returns {"seq", "windows", "tokens" (text tokens covered, windows * seq), "targets"
    (predictions scored), "bos", "loss", "ppl"}. The model is evaluated in eval mode without
    gradients; its training flag is restored afterwards.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1")
    check_model_task(model, CAUSAL_LM, "perplexity's task")
    device = next(model.parameters()).device
    val = CAUSAL_LM.evaluate(model, [{"input_ids": batch} for batch in windows.inputs().split(batch_size)], device)
    return {"seq": windows.seq, "windows": windows.ids.shape[0], "tokens": windows.ids.numel(),
            "targets": windows.targets, "bos": windows.bos, **val}
