"""Learned stochastic head gates: the Hard-Concrete distribution (Louizos et al. 2018), as used
by Voita et al. 2019 to learn which heads a fine-tuned model can do without.

Each (layer, head) has a gate z in [0, 1] drawn as
    s = sigmoid((log u - log(1 - u) + log_alpha) / beta),  u ~ U(0, 1)
    z = clamp(s * (r - l) + l, 0, 1)
with beta = 2/3 and stretch (l, r) = (-0.1, 1.1), so z is exactly 0 or 1 with non-zero
probability and still differentiable in log_alpha. The expected L0 norm (the expected number
of open gates) is sum P(z != 0) = sum sigmoid(log_alpha - beta * log(-l / r)); adding it to
the loss with a weight pushes gates shut. At evaluation the gate is deterministic:
clamp(sigmoid(log_alpha) * (r - l) + l, 0, 1).

The gates multiply on top of a HeadMask (`HeadMask.stochastic`); they are indexed in the
original head numbering like the mask.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

INIT_LOG_ALPHA = 3.0  # P(open) ~ 0.99 and deterministic gates exactly 1: the model starts unchanged


class HardConcreteGates(nn.Module):
    def __init__(self, num_layers: int, num_heads: int, beta: float = 2 / 3,
                 stretch: tuple[float, float] = (-0.1, 1.1), init_log_alpha: float = INIT_LOG_ALPHA):
        super().__init__()
        low, high = stretch
        if not (low < 0 and high > 1):
            raise ValueError(f"stretch={stretch!r} must satisfy low < 0 < 1 < high")
        self.log_alpha = nn.Parameter(torch.full((num_layers, num_heads), float(init_log_alpha)))
        self.beta, self.low, self.high = beta, low, high
        self._generator: torch.Generator | None = None
        self._force_sample = False

    def open_probability(self) -> torch.Tensor:
        """(layers, heads) P(z != 0): the gates' learned head importance."""
        return torch.sigmoid(self.log_alpha - self.beta * math.log(-self.low / self.high))

    def expected_l0(self) -> torch.Tensor:
        """Expected number of open gates (differentiable)."""
        return self.open_probability().sum()

    def gate(self, layer: int, heads: list[int], sample: bool) -> torch.Tensor:
        """(h,) gates of `heads` (original ids) of `layer`: a fresh sample when `sample` (or inside
        `sampling()`), else the deterministic test-time gate."""
        log_alpha = self.log_alpha[layer, heads]  # (h,)
        if sample or self._force_sample:
            u = torch.rand(log_alpha.shape, generator=self._generator, device=log_alpha.device)
            u = u.clamp(1e-6, 1 - 1e-6)
            s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / self.beta)
        else:
            s = torch.sigmoid(log_alpha)
        return self._stretch(s)

    @torch.no_grad()
    def deterministic(self) -> torch.Tensor:
        """(layers, heads) test-time gates: what evaluation multiplies each head's output by."""
        return self._stretch(torch.sigmoid(self.log_alpha))

    def _stretch(self, s: torch.Tensor) -> torch.Tensor:
        """Stretch s in (0, 1) to (low, high) and clip to [0, 1]: the gate."""
        return (s * (self.high - self.low) + self.low).clamp(0.0, 1.0)

    @contextmanager
    def sampling(self, generator: torch.Generator | None = None) -> Iterator[None]:
        """Sample gates even while the model is in eval mode (training gates on a frozen model)."""
        self._force_sample, self._generator = True, generator
        try:
            yield
        finally:
            self._force_sample, self._generator = False, None
