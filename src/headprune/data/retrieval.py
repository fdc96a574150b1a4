"""Synthetic retrieval blocks (`kv_modes=retrieval`, `kv_modes.retrieval_blocks`): random tokens
repeating with a period longer than the sinks + window a windowed KV unit keeps, so the earlier copy
of each repeated token lies beyond every window. Natural text rarely needs a token from thousands
back; these blocks ask for exactly that (a copy from far back, as passkey retrieval does)."""
from __future__ import annotations

import torch


def retrieval_period(seq: int, sink: int, window: int) -> int:
    """The period of the repeated random sequence: a quarter of `seq` (three copies to look back
    on) when that exceeds sink + window, else half; refused when even half leaves every earlier
    copy inside the window."""
    for period in (seq // 4, seq // 2):
        if period > sink + window:
            return period
    raise ValueError(f"kv_modes=retrieval: a {seq}-token block cannot hold two copies of a sequence longer than "
                     f"sink + window = {sink + window} tokens (a window would see the earlier copy); allowed: "
                     f"data.block_size > 2 x (kv_modes.sink + kv_modes.window)")


def repeated_random_tokens(config, seq: int, period: int, seed: int = 0) -> torch.Tensor:
    """(1, seq) ids: `period` random ids (seeded; the config's special ids left out) repeated."""
    special = {getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    special = {i for s in special for i in (s if isinstance(s, (list, tuple)) else [s]) if i is not None}
    allowed = torch.tensor([i for i in range(config.vocab_size) if i not in special])
    pick = torch.randint(len(allowed), (period,), generator=torch.Generator().manual_seed(seed))
    return allowed[pick].repeat(seq // period + 1)[:seq][None]


def retrieval_batches(config, seq: int, sink: int, window: int, n: int, device) -> list[dict]:
    """`n` synthetic retrieval blocks of `seq` tokens (seeds 1..n): random tokens repeating every
    `retrieval_period` tokens, labels -100 over the first copy, so a loss scores only tokens whose
    earlier copy lies beyond sink + window (past the sinks once the period exceeds them)."""
    if n == 0:
        return []
    period = retrieval_period(seq, sink, window)
    out = []
    for seed in range(1, n + 1):
        ids = repeated_random_tokens(config, seq, period, seed).to(device)  # (1, seq)
        labels = ids.clone()
        labels[:, :period] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out
