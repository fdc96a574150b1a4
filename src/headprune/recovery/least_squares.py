"""Mask tuning by least squares (Kwon et al. 2022): after heads are removed without retraining,
give each surviving head a real-valued scale so that every attention sub-layer's output is as
close as possible to the unpruned model's.

Layer by layer, first to last, on calibration examples from the training file: with x_h the
context of kept head h (the output projection's input, B x T x D per head) and W_h its columns of
the output projection, the pruned sub-layer outputs sum_h m_h W_h x_h + b. The dense model's
output at the same layer is y. The scales solve the damped least-squares problem

    min_m  sum over real tokens of || sum_h m_h W_h x_h + b - y ||^2  +  lambda || m - 1 ||^2,
    (G + lambda I) m = r + lambda 1,   G_hg = <W_h x_h, W_g x_g>,  r_h = <W_h x_h, y - b>,

with lambda = `damp` x mean(diag G), which keeps the solution near 1 where G is ill-conditioned.
The scales are clamped to `scale_range`, and a layer whose clamped scales would reconstruct worse
than all-ones keeps 1.0. Later layers are tuned on the inputs the tuned earlier layers give them.
The scales live in the HeadMask (a gate value other than 0 or 1); the export folds them into the
output-projection columns (`scale_heads`), so the exported model computes what was evaluated.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import ClassVar, List

import torch
from torch import nn

from headprune.distributed import all_reduce_sum
from headprune.heads.adapters import get_adapter, layer_heads
from headprune.heads.mask import HeadMask
from headprune.recovery.base import Recovery
from headprune.tasks import forward_logits, real_tokens, to_device

log = logging.getLogger(__name__)


@dataclass
class LeastSquares(Recovery):
    """`recovery=least_squares`: after each round, tune the surviving heads' scales against the
    unpruned model (`Pruner.dense`). Calibration examples are the scoring slice
    (`data.score_samples`, from the training file)."""

    scale_range: List[float] = field(default_factory=lambda: [0.5, 2.0])
    damp: float = 0.01

    needs_dense: ClassVar[bool] = True

    def __post_init__(self) -> None:
        low, high = (list(self.scale_range) + [None, None])[:2]
        if len(self.scale_range) != 2 or not 0 < low <= 1 <= high:
            raise ValueError(f"recovery.scale_range={list(self.scale_range)} must be [low, high] with 0 < low <= 1 <= "
                             "high (a scale of 0 would prune the head)")
        if self.damp < 0:
            raise ValueError(f"recovery.damp={self.damp!r} must be >= 0")

    def resume(self, pruner) -> None:
        raise ValueError("recovery=least_squares tunes each round against the unpruned model's outputs, which a resumed "
                         "run no longer has; start the run again (it trains nothing, so it is short)")

    def after_round(self, pruner, record: dict, loaders) -> None:
        """Tune, then record the tuning report and the tuned model's validation metrics."""
        start = time.perf_counter()
        report = tune_scales(pruner.model, pruner.mask, pruner.dense, loaders.score, self, pruner.max_batches)
        record["mask_tuning"] = {**report, "seconds": round(time.perf_counter() - start, 3)}
        if loaders.val is not None:
            record["val_after_mask_tuning"] = pruner.evaluate(loaders.val)
            log.info("round %d: least-squares mask tuning in %.1f s -> val %s", record["round"],
                     record["mask_tuning"]["seconds"], record["val_after_mask_tuning"])


def solve_scales(gram: torch.Tensor, cross: torch.Tensor, target_sq: float, scale_range=(0.5, 2.0),
                 damp: float = 0.01) -> tuple[torch.Tensor, dict]:
    """Scales m (h,) minimising ||A m - y||^2 + lambda ||m - 1||^2 given G = A^T A (h, h),
    r = A^T y (h,) and ||y||^2, clamped to `scale_range`; all-ones when that reconstructs better.
    Returns (m, {"error_ones", "error_tuned", "kept_ones"}) with errors ||A m - y||^2 / ||y||^2."""
    gram, cross = gram.double(), cross.double()
    h = gram.shape[0]
    ones = torch.ones(h, dtype=torch.float64)
    lam = damp * float(gram.diagonal().mean()) if h else 0.0
    m = torch.linalg.solve(gram + lam * torch.eye(h, dtype=torch.float64), cross + lam * ones)
    m = m.clamp(*scale_range)

    def error(v: torch.Tensor) -> float:
        return float(v @ gram @ v - 2 * v @ cross + target_sq) / max(target_sq, 1e-30)

    e_ones, e_tuned = error(ones), error(m)
    keep_ones = not e_tuned < e_ones
    return (ones if keep_ones else m), {"error_ones": e_ones, "error_tuned": e_tuned, "kept_ones": keep_ones}


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the layer being tuned has been seen."""


def tune_scales(model: nn.Module, mask: HeadMask, dense: nn.Module, loader, settings: LeastSquares,
                max_batches: int | None = None) -> dict:
    """Set `mask`'s gates of every layer's alive heads to their least-squares scales (module
    docstring), layer by layer. `dense`: the unpruned model (no HeadMask). Returns a report per
    layer: the scales and the relative reconstruction error with ones and with the scales."""
    adapter = get_adapter(model)
    device = mask.mask.device
    batches = [to_device(b, device) for i, b in enumerate(loader) if max_batches is None or i < max_batches]
    if not batches:
        raise ValueError("least-squares mask tuning got no calibration examples (data.score_samples=0?)")
    targets = _dense_outputs(dense, batches)  # per layer: (N_real_tokens, E)
    report = []
    was_training = model.training
    model.eval()
    try:
        for layer in range(mask.num_layers):
            kept = layer_heads(model, layer)
            alive = [h for h in kept if float(mask.mask[layer, h]) > 0]
            if not alive:
                report.append({"layer": layer, "heads": [], "scales": []})
                continue
            with torch.no_grad():
                mask.mask[layer, alive] = 1.0  # the contexts are collected ungated
            gram, cross, target_sq = _normal_equations(model, adapter, layer, kept, alive, batches, targets[layer])
            scales, info = solve_scales(gram, cross, target_sq, tuple(settings.scale_range), settings.damp)
            with torch.no_grad():
                mask.mask[layer, alive] = scales.to(mask.mask)
            report.append({"layer": layer, "heads": alive, "scales": [round(float(s), 6) for s in scales], **info})
    finally:
        model.train(was_training)
    return {"layers": report}


@torch.no_grad()
def _dense_outputs(dense: nn.Module, batches: list[dict]) -> list[torch.Tensor]:
    """Every layer's attention output projection output on the real tokens, (N, E) per layer."""
    adapter = get_adapter(dense)
    outs: list[list[torch.Tensor]] = [[] for _ in adapter.blocks(dense)]
    handles = []
    current: dict = {}
    for layer, block in enumerate(adapter.blocks(dense)):
        def keep(module, args, out, layer=layer):
            outs[layer].append(out[current["real"]].float().cpu())  # (N_b, E)
        handles.append(adapter.out_proj(block).register_forward_hook(keep))
    was_training = dense.training
    dense.eval()
    try:
        for batch in batches:
            current["real"] = real_tokens(batch)
            forward_logits(dense, batch)
    finally:
        for handle in handles:
            handle.remove()
        dense.train(was_training)
    return [torch.cat(o) for o in outs]


@torch.no_grad()
def _normal_equations(model, adapter, layer: int, kept: list[int], alive: list[int], batches: list[dict],
                      target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """G (h, h), r (h,), ||y - b||^2 over the calibration tokens for `alive` heads of `layer`."""
    o = adapter.out_proj(adapter.blocks(model)[layer])
    rows = adapter.head_rows(model, layer)
    weights = torch.stack([rows[h]["o"].weight() for h in alive]).float()  # (h, D, E)
    positions = [kept.index(h) for h in alive]
    bias = o.bias.float() if getattr(o, "bias", None) is not None else None
    h = len(alive)
    gram = torch.zeros(h, h, dtype=torch.float64)
    cross = torch.zeros(h, dtype=torch.float64)
    target_sq, offset = 0.0, 0
    current: dict = {}

    def capture(module, args):  # after the HeadMask gate (1 on the alive heads, 0 on pruned ones)
        x = args[0][current["real"]]  # (N_b, k * D)
        current["x"] = x.view(x.shape[0], len(kept), -1)[:, positions].float()  # (N_b, h, D)
        raise _Stop

    handle = o.register_forward_pre_hook(capture)
    try:
        for batch in batches:
            current["real"] = real_tokens(batch)
            try:
                forward_logits(model, batch)
            except _Stop:
                pass
            x = current.pop("x")
            contributions = torch.einsum("nhd,hde->nhe", x, weights.to(x.device)).cpu().double()  # (N_b, h, E)
            y = target[offset:offset + x.shape[0]].double()  # (N_b, E)
            offset += x.shape[0]
            if bias is not None:
                y = y - bias.cpu().double()
            gram += torch.einsum("nhe,nge->hg", contributions, contributions)
            cross += torch.einsum("nhe,ne->h", contributions, y)
            target_sq += float(y.pow(2).sum())
    finally:
        handle.remove()
    # data parallel: every rank tuned on its shard of the calibration slice; sum the normal
    # equations so every rank solves the same system (no-op in one process)
    total = all_reduce_sum(torch.cat([gram.flatten(), cross, torch.tensor([target_sq], dtype=torch.float64)]))
    return total[:h * h].view(h, h), total[h * h:h * h + h], float(total[-1])
