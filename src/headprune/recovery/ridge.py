"""One layer's ridge problem of the output-projection refit (`refit.py`), accumulated over
calibration batches.

With c_n (F,) the kept heads' concatenated contexts of token n (F = kept heads x head_dim),
y_n (E,) the target and W0 (F, E) the output projection's current columns of those heads
(transposed), the refit minimises over W (F, E) and a bias b (E,)

    sum_n || c_n W + b - y_n ||^2 + lambda || W - W0 ||_F^2.

Everything it needs is a sum over tokens, so batches are added one at a time and memory does not
grow with the calibration set: G = sum c c^T (F, F), R = sum c y^T (F, E), the context sum s_c
(F,), the target sum s_y (E,), ||y||^2 and the token count N. The best bias for a W is the mean
residual b = (s_y - W^T s_c) / N; putting it back leaves the centred system

    (G - s_c s_c^T / N + lambda I) W = R - s_c s_y^T / N + lambda W0,

solved by Cholesky in float64, lambda = damp x mean(diag) of the centred G. Without the bias the
bias stays the reference b0 and the system is (G + lambda I) W = R - s_c b0^T + lambda W0.

Per-head scales (least-squares mask tuning, `normal_equations.py`) are the block-diagonal special
case W_h = m_h W0_h, so `scales_equations` rebuilds that problem from the same sums: a refit can
be compared with (and fall back to) the scales fit on exactly the same tokens.
"""
from __future__ import annotations

import torch

from headprune.distributed import all_reduce_sum
from headprune.recovery.normal_equations import NormalEquations


class RidgeSums:
    """The sums of one layer's refit problem (module docstring), float64 on `device`."""

    def __init__(self, features: int, hidden: int, device: torch.device | str = "cpu"):
        f64 = dict(dtype=torch.float64, device=device)
        self.gram = torch.zeros(features, features, **f64)  # (F, F)
        self.cross = torch.zeros(features, hidden, **f64)  # (F, E)
        self.context_sum = torch.zeros(features, **f64)  # (F,)
        self.target_sum = torch.zeros(hidden, **f64)  # (E,)
        self.target_sq = torch.zeros((), **f64)
        self.tokens = torch.zeros((), **f64)

    def parts(self) -> list[torch.Tensor]:
        return [self.gram, self.cross, self.context_sum, self.target_sum, self.target_sq, self.tokens]

    @torch.no_grad()
    def add(self, contexts: torch.Tensor, target: torch.Tensor) -> None:
        """Add tokens: `contexts` (N, F), `target` (N, E)."""
        c, y = contexts.double(), target.double()
        self.gram += c.T @ c
        self.cross += c.T @ y
        self.context_sum += c.sum(0)
        self.target_sum += y.sum(0)
        self.target_sq += y.pow(2).sum()
        self.tokens += y.shape[0]

    def merged(self, other: "RidgeSums") -> "RidgeSums":
        """The sums over both token sets."""
        out = RidgeSums(*self.cross.shape, device=self.gram.device)
        for mine, theirs, total in zip(self.parts(), other.parts(), out.parts()):
            total.copy_(mine + theirs)
        return out

    def all_reduce(self) -> None:
        """Data parallel: sum every rank's shard so that every rank solves the same system."""
        parts = self.parts()
        total = all_reduce_sum(torch.cat([p.flatten() for p in parts]))
        offset = 0
        for p in parts:
            p.copy_(total[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def error(self, weight: torch.Tensor, bias: torch.Tensor) -> float:
        """sum_n || c_n W + b - y_n ||^2 for W (F, E) and b (E,)."""
        w, b = weight.to(self.gram), bias.to(self.gram)
        return float((w * (self.gram @ w)).sum() - 2 * (w * self.cross).sum() + self.target_sq
                     + 2 * b @ (w.T @ self.context_sum) - 2 * b @ self.target_sum + self.tokens * (b @ b))

    def baseline(self, reference_bias: torch.Tensor) -> float:
        """||y - b0||^2: what errors are relative to (the error with no head at all)."""
        return max(self.error(torch.zeros_like(self.cross), reference_bias), 1e-30)

    def solve(self, start: torch.Tensor, reference_bias: torch.Tensor, damp: float,
              fit_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(W (F, E), b (E,), lambda): the ridge solution damped toward `start` (W0) by
        lambda = damp x mean(diag) of the (centred) Gram matrix; b is the best bias for W, or
        `reference_bias` when not `fit_bias`. A Gram matrix that is singular at lambda = 0 gets
        1e-10 x its mean diagonal (Cholesky needs it positive definite)."""
        n = max(float(self.tokens), 1.0)
        w0, b0 = start.to(self.gram), reference_bias.to(self.gram)
        if fit_bias:
            gram = self.gram - torch.outer(self.context_sum, self.context_sum) / n
            rhs = self.cross - torch.outer(self.context_sum, self.target_sum) / n
        else:
            gram, rhs = self.gram, self.cross - torch.outer(self.context_sum, b0)
        scale = float(gram.diagonal().mean()) if gram.numel() else 0.0
        lam = damp * scale
        eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        factor, info = torch.linalg.cholesky_ex(gram + lam * eye)
        if int(info) != 0:
            factor = torch.linalg.cholesky(gram + (lam + 1e-10 * max(scale, 1e-30)) * eye)
        w = torch.cholesky_solve(rhs + lam * w0, factor)
        b = (self.target_sum - w.T @ self.context_sum) / n if fit_bias else b0
        return w, b, lam


def scales_equations(sums: RidgeSums, start: torch.Tensor, heads: int) -> NormalEquations:
    """Least-squares mask tuning's problem (`NormalEquations`: one scale per head on c_nh = x_nh
    W0_h) on the same tokens and target as `sums`, built from its sums. `start` (F, E) holds the
    `heads` heads' W0_h as consecutive blocks of F / heads rows."""
    d = start.shape[0] // heads
    w = start.to(sums.gram).view(heads, d, -1)  # (h, D, E)
    eq = NormalEquations(heads, w.shape[-1], sums.gram.device)
    g = sums.gram.view(heads, d, heads, d)
    eq.gram = torch.einsum("hde,hdgf,gfe->hg", w, g, w)  # tr(W_h^T G_hg W_g)
    eq.cross = (w * sums.cross.view(heads, d, -1)).sum((1, 2))
    eq.head_sum = torch.einsum("hd,hde->he", sums.context_sum.view(heads, d), w)
    eq.target_sum, eq.target_sq, eq.tokens = sums.target_sum.clone(), sums.target_sq.clone(), sums.tokens.clone()
    return eq


__all__ = ["RidgeSums", "scales_equations"]
