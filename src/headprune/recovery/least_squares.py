"""Mask tuning by least squares (Kwon et al. 2022, `prune/rescale.py` of their code): after heads
are removed without retraining, give each surviving head a real-valued scale, and the layer's
attention output projection a bias, so that what enters each layer's next norm is as close as
possible to the unpruned model's.

Layer by layer, first to last, on calibration examples from the training file. At layer l, x_d
is the dense model's block input and x_p the pruned model's, which comes from the already tuned
pruned layers before it. What enters the next norm is the block input plus the attention
output (BERT: the attention sub-layer's output before its LayerNorm; Llama, GPT-2: the residual
stream after attention). The dense value x_d + o_d(x_d) is the target; the pruned one is
x_p + sum_h m_h W_h x_h + b, with x_h the context of kept head h on x_p (B x T x D) and W_h its
output-projection columns. So the scales m and the bias b fit y = x_d + o_d - x_p by damped
least squares over the real tokens (`normal_equations.py`), damped toward m = 1 by
lambda = `damp` x mean(diag G); the scales are clamped to `scale_range`, and a layer whose
clamped fit reconstructs worse than ones with the dense bias keeps those. Kwon et al. fit one
scalar bias and drop it; here the bias is a vector that is kept (`bias=false`: scales only).

Streaming: the dense and pruned hidden states of one layer are carried forward on every
calibration batch (`blockwise.py`); per layer the dense block runs once, the pruned block once
up to its output projection (the contexts) and once whole after the solve. Memory beyond the
two carried states is one layer's normal equations. The scales live in the HeadMask (gate values
other than 0 or 1) and fold into the output projection at export (`scale_heads`); the bias is the
output projection's own (`out_bias.py`), so the export computes what was evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, List

import torch
from torch import nn

from headprune.engine.offload import blocks_held
from headprune.heads.adapters import get_adapter, layer_heads
from headprune.heads.mask import HeadMask
from headprune.recovery.base import Reconstruction, RecoveryContext
from headprune.recovery.blockwise import (block_with_out_proj, calibration_batches, capture, eval_mode, out_proj_input,
                                          run_block)
from headprune.recovery.normal_equations import NormalEquations, solve_scales
from headprune.recovery.out_bias import bias_refusal, output_bias
from headprune.tasks import real_tokens


@dataclass
class LeastSquares(Reconstruction):
    """`recovery=least_squares`: after each round, tune the surviving heads' scales and each
    layer's output bias against the unpruned model (`Pruner.dense`). Calibration examples are
    the scoring slice (`data.score_samples`, from the training file)."""

    scale_range: List[float] = field(default_factory=lambda: [0.5, 2.0])
    damp: float = 0.01
    bias: bool = True  # fit a bias per layer as well (folded into the output projection's bias)

    record_key: ClassVar[str] = "mask_tuning"
    label: ClassVar[str] = "least-squares mask tuning"
    resume_refusal: ClassVar[str] = ("recovery=least_squares tunes each round against the unpruned model's outputs, which "
                                     "a resumed run no longer has; start the run again (it trains nothing, so it is "
                                     "short)")

    def __post_init__(self) -> None:
        low, high = (list(self.scale_range) + [None, None])[:2]
        if len(self.scale_range) != 2 or not 0 < low <= 1 <= high:
            raise ValueError(f"recovery.scale_range={list(self.scale_range)} must be [low, high] with 0 < low <= 1 <= "
                             "high (a scale of 0 would prune the head)")
        if self.damp < 0:
            raise ValueError(f"recovery.damp={self.damp!r} must be >= 0")
        if not isinstance(self.bias, bool):
            raise ValueError(f"recovery.bias={self.bias!r} must be true or false")

    def check_model(self, student: nn.Module) -> None:
        """The run's one bias check, before any work: each round's tuning trusts it; hybrids refused."""
        from headprune.recovery.blockwise import blockwise_problem

        refusal = blockwise_problem(student, "recovery=least_squares")
        if refusal:
            raise ValueError(refusal)
        check_bias(student, self)

    def reconstruct(self, ctx: RecoveryContext) -> dict:
        return _tune_scales(ctx.model, ctx.mask, ctx.dense, ctx.loaders.score, self, ctx.max_batches)


@dataclass
class _Batch:
    """One calibration batch carried through the layers: the block arguments, the real tokens
    (B, T), and the dense and pruned models' hidden states entering the current layer (B, T, E)."""

    inputs: object
    real: torch.Tensor
    dense: torch.Tensor
    pruned: torch.Tensor


@torch.no_grad()
def tune_scales(model: nn.Module, mask: HeadMask, dense: nn.Module, loader, settings: LeastSquares,
                max_batches: int | None = None) -> dict:
    """Set `mask`'s gates of every layer's alive heads to their least-squares scales and (with
    `settings.bias`) every layer's output bias (module docstring), layer by layer. `dense`: the
    unpruned model (no HeadMask). Returns a report per layer (scales, relative reconstruction
    errors with ones and tuned, the norm of the bias change) and the blocks run."""
    check_bias(model, settings)
    return _tune_scales(model, mask, dense, loader, settings, max_batches)


def check_bias(model: nn.Module, settings: LeastSquares) -> None:
    """With `settings.bias`, refuse a model that cannot carry an output-projection bias (`bias_refusal`)."""
    refusal = settings.bias and bias_refusal(model, "recovery=least_squares with recovery.bias=true")
    if refusal:
        raise ValueError(f"{refusal}; or set recovery.bias=false (scales only)")


@torch.no_grad()
def _tune_scales(model: nn.Module, mask: HeadMask, dense: nn.Module, loader, settings: LeastSquares,
                 max_batches: int | None = None) -> dict:
    """`tune_scales` on a model already checked (`check_bias`: the recovery's `check_model`)."""
    raw = calibration_batches(loader, mask.mask.device, max_batches, "least-squares mask tuning")
    with eval_mode(model, dense):
        batches = []
        for batch in raw:
            inputs = capture(model, batch)
            batches.append(_Batch(inputs, real_tokens(batch), capture(dense, batch).hidden, inputs.hidden))
        runs = {"dense": 0, "pruned": 0, "pruned_to_out_proj": 0}
        report = []
        for layer in range(mask.num_layers):  # streamed models: this layer's blocks on the device (engine.offload)
            with blocks_held(layer, model, dense):
                report.append(_tune_layer(model, mask, dense, layer, batches, settings, runs))
    return {"layers": report, "block_runs": {k: v // len(batches) for k, v in runs.items()}}


def _tune_layer(model, mask: HeadMask, dense, layer: int, batches: list[_Batch], settings: LeastSquares,
                runs: dict) -> dict:
    """Fit layer `layer` on every batch's carried states, then carry both models past it."""
    adapter = get_adapter(model)
    last = layer == mask.num_layers - 1
    kept = layer_heads(model, layer)
    alive = [h for h in kept if float(mask.mask[layer, h]) > 0]
    dense_o = adapter.out_proj(adapter.blocks(dense)[layer])
    out = {"layer": layer, "heads": alive, "scales": []}
    if alive or settings.bias:
        mask.mask[layer, alive] = 1.0  # the contexts are collected ungated
        rows = adapter.head_rows(model, layer)
        weights = torch.stack([rows[h]["o"].weight() for h in alive]) if alive else None  # (h, D, E)
        hidden = batches[0].dense.shape[-1]
        eq = NormalEquations(len(alive), hidden, mask.mask.device)
        positions = [kept.index(h) for h in alive]
        for b in batches:
            o_d, next_dense = block_with_out_proj(dense, layer, b.inputs, b.dense, stop=last)
            runs["dense"] += 1
            target = (b.dense.float() + o_d.float() - b.pruned.float())[b.real]  # (N, E)
            contexts = None
            if alive:
                x = out_proj_input(model, layer, b.inputs, b.pruned)  # (B, T, k * D)
                runs["pruned_to_out_proj"] += 1
                contexts = x[b.real].view(-1, len(kept), x.shape[-1] // len(kept))[:, positions]  # (N, h, D)
            eq.add(contexts, weights, target)
            b.dense = next_dense if next_dense is not None else b.dense
        eq.all_reduce()
        reference = dense_o.bias if getattr(dense_o, "bias", None) is not None else torch.zeros(hidden)
        scales, bias, info = eq.solve(reference.detach(), tuple(settings.scale_range), settings.damp, settings.bias)
        mask.mask[layer, alive] = scales.to(mask.mask)
        if settings.bias:
            output_bias(model, layer).copy_(bias)
            info["bias_norm"] = round(float((bias - reference.to(bias)).norm()), 6)
        out.update(scales=[round(float(s), 6) for s in scales], **info)
    elif not last:
        for b in batches:
            b.dense = block_with_out_proj(dense, layer, b.inputs, b.dense)[1]
            runs["dense"] += 1
    if not last:
        for b in batches:
            b.pruned = run_block(model, layer, b.inputs, b.pruned)
            runs["pruned"] += 1
    return out


__all__ = ["LeastSquares", "solve_scales", "tune_scales"]
