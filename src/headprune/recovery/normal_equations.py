"""One layer's least-squares problem of mask tuning, accumulated over calibration batches.

With c_nh = W_h x_nh (E,) head h's contribution to token n's output-projection output and y_n
(E,) the target, the scales m (h,) and the bias b (E,) minimise

    sum_n || sum_h m_h c_nh + b - y_n ||^2 + lambda || m - 1 ||^2.

Everything the solution needs is a sum over tokens, so batches are added one at a time and
nothing grows with the calibration set: G = sum c c^T (h, h), r = sum c . y (h,), the head sums
S = sum_n c_nh (h, E), s = sum_n y_n (E,), ||y||^2 and the token count N. For a given m the best
bias is the mean residual b = (s - S^T m) / N; putting it back leaves the centred system

    (G - S S^T / N + lambda I) m = r - S s / N + lambda 1,

with lambda = damp x mean(diag) of the centred Gram matrix. Without the bias term, b stays the
reference bias b0 and the system is (G + lambda I) m = r - S b0 + lambda 1.
"""
from __future__ import annotations

import torch

from headprune.distributed import all_reduce_sum

CHUNK = 1 << 22  # tokens x heads x features of one contribution chunk (16 MB in float32)


class NormalEquations:
    """The sums of one layer's problem (module docstring), in float64 on `device`."""

    def __init__(self, heads: int, features: int, device: torch.device | str = "cpu"):
        f64 = dict(dtype=torch.float64, device=device)
        self.gram = torch.zeros(heads, heads, **f64)  # (h, h)
        self.cross = torch.zeros(heads, **f64)  # (h,)
        self.head_sum = torch.zeros(heads, features, **f64)  # (h, E)
        self.target_sum = torch.zeros(features, **f64)  # (E,)
        self.target_sq = torch.zeros((), **f64)
        self.tokens = torch.zeros((), **f64)

    @torch.no_grad()
    def add(self, contexts: torch.Tensor | None, weights: torch.Tensor | None, target: torch.Tensor) -> None:
        """Add tokens: `contexts` (N, h, D) the heads' contexts, `weights` (h, D, E) their
        output-projection columns (both None without heads), `target` (N, E)."""
        step = max(1, CHUNK // (weights.shape[0] * weights.shape[2] if weights is not None else 1))
        for start in range(0, target.shape[0], step):
            y = target[start:start + step].float()  # (n, E)
            if weights is not None:
                c = torch.einsum("nhd,hde->nhe", contexts[start:start + step].float(), weights.float())  # (n, h, E)
                self.gram += torch.einsum("nhe,nge->hg", c, c).double()
                self.cross += torch.einsum("nhe,ne->h", c, y).double()
                self.head_sum += c.sum(0).double()
            self.target_sum += y.sum(0).double()
            self.target_sq += y.double().pow(2).sum()
            self.tokens += y.shape[0]

    def all_reduce(self) -> None:
        """Data parallel: every rank added its shard of the calibration slice; sum the equations
        so that every rank solves the same system (no-op in one process)."""
        parts = [self.gram, self.cross, self.head_sum, self.target_sum, self.target_sq, self.tokens]
        total = all_reduce_sum(torch.cat([p.flatten() for p in parts]))
        offset = 0
        for p in parts:
            p.copy_(total[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def error(self, m: torch.Tensor, b: torch.Tensor) -> float:
        """sum_n || C_n m + b - y_n ||^2 for scales m (h,) and bias b (E,)."""
        m, b = m.to(self.gram), b.to(self.gram)
        return float(m @ self.gram @ m - 2 * m @ self.cross + self.target_sq + 2 * m @ (self.head_sum @ b)
                     - 2 * b @ self.target_sum + self.tokens * (b @ b))

    def solve(self, reference_bias: torch.Tensor, scale_range=(0.5, 2.0), damp: float = 0.01,
              fit_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(scales (h,), bias (E,), info): the damped least-squares scales clamped to
        `scale_range`, with the best bias for them (or `reference_bias` when not `fit_bias`);
        ones and the reference bias when those reconstruct better. info: errors relative to
        the target without the reference bias, ||y - b0||^2, with ones (`error_ones`) and tuned
        (`error_tuned`), and `kept_ones`."""
        h, n = self.gram.shape[0], max(float(self.tokens), 1.0)
        b0 = reference_bias.to(self.gram)
        ones = torch.ones(h, dtype=torch.float64, device=self.gram.device)
        if fit_bias:
            gram = self.gram - self.head_sum @ self.head_sum.T / n  # (h, h)
            cross = self.cross - self.head_sum @ self.target_sum / n  # (h,)
        else:
            gram, cross = self.gram, self.cross - self.head_sum @ b0
        lam = damp * float(gram.diagonal().mean()) if h else 0.0
        m = torch.linalg.solve(gram + lam * torch.eye(h, dtype=torch.float64, device=gram.device), cross + lam * ones)
        m = m.clamp(*scale_range)
        b = (self.target_sum - self.head_sum.T @ m) / n if fit_bias else b0
        scale = max(self.error(torch.zeros_like(ones), b0), 1e-30)  # ||y - b0||^2
        e_ones, e_tuned = self.error(ones, b0) / scale, self.error(m, b) / scale
        keep_ones = not e_tuned < e_ones
        info = {"error_ones": e_ones, "error_tuned": e_tuned, "kept_ones": keep_ones}
        return (ones, b0, info) if keep_ones else (m, b, info)


def solve_scales(gram: torch.Tensor, cross: torch.Tensor, target_sq: float, scale_range=(0.5, 2.0),
                 damp: float = 0.01) -> tuple[torch.Tensor, dict]:
    """Scales m (h,) minimising ||A m - y||^2 + lambda ||m - 1||^2 given G = A^T A (h, h),
    r = A^T y (h,) and ||y||^2, with no bias term, clamped to `scale_range`; all-ones when that
    reconstructs better. Returns (m, {"error_ones", "error_tuned", "kept_ones"}) with errors
    ||A m - y||^2 / ||y||^2."""
    eq = NormalEquations(gram.shape[0], 1)
    eq.gram, eq.cross, eq.target_sq = gram.double(), cross.double(), torch.tensor(float(target_sq), dtype=torch.float64)
    m, _, info = eq.solve(torch.zeros(1), scale_range, damp, fit_bias=False)
    return m, info
