"""HeadMask: per-head gates on an unmodified HF model.

transformers 5 ignores `head_mask=`, so gating is done here: a forward pre-hook on each
layer's attention output projection views its input as (B, T, H, D) and multiplies it by a
per-head gate. Zeroing gate h is exactly zeroing head h's columns of the output projection,
under eager and sdpa attention alike, because the hook sits after the attention kernel.

The mask is always indexed in the ORIGINAL model's numbering (layers x heads). After
physical removal a layer holds fewer heads; the hook picks the gates of the heads it still
has from the model's head layout.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from headprune.heads.adapters import get_adapter, layer_heads, model_shape
from headprune.heads.stacks import rows_request, stack_rows


class HeadMask(nn.Module):
    """A (layers, heads) keep-mask (1 = keep, 0 = pruned) applied to a model by hooks.

    The mask is a buffer, so it is saved in state dicts and Lightning checkpoints. Optional
    per-example `gates` (see `differentiable_gates`) multiply on top of it so that
    d loss / d gate gives each example's first-order head importance. An optional
    `stochastic` module (HardConcreteGates) multiplies learned gates on top as well: sampled
    while the model trains, deterministic in eval mode.
    """

    def __init__(self, num_layers: int, num_heads: int):
        super().__init__()
        self.register_buffer("mask", torch.ones(num_layers, num_heads))
        self._gates: torch.Tensor | None = None
        self._handles: list = []
        self.register_module("stochastic", None)
        self.stacks: dict[str, range] = {}  # stack name -> its rows (sites), for a model with several

    @classmethod
    def for_model(cls, model: nn.Module, attach: bool = True) -> "HeadMask":
        mask = cls(*model_shape(model))
        mask.stacks = stack_rows(model)  # several attention stacks: their rows, for requests by name
        if attach:
            mask.attach(model)
        return mask

    @property
    def num_layers(self) -> int:
        return self.mask.shape[0]

    @property
    def num_heads(self) -> int:
        return self.mask.shape[1]

    def attach(self, model: nn.Module) -> "HeadMask":
        """Register the gating hooks on `model` (idempotent per model)."""
        if (self.num_layers, self.num_heads) != model_shape(model):
            raise ValueError(
                f"HeadMask shape {tuple(self.mask.shape)} does not match the model's "
                f"(layers, heads) = {model_shape(model)}"
            )
        self.detach()
        adapter = get_adapter(model)
        for layer, block in enumerate(adapter.blocks(model)):
            handle = adapter.out_proj(block).register_forward_pre_hook(self._make_hook(model, layer))
            self._handles.append(handle)
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def unmasked_copy(self, model: nn.Module, copier=copy.deepcopy) -> nn.Module:
        """A deep copy of `model` (attached to this mask) without the mask's hooks: it computes
        every head it physically has, e.g. the dense model a teacher or a least-squares target
        comes from. `copier` makes the copy (e.g. straight into host memory)."""
        self.detach()
        try:
            return copier(model)
        finally:
            self.attach(model)

    def _make_hook(self, model: nn.Module, layer: int):
        def hook(module, args):
            kept = layer_heads(model, layer)
            gate = self.mask[layer, kept]  # (h,)
            if self.stochastic is not None:
                gate = gate * self.stochastic.gate(layer, kept, sample=module.training)  # (h,)
            if self._gates is None and bool((gate == 1).all()):
                return None
            x = args[0]  # (B, T, h * D)
            n_kept = len(kept)
            if n_kept == 0:
                return None
            head_dim = x.shape[-1] // n_kept
            gate = gate.to(dtype=x.dtype, device=x.device)
            if self._gates is not None:
                per_example = self._gates[:, layer, kept].to(dtype=x.dtype)  # (B, h)
                gate = per_example * gate  # (B, h)
                gate = gate.view(x.shape[0], *([1] * (x.dim() - 2)), n_kept, 1)  # (B, 1, h, 1)
            else:
                gate = gate.view(n_kept, 1)  # (h, 1)
            x = (x.view(*x.shape[:-1], n_kept, head_dim) * gate).reshape(x.shape)  # (B, T, h, D) -> (B, T, h*D)
            return (x, *args[1:])

        return hook

    @contextmanager
    def differentiable_gates(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Per-example gates of ones, shape (B, layers, heads), with requires_grad.

        Inside the context every forward pass multiplies head h of example b by
        gates[b, layer, h] (times the keep-mask). With a loss summed over examples,
        gates.grad[b] is example b's d loss / d gate, i.e. sum over tokens of
        context_h . d loss / d context_h.
        """
        gates = torch.ones(batch_size, self.num_layers, self.num_heads, device=self.mask.device,
                           requires_grad=True)
        self._gates = gates
        try:
            yield gates
        finally:
            self._gates = None

    # -- convenience -----------------------------------------------------------------------
    def alive(self) -> torch.Tensor:
        """Bool (layers, heads) on the CPU: heads not yet pruned. On the CPU wherever the gates live:
        every decision (policies, budgets, layouts) is made there, beside the scores, which are CPU
        tensors (`scoring.reduce.finish_scores`); the gates follow the model to its device."""
        return (self.mask > 0).cpu()

    def prune(self, heads) -> None:
        """Zero the gates of `heads`, an iterable of (layer, head) in original numbering; for a model
        with several attention stacks also by name ({"encoder": {layer: heads}, ...}, heads.stacks)."""
        heads = rows_request(self.stacks, heads)
        if isinstance(heads, dict):
            heads = [(row, h) for row, ids in heads.items() for h in ids]
        for layer, head in heads:
            self.mask[layer, head] = 0.0

    def heads_per_layer(self) -> list[int]:
        return [int(n) for n in self.alive().sum(dim=1).tolist()]

    def pruned(self) -> list[list[int]]:
        return [[int(l), int(h)] for l, h in (~self.alive()).nonzero().tolist()]

    def sparsity(self) -> float:
        return float((~self.alive()).sum().item()) / self.mask.numel()

    @contextmanager
    def override(self, mask: torch.Tensor) -> Iterator[None]:
        """Temporarily use another keep-mask (e.g. to evaluate a candidate)."""
        saved = self.mask.clone()
        self.mask.copy_(mask)
        try:
            yield
        finally:
            self.mask.copy_(saved)
