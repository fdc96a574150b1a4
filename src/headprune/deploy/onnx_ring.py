"""The cache layer of a layer with windowed KV units inside the ONNX decode graph: the full units'
keys grow with the past, the windowed units' keys live in a fixed-size buffer of sink + window
entries (the ring), so a served model's cache for those units never grows.

Why not `heads.windows.WindowedCacheLayer` itself: its buffer grows to sink + window and then
writes one token in place, choices made on Python ints and tensor values, which torch.export
cannot trace with a dynamic past length. Here every step has one shape: the buffer (B, W, S, D),
S = sink + window, and its slots (B, S) enter as graph inputs (per row; unused entries at
`EMPTY_SLOT`, so no query sees them); the new tokens join them, the split attention call
(heads.windowed_attention) reads all S + T under the slots' mask, and the S entries each row
keeps (its sinks, counted from its first real token as the model's mask shows it, and its last
`window` tokens, unused ones filling what is left) leave as the present buffer. Which entry holds
which slot does not matter: the mask is built from the slots, so the buffer needs no order and
nothing moves but a gather of S entries per row. A left-padded row therefore keeps its own first
tokens as sinks, as PyTorch's `WindowedCacheLayer` does.
"""
from __future__ import annotations

import torch

from headprune.heads.windowed_attention import EMPTY_SLOT, HeadSplit
from headprune.heads.windows import WindowedCacheLayer


class RingCacheLayer(WindowedCacheLayer):
    """One layer's cache in the decode graph (module docstring): `keys` / `values` (B, F, P, D)
    every past token of the full KV heads (F may be 0: they still count the past), `window_keys`
    / `window_values` (B, W, S, D) the windowed KV heads' ring, `slots` (B, S) its entries' slots."""

    chunked = False  # one masked call over the ring and the new tokens: chunks loop over values

    def __init__(self, windowed: list[bool], sink: int, window: int, keys: torch.Tensor, values: torch.Tensor,
                 window_keys: torch.Tensor, window_values: torch.Tensor, slots: torch.Tensor):
        super().__init__(windowed, sink, window)
        self.device = keys.device
        self.heads = HeadSplit.of(self.windowed, self.device)
        self.full_heads, self.window_heads = self.heads.full, self.heads.window
        self.keys, self.values = keys, values  # (B, F, P, D)
        self.window_keys, self.window_values, self.slots = window_keys, window_values, slots  # (B, W, S, D), (B, S)
        self.length = keys.shape[-2]  # P: symbolic in the trace
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.armed:
            raise ValueError("the ONNX decode graph's windowed cache layer was written outside a forward its KVWindows "
                             "hook armed (attach the layout's KVWindows)")
        self.armed = False
        first, n_new = self.length, key_states.shape[-2]
        self.length = first + n_new
        full, window = self.heads.full_pick, self.heads.window_pick
        self.keys = torch.cat([self.keys, key_states[:, full]], dim=-2)  # (B, F, P + T, D)
        self.values = torch.cat([self.values, value_states[:, full]], dim=-2)
        new = torch.arange(n_new, device=self.device) + first  # (T,): the new tokens' slots
        keys = torch.cat([self.window_keys, key_states[:, window]], dim=-2)  # (B, W, S + T, D)
        values = torch.cat([self.window_values, value_states[:, window]], dim=-2)
        slots = torch.cat([self.slots, new.expand(keys.shape[0], -1)], dim=1)  # (B, S + T)
        self.step = (keys, values, slots, new)  # what the split call attends over, under the slots' mask
        start = 0 if self.first is None else self.first[:, None]  # (B, 1): each row's first real token
        keep = (slots < EMPTY_SLOT) & (slots >= start) & ((slots < start + self.sink) |
                                                         (slots >= self.length - self.window))  # (B, S + T)
        _, index = torch.where(keep, slots, -1).topk(self.sink + self.window, dim=1)  # (B, S): every kept entry
        gather = index[:, None, :, None]
        self.window_keys = keys.gather(2, gather.expand(*keys.shape[:2], -1, keys.shape[-1]))
        self.window_values = values.gather(2, gather.expand(*values.shape[:2], -1, values.shape[-1]))
        self.slots = torch.where(keep.gather(1, index), slots.gather(1, index), EMPTY_SLOT)
        return self.keys, self.values
