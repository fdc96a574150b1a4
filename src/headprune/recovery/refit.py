"""Refit of the attention output projection (SlimLLM, ICML 2025; layer after layer on the pruned
model's own inputs as in SparseGPT and Kwon et al.): after heads are removed without retraining,
each layer's output projection O is re-solved on the heads it keeps.

O is linear in the kept heads' concatenated contexts C (tokens x kept heads x head_dim), so
reproducing a target Y of the unpruned model on calibration tokens is a ridge regression,

    min_W,b || C W + b - Y ||^2 + lambda || W - W_kept ||^2,

with a closed form from sums streamed over the tokens (`ridge.py`: C^T C, C^T Y, the sums for the
intercept; one layer's at a time), solved by Cholesky in float64. Per-head scales (least-squares
mask tuning) are its block-diagonal special case and FLAP's bias its intercept.

Layer by layer, first to last. At layer l, x_d is the dense model's block input and x_p the
pruned model's (from the already refit layers before it, so each refit also absorbs their error);
o_d = the dense attention output on x_d. `target`:
- `residual`: what enters the next norm, Y = x_d + o_d - x_p (least squares' target);
- `attention`: the dense attention output itself, Y = o_d.
The damping lambda = damp x mean(diag) of the centred C^T C; damp is picked from `damps` by the
error on held-out calibration sequences (every 1/`holdout`-th one) of the fit on the others, then
the chosen damp is refit on all of them. On the same tokens the refit then competes with the
least-squares scales (`LeastSquares`' defaults) rebuilt from the same sums: a layer where the scales
reconstruct better keeps them (`kept_scales`), so the calibration error is never above least
squares' on the same inputs. A layer with no heads left has only its bias: with `bias` it gets the
mean target (an attention-free layer's fit, as bias compensation gives it), else it is skipped.

The result is written into O's weight columns of the kept heads (their gates are set to 1, a gate
other than 1 is folded in first) and, with `bias`, O's bias (`out_bias.py`: Llama gets
`attention_bias=true` with zero Q/K/V biases), so a uniform export is a plain checkpoint that
computes what was evaluated. Streaming as in least squares (`blockwise.py`): per layer the dense
block runs once, the pruned block once up to O and once whole after the solve.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, List

import torch
from torch import nn

from headprune.engine.offload import blocks_held
from headprune.heads.adapters import get_adapter, layer_heads
from headprune.heads.mask import HeadMask
from headprune.recovery.base import Reconstruction
from headprune.recovery.blockwise import (BlockInputs, block_with_out_proj, calibration_batches, capture, eval_mode,
                                          out_proj_input, run_block)
from headprune.recovery.out_bias import bias_refusal, output_bias
from headprune.recovery.ridge import RidgeSums, scales_equations
from headprune.tasks import real_tokens

TARGETS = ("residual", "attention")
SCALES_SETTINGS = ((0.5, 2.0), 0.01)  # LeastSquares' default scale_range and damp, for the comparison


@dataclass
class Refit(Reconstruction):
    """`recovery=refit`: after each round, re-solve every layer's attention output projection on
    its kept heads against the unpruned model (`dense`), layer by layer (module docstring).
    Calibration examples are the scoring slice (`data.score_samples`, from the training file)."""

    target: str = "residual"  # residual: x_d + o_d - x_p (what enters the next norm); attention: o_d
    damps: List[float] = field(default_factory=lambda: [0.001, 0.01, 0.1, 1.0])  # x mean(diag C^T C)
    holdout: float = 0.25  # share of the calibration sequences the damp is chosen on
    bias: bool = True  # fit O's bias as well (the intercept)

    record_key: ClassVar[str] = "refit"
    label: ClassVar[str] = "output-projection refit"
    resume_refusal: ClassVar[str] = ("recovery=refit fits each round against the unpruned model's outputs, which a "
                                     "resumed run no longer has; start the run again (it trains nothing, so it is "
                                     "short)")

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"recovery.target={self.target!r} is not allowed; allowed: {', '.join(TARGETS)}")
        damps = list(self.damps)
        if not damps or any(not isinstance(d, (int, float)) or isinstance(d, bool) or not d >= 0 for d in damps):
            raise ValueError(f"recovery.damps={damps!r} must be a non-empty list of numbers >= 0")
        if not isinstance(self.holdout, (int, float)) or not 0 <= self.holdout < 1:
            raise ValueError(f"recovery.holdout={self.holdout!r} must be in [0, 1)")
        if self.holdout == 0 and len(damps) > 1:
            raise ValueError(f"recovery.holdout=0 leaves nothing to choose recovery.damps={damps} on; allowed: "
                             "holdout in (0, 1), or a single damp")
        if not isinstance(self.bias, bool):
            raise ValueError(f"recovery.bias={self.bias!r} must be true or false")

    def check_calibration(self, sequences: int) -> None:
        """The holdout split of `sequences` calibration sequences leaves some to fit on and, with
        several damps, some to choose the damp on (`_refit_layers` checks the tokens again)."""
        held = sum(held_out(sequences, self.holdout))
        if sequences - held == 0 or (len(self.damps) > 1 and held == 0):
            raise ValueError(f"recovery.holdout={self.holdout} splits data.score_samples={sequences} calibration "
                             f"sequences into {sequences - held} to fit on and {held} held out; both must be > 0 with "
                             f"recovery.damps={list(self.damps)}; allowed: more data.score_samples, another "
                             "recovery.holdout, or a single damp")

    def check_model(self, student: nn.Module) -> None:
        """The run's one bias check, before any work: each round's refit trusts it; hybrids refused."""
        from headprune.recovery.blockwise import blockwise_problem

        refusal = blockwise_problem(student, "recovery=refit")
        if refusal:
            raise ValueError(refusal)
        check_bias(student, self)

    def reconstruct(self, ctx, loaders=None) -> dict:
        """`ctx`: the run (model, mask, dense, max_batches; its `loaders` unless given)."""
        loaders = loaders if loaders is not None else ctx.loaders
        return _refit_layers(ctx.model, ctx.mask, ctx.dense, loaders.score, self, ctx.max_batches)


@dataclass
class _Batch:
    """One calibration batch carried through the layers: the block arguments, the real tokens
    (B, T), which of its sequences are held out (B,), and the dense and pruned hidden states
    entering the current layer (B, T, E)."""

    inputs: BlockInputs
    real: torch.Tensor
    held: torch.Tensor
    dense: torch.Tensor
    pruned: torch.Tensor


def held_out(sequences: int, share: float) -> list[bool]:
    """Which of `sequences` calibration sequences are held out: every 1/`share`-th, spread evenly."""
    return [math.floor((j + 1) * share) > math.floor(j * share) for j in range(sequences)]


@torch.no_grad()
def refit_layers(model: nn.Module, mask: HeadMask, dense: nn.Module, loader, settings: Refit,
                 max_batches: int | None = None) -> dict:
    """Refit every layer's output projection of `model` (module docstring), first to last, in
    place. `dense`: the unpruned model (no HeadMask). Returns the settings used, the fit and
    held-out token counts, per layer the chosen damp and the relative errors (calibration before /
    after, held-out before and per damp, least squares' on the same tokens), and the blocks run."""
    check_bias(model, settings)
    return _refit_layers(model, mask, dense, loader, settings, max_batches)


def check_bias(model: nn.Module, settings: Refit) -> None:
    """With `settings.bias`, refuse a model that cannot carry an output-projection bias (`bias_refusal`)."""
    refusal = settings.bias and bias_refusal(model, "recovery=refit with recovery.bias=true")
    if refusal:
        raise ValueError(f"{refusal}; or set recovery.bias=false (weights only)")


@torch.no_grad()
def _refit_layers(model: nn.Module, mask: HeadMask, dense: nn.Module, loader, settings: Refit,
                  max_batches: int | None = None) -> dict:
    """`refit_layers` on a model already checked (`check_bias`: the recovery's `check_model`)."""
    raw = calibration_batches(loader, mask.mask.device, max_batches, "the output-projection refit")
    with eval_mode(model, dense):
        batches, seen = [], 0
        flags = held_out(sum(int(real_tokens(b).shape[0]) for b in raw), settings.holdout)
        for batch in raw:
            inputs, real = capture(model, batch), real_tokens(batch)
            held = torch.tensor(flags[seen:seen + real.shape[0]], device=real.device)
            seen += real.shape[0]
            batches.append(_Batch(inputs, real, held, capture(dense, batch).hidden, inputs.hidden))
        counts = {"fit": int(sum(int(b.real[~b.held].sum()) for b in batches)),
                  "heldout": int(sum(int(b.real[b.held].sum()) for b in batches))}
        if counts["fit"] == 0 or (len(settings.damps) > 1 and counts["heldout"] == 0):
            raise ValueError(f"recovery.holdout={settings.holdout} splits the {len(flags)} calibration sequences into "
                             f"{counts['fit']} fit and {counts['heldout']} held-out tokens; both must be > 0 (more "
                             "data.score_samples, or another holdout)")
        runs = {"dense": 0, "pruned": 0, "pruned_to_out_proj": 0}
        report = []
        for layer in range(mask.num_layers):  # streamed models: this layer's blocks on the device (engine.offload)
            with blocks_held(layer, model, dense):
                report.append(_refit_layer(model, mask, dense, layer, batches, settings, runs))
    return {"target": settings.target, "damps": list(settings.damps), "tokens": counts, "layers": report,
            "block_runs": {k: v // len(batches) for k, v in runs.items()}}


def _refit_layer(model, mask: HeadMask, dense, layer: int, batches: list[_Batch], settings: Refit,
                 runs: dict) -> dict:
    """Refit layer `layer` on every batch's carried states, then carry both models past it."""
    adapter = get_adapter(model)
    last = layer == mask.num_layers - 1
    kept = layer_heads(model, layer)
    alive = [h for h in kept if float(mask.mask[layer, h]) > 0]
    out: dict = {"layer": layer, "heads": alive}
    if not alive and not settings.bias:  # no weights and no bias to fit: carry both models past the layer
        out["skipped"] = "no heads"
        for b in batches:
            if not last:
                b.dense = run_block(dense, layer, b.inputs, b.dense)
                b.pruned = run_block(model, layer, b.inputs, b.pruned)
                runs["dense"] += 1
                runs["pruned"] += 1
        return out
    if not alive:
        return _refit_bias_only(model, dense, layer, last, batches, settings, runs, out)
    rows = adapter.head_rows(model, layer)
    gates = mask.mask[layer, alive].double()
    start = torch.cat([rows[h]["o"].weight().double() * g for h, g in zip(alive, gates)])  # (F, E), gates folded in
    mask.mask[layer, alive] = 1.0
    o = adapter.out_proj(adapter.blocks(model)[layer])
    hidden = start.shape[1]
    reference = o.bias.detach().double() if getattr(o, "bias", None) is not None else start.new_zeros(hidden)  # (E,)
    positions = [kept.index(h) for h in alive]
    fit, held = (RidgeSums(start.shape[0], hidden, mask.mask.device) for _ in range(2))
    for b in batches:
        o_d, next_dense = block_with_out_proj(dense, layer, b.inputs, b.dense, stop=last)
        runs["dense"] += 1
        y = o_d if settings.target == "attention" else b.dense.float() + o_d.float() - b.pruned.float()  # (B, T, E)
        x = out_proj_input(model, layer, b.inputs, b.pruned)  # (B, T, k * D)
        runs["pruned_to_out_proj"] += 1
        x = x.view(*x.shape[:2], len(kept), -1)[:, :, positions].flatten(2)  # (B, T, F)
        for sums, rows_in in ((fit, ~b.held), (held, b.held)):
            pick = b.real & rows_in[:, None]
            if bool(pick.any()):
                sums.add(x[pick], y[pick])
        b.dense = next_dense if next_dense is not None else b.dense
    fit.all_reduce()
    held.all_reduce()
    damp, heldout = settings.damps[0], {}
    if len(settings.damps) > 1:
        base = held.baseline(reference)
        for d in settings.damps:
            w, bias, _ = fit.solve(start, reference, d, settings.bias)
            heldout[str(d)] = _round(held.error(w, bias) / base)
        damp = min(settings.damps, key=lambda d: heldout[str(d)])
        out["heldout_before"] = _round(held.error(start, reference) / base)
    calib = fit.merged(held)
    weight, bias, lam = calib.solve(start, reference, damp, settings.bias)
    base = calib.baseline(reference)
    eq = scales_equations(calib, start, len(alive))
    scales, scales_bias, _ = eq.solve(reference, *SCALES_SETTINGS, fit_bias=settings.bias)
    by_scales = (start.view(len(alive), -1, hidden) * scales.view(-1, 1, 1).to(start)).flatten(0, 1)
    errors = {"error_before": calib.error(start, reference) / base, "error_after": calib.error(weight, bias) / base,
              "error_scales": calib.error(by_scales, scales_bias) / base}
    kept_scales = errors["error_scales"] < errors["error_after"]
    if kept_scales:
        weight, bias = by_scales, scales_bias
        errors["error_after"] = errors["error_scales"]
    d = start.shape[0] // len(alive)
    for i, h in enumerate(alive):
        rows[h]["o"].weight().copy_(weight[i * d:(i + 1) * d])
    if settings.bias:
        output_bias(model, layer).copy_(bias)
    out.update(damp=damp, **{"lambda": _round(lam)}, **{k: _round(v) for k, v in errors.items()},
               heldout=heldout, kept_scales=bool(kept_scales),
               bias_norm=_round(float((bias - reference).norm())) if settings.bias else 0.0)
    if not last:
        for b in batches:
            b.pruned = run_block(model, layer, b.inputs, b.pruned)
            runs["pruned"] += 1
    return out


def _refit_bias_only(model, dense, layer: int, last: bool, batches: list[_Batch], settings: Refit, runs: dict,
                     out: dict) -> dict:
    """A layer with no heads left outputs its output-projection bias alone, so the refit's
    intercept is all there is to fit: the mean target over the calibration tokens (on the
    attention target, bias compensation's value for the layer; on the residual target, that plus
    the mean drift the layers before left). Without it an attention-free layer would lose the
    removed heads' mean output that bias compensation keeps."""
    adapter = get_adapter(model)
    hidden = batches[0].dense.shape[-1]
    o = adapter.out_proj(adapter.blocks(model)[layer])
    reference = (o.bias.detach().double() if getattr(o, "bias", None) is not None
                 else torch.zeros(hidden, dtype=torch.float64, device=batches[0].dense.device))  # (E,)
    sums = RidgeSums(0, hidden, reference.device)
    for b in batches:
        o_d, next_dense = block_with_out_proj(dense, layer, b.inputs, b.dense, stop=last)
        runs["dense"] += 1
        y = o_d if settings.target == "attention" else b.dense.float() + o_d.float() - b.pruned.float()  # (B, T, E)
        rows = y[b.real]  # (N, E)
        sums.add(rows.new_zeros(rows.shape[0], 0), rows)
        b.dense = next_dense if next_dense is not None else b.dense
    sums.all_reduce()
    bias = sums.target_sum / sums.tokens.clamp_min(1)  # (E,)
    empty = bias.new_zeros(0, hidden)
    base = sums.baseline(reference)
    output_bias(model, layer).copy_(bias)
    out.update(bias_only=True, error_before=_round(sums.error(empty, reference) / base),
               error_after=_round(sums.error(empty, bias) / base), bias_norm=_round(float((bias - reference).norm())))
    if not last:
        for b in batches:
            b.pruned = run_block(model, layer, b.inputs, b.pruned)
            runs["pruned"] += 1
    return out


def _round(value: float) -> float:
    return float(f"{float(value):.6g}")


__all__ = ["Refit", "TARGETS", "held_out", "refit_layers"]
