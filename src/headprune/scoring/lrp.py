"""Layer-wise relevance propagation (LRP) to attention heads (Voita et al. 2019), with the
conservative rules of Ali et al. 2022 ("XAI for Transformers: Better Explanations through
Conservative Propagation") and AttnLRP (Achtibat et al. 2024).

Relevance starts at one logit per example z (the predicted class, or the gold one) and is
propagated back as gradient x input through a network in which the non-linear parts are
frozen at their forward values:
- attention probabilities are constants (the query and key projections' outputs are
  detached), so a head's context c = P V is linear in its values;
- LayerNorm / RMSNorm divide by a constant (their 1/std is detached; the centring stays);
- elementwise activations (GELU, tanh, ...) pass relevance through unchanged (identity rule:
  f(x) is treated as x * [f(x)/x] with the ratio constant); in gated MLPs (Llama's
  act(gate(x)) * up(x)) the activated gate is a constant multiplier.
The remaining network is linear in its input and its bias terms jointly, so gradient x input
conserves relevance exactly: at any point h of the residual stream,
    z = sum(h * dz/dh) + sum over bias parameters b after h of sum(b * dz/db).
The relevance of head h of a layer is R_h = sum_t c_h . dz/dc_h (its context, i.e. its slice
of the output projection's input), read off as the gradient of z w.r.t. a per-example head
gate. Within a layer, sum_h R_h + b_o . dz/db_o equals the relevance of the attention output.

Score (Voita et al.): per example, each layer's |R_h| are divided by their sum over the
layer's heads (so they sum to 1), then averaged over examples. Raw HIGH = KEEP. With
`signed=True` the sign is kept (R_h / sum |R|): heads that argue against the target logit
then score below 0.

Limits: the rules are exact only for the modules they can see. Non-linearities applied as
plain functions rather than modules (e.g. DistilBERT's classifier ReLU) fall back to the
gradient, which is still conservative for ReLU but not in general; relevance absorbed by
biases is not given to any head; the scores explain one logit, not the loss.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from headprune.heads.adapters import get_adapter
from headprune.heads.mask import HeadMask
from headprune.tasks import CLASSIFICATION, SEQ2SEQ_LM, Task, batch_size, forward_logits, task_for, to_device
from headprune.scoring.reduce import finish_scores, mean_over_ranks, scoring_mode

TARGETS = ("predicted", "gold")
_TORCH_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.Tanh, nn.SiLU, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus)


def _same_value(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """`value` in the forward pass, the gradient of `surrogate` in the backward pass."""
    return value.detach() + (surrogate - surrogate.detach())


def _detach_output(module, args, out):
    return out.detach()


def _detach_features(flags: torch.Tensor):
    """A forward hook freezing the output features where `flags` (out_features,) is True."""
    def hook(module, args, out):
        keep = flags.to(out.device)
        return torch.where(keep, out.detach(), out)
    return hook


def _layer_norm_rule(module: nn.LayerNorm, args, out):
    x = args[0]
    dims = tuple(range(-len(module.normalized_shape), 0))
    scale = (x.var(dims, keepdim=True, unbiased=False) + module.eps).rsqrt().detach()
    linear = (x - x.mean(dims, keepdim=True)) * scale
    if module.weight is not None:
        linear = linear * module.weight
    if module.bias is not None:
        linear = linear + module.bias
    return _same_value(out, linear)


def _rms_norm_rule(module: nn.Module, args, out):
    x = args[0]
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    wide = x.to(torch.promote_types(x.dtype, torch.float32))  # as the module computes it
    scale = (wide.pow(2).mean(-1, keepdim=True) + eps).rsqrt().detach()
    return _same_value(out, module.weight * (wide * scale).to(x.dtype))


def _identity_rule(module, args, out):
    x = args[0]
    nonzero = x.abs() > 1e-12
    slope = torch.where(nonzero, out / torch.where(nonzero, x, torch.ones_like(x)), torch.zeros_like(x))
    return _same_value(out, x * slope.detach())


def _is_activation(module: nn.Module) -> bool:
    return isinstance(module, _TORCH_ACTIVATIONS) or type(module).__module__ == "transformers.activations"


@contextmanager
def conservative_backward(model: nn.Module) -> Iterator[None]:
    """Inside the context, backward passes through `model` follow the conservative rules above
    (forward values are unchanged). Works under eager and sdpa attention."""
    adapter = get_adapter(model)
    handles = []
    for layer in range(len(adapter.blocks(model))):
        for module, flags in adapter.qk_output_features(model, layer).items():
            if bool(flags.all()):
                handles.append(module.register_forward_hook(_detach_output))
            elif bool(flags.any()):  # a fused [q | k | v] projection: freeze q and k, keep v
                handles.append(module.register_forward_hook(_detach_features(flags)))
    for parent in model.modules():
        gated = hasattr(parent, "gate_proj")
        for child in parent.children():
            if isinstance(child, nn.LayerNorm):
                handles.append(child.register_forward_hook(_layer_norm_rule))
            elif type(child).__name__.endswith("RMSNorm"):
                handles.append(child.register_forward_hook(_rms_norm_rule))
            elif _is_activation(child):
                handles.append(child.register_forward_hook(_detach_output if gated else _identity_rule))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def target_logits(logits: torch.Tensor, batch: dict, target: str = "predicted", task: Task = CLASSIFICATION) -> torch.Tensor:
    """(B,) the logit relevance starts from, per example.

    Classification (B, C): the predicted class's logit, or the gold label's. Causal LM
    (B, T, V): the sum over real positions of the predicted (or actual) next token's logit.
    """
    if target not in TARGETS:
        raise ValueError(f"metric.target={target!r} is not allowed; allowed: {', '.join(TARGETS)}")
    if task is CLASSIFICATION:
        if target == "gold":
            if "labels" not in batch:
                raise ValueError("metric.target='gold' needs `labels` in the scoring batches")
            index = batch["labels"]
        else:
            index = logits.argmax(-1)
        return logits.gather(1, index[:, None]).squeeze(1)
    if task is SEQ2SEQ_LM:  # the decoder's positions t, labelled t (-100 unscored)
        if target == "gold" and "labels" not in batch:
            raise ValueError("metric.target='gold' needs `labels` in the scoring batches")
        index = logits.argmax(-1) if target == "predicted" else batch["labels"].clamp_min(0)  # (B, T)
        picked = logits.gather(2, index[..., None]).squeeze(2)  # (B, T)
        if "labels" in batch:
            picked = picked * (batch["labels"] != -100).to(picked.dtype)
        return picked.sum(1)
    logits = task.positions(logits)  # (B, T-1, V)
    index = logits.argmax(-1) if target == "predicted" else batch["input_ids"][:, 1:]  # (B, T-1)
    picked = logits.gather(2, index[..., None]).squeeze(2)  # (B, T-1)
    if "attention_mask" in batch:
        picked = picked * batch["attention_mask"][:, 1:].to(picked.dtype)
    return picked.sum(1)


def head_relevance(model: nn.Module, mask: HeadMask, batch: dict, target: str = "predicted",
                   task: Task | None = None) -> torch.Tensor:
    """(B, layers, heads) raw relevance R[b, l, h] = sum_t c_h . dz_b/dc_h under the rules
    above, in original head numbering (0 for heads the layer no longer has); the target logit is
    `task`'s (`target_logits`; None: the model's head's)."""
    task = task_for(model, task)
    batch = to_device(batch, mask.mask.device)
    with scoring_mode(model), conservative_backward(model):
        with mask.differentiable_gates(batch_size(batch)) as gates:  # (B, L, H)
            z = target_logits(forward_logits(model, batch), batch, target, task).sum()
            (relevance,) = torch.autograd.grad(z, gates)
    return relevance.detach()


def lrp_importance(model: nn.Module, mask: HeadMask, dataloader, target: str = "predicted",
                   signed: bool = False, max_batches: int | None = None, task: Task | None = None) -> torch.Tensor:
    """(layers, heads) per-layer normalised head relevance averaged over examples (target logits
    of `task`, the run's Task; None: the model's head's, read once here); pruned heads score 0."""
    if target not in TARGETS:
        raise ValueError(f"metric.target={target!r} is not allowed; allowed: {', '.join(TARGETS)}")
    task = task_for(model, task)
    total = torch.zeros_like(mask.mask, dtype=torch.float64)
    count = 0
    for i, batch in enumerate(dataloader):
        if max_batches is not None and i >= max_batches:
            break
        relevance = head_relevance(model, mask, batch, target, task).double()  # (B, L, H)
        share = relevance / relevance.abs().sum(-1, keepdim=True).clamp_min(1e-30)
        total += (share if signed else share.abs()).sum(0)
        count += relevance.shape[0]
    return finish_scores(mean_over_ranks(total, count), mask)
