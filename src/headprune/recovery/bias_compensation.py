"""Bias compensation (FLAP, An et al. 2024, `compress` in `lib/prune.py` of their code): what the
removed heads gave on average goes into the attention output projection's bias, so that the
pruned layer's expected output matches the dense layer's.

With x_h the context of head h (the output projection's input, D per head and token) and W_h its
output-projection columns, the removed heads R of a layer added sum_{h in R} W_h x_h to its
output. Replacing that by its mean over the calibration tokens,

    b = b_dense + sum_{h in R} W_h mean_n(x_nh),

keeps the layer's mean output: on the same inputs, mean_n(o_pruned) = mean_n(o_dense). As in
FLAP the means are taken on the dense model's own inputs (one forward pass of the unpruned model,
`Pruner.dense`, accumulating a (heads x D) sum per layer, so memory does not grow with the
calibration set), and each round recomputes the bias from the dense model for every head removed
so far. The bias is the output projection's own (`out_bias.py`: Llama gets `attention_bias=true`
with zero Q/K/V biases), so export and a plain `from_pretrained` compute what was evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from headprune.distributed import all_reduce_sum
from headprune.engine.offload import blocks_held
from headprune.heads.adapters import get_adapter
from headprune.heads.contexts import stream_contexts
from headprune.heads.mask import HeadMask
from headprune.recovery.base import Reconstruction, RecoveryContext
from headprune.recovery.out_bias import bias_refusal, output_bias


@dataclass
class BiasCompensation(Reconstruction):
    """`recovery=bias_compensation`: after each round, the removed heads' mean output over the
    calibration examples (the scoring slice, `data.score_samples`) becomes output bias."""

    record_key: ClassVar[str] = "bias_compensation"
    label: ClassVar[str] = "bias compensation"
    resume_refusal: ClassVar[str] = ("recovery=bias_compensation takes the removed heads' means from the unpruned model, "
                                     "which a resumed run no longer has; start the run again (it trains nothing, so it "
                                     "is short)")

    def check_model(self, student: nn.Module) -> None:
        """The run's one bias check, before any work: each round's compensation trusts it."""
        check_bias(student)

    def reconstruct(self, ctx: RecoveryContext) -> dict:
        return _compensate(ctx.model, ctx.mask, ctx.dense, ctx.loaders.score, ctx.max_batches)


@torch.no_grad()
def compensate(model: nn.Module, mask: HeadMask, dense: nn.Module, loader, max_batches: int | None = None) -> dict:
    """Set every layer's output bias of `model` to the dense bias plus the mean output of the heads
    `mask` has removed (module docstring). `dense`: the unpruned model (no HeadMask). Returns per
    layer the removed heads and the norm of the added bias."""
    check_bias(model)
    return _compensate(model, mask, dense, loader, max_batches)


def check_bias(model: nn.Module) -> None:
    """Refuse a model that cannot carry an output-projection bias (`bias_refusal`)."""
    refusal = bias_refusal(model, "recovery=bias_compensation")
    if refusal:
        raise ValueError(refusal)


@torch.no_grad()
def _compensate(model: nn.Module, mask: HeadMask, dense: nn.Module, loader, max_batches: int | None = None) -> dict:
    """`compensate` on a model already checked (`check_bias`: the recovery's `check_model`)."""
    adapter = get_adapter(dense)
    means = context_means(dense, loader, mask.mask.device, max_batches)  # (L, H, D)
    report = []
    for layer, block in enumerate(adapter.blocks(dense)):
        removed = [h for h in range(mask.num_heads) if float(mask.mask[layer, h]) == 0]
        with blocks_held(layer, model, dense):  # streamed models: this layer's blocks on the device (engine.offload)
            rows = adapter.head_rows(dense, layer)
            o = adapter.out_proj(block)
            shift = torch.zeros(rows[0]["o"].weight().shape[1], dtype=torch.float64, device=means.device)  # (E,)
            for h in removed:
                shift += means[layer, h] @ rows[h]["o"].weight().double()  # (D,) @ (D, E)
            reference = o.bias.double() if getattr(o, "bias", None) is not None else torch.zeros_like(shift)
            output_bias(model, layer).copy_(reference + shift)
        report.append({"layer": layer, "removed": removed, "bias_norm": round(float(shift.norm()), 6)})
    return {"layers": report}


@torch.no_grad()
def context_means(dense: nn.Module, loader, device, max_batches: int | None = None) -> torch.Tensor:
    """Each head's mean context over the real tokens of `loader` in the dense model, (L, H, D):
    one forward pass (ended at the last layer's output projection) with running sums."""
    adapter = get_adapter(dense)
    blocks = adapter.blocks(dense)
    heads, head_dim = adapter.num_heads(dense.config), adapter.head_dim(dense.config)
    sums = torch.zeros(len(blocks), heads * head_dim, dtype=torch.float64, device=device)  # (L, H * D)

    def add(layer: int, x: torch.Tensor) -> None:
        sums[layer] += x.double().sum(0)  # (N, H * D) -> (H * D,)

    tokens = stream_contexts(dense, loader, range(len(blocks)), add, device, max_batches)
    total = all_reduce_sum(torch.cat([sums.flatten(), tokens.view(1)]))  # data parallel: every rank's shard
    if float(total[-1]) == 0:
        raise ValueError("bias compensation got no calibration tokens (data.score_samples=0?)")
    return (total[:-1] / total[-1]).view(len(blocks), heads, head_dim)
