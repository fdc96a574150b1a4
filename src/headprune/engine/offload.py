"""The run's frozen unpruned copy kept in host memory, its blocks brought to the device one at a time.

Why: the dense copy (the distillation teacher, the reconstructions' targets, the measured
allocation's reference) doubles what a run holds on its accelerator. With `pruning.dense_device=cpu`
the copy is made straight into host memory (never a second full model on the device, even for a
moment); its small modules (embeddings, final norm, head, rotary tables) sit on the device, and each
transformer block moves to the device right before it runs and back right after (forward pre/post
hooks), so the device holds the pruned model plus one dense block. Everything that runs the copy
(a forward, `recovery.blockwise.run_block` in refit / least squares / bias compensation, the
teacher's logits) goes through the blocks' `__call__`, so it needs no change. The copy never
trains, so moving its blocks loses nothing.

On a CPU run home and device are the same and the moves are no-ops; the residency trace
(`BlockOffload.resident`, `peak_resident`) is what the tests check there.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from headprune.heads.adapters import get_adapter

OFFLOAD_ATTR = "_headprune_offload"
DENSE_DEVICES = ("run", "cpu")


def check_dense_device(value: str, budget_kind: str) -> None:
    """`pruning.dense_device`: refused before any work when unknown, or with a budget whose dense
    model is timed (streamed blocks would time the transfers)."""
    if value not in DENSE_DEVICES:
        raise ValueError(f"pruning.dense_device={value!r} is not allowed; allowed: run (the dense copy on the run's "
                         "device), cpu (in host memory, one block at a time on the device)")
    if value == "cpu" and budget_kind == "latency":
        raise ValueError("pruning.dense_device=cpu streams the dense copy's blocks to the device, so budget=latency "
                         "would time the transfers; allowed: pruning.dense_device=run with budget=latency")


def host_copy(model: nn.Module, home: torch.device | str = "cpu") -> nn.Module:
    """A deep copy of `model` whose parameters and buffers are made directly on `home`: the device
    never holds a second full copy. Gradients are not copied."""
    home = torch.device(home)
    memo: dict = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        data = tensor.detach().to(home, copy=True)
        memo[id(tensor)] = nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
    return copy.deepcopy(model, memo)


class BlockOffload:
    """Hooks that keep `model`'s blocks on `home` except while one runs on `device` (module doc).

    `resident`: the blocks on the device now; `peak_resident`: the most at once since
    installation (1 when the hooks work); `moves`: blocks brought to the device."""

    def __init__(self, model: nn.Module, device: torch.device | str, home: torch.device | str = "cpu"):
        self.device, self.home = torch.device(device), torch.device(home)
        self.blocks = get_adapter(model).blocks(model)
        self.resident: set[int] = set()
        self.peak_resident = 0
        self.moves = 0
        in_blocks = {id(p) for block in self.blocks for p in [*block.parameters(), *block.buffers()]}
        for module in model.modules():  # the small modules outside the blocks live on the device
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in in_blocks:
                    param.data = param.data.to(self.device)
            for name, buf in list(module.named_buffers(recurse=False)):
                if id(buf) not in in_blocks:
                    module._buffers[name] = buf.to(self.device)
        for block in self.blocks:
            block.to(self.home)
        self.handles = []
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(self._arrive(i)))
            # always_call: also when the forward raises (a reconstruction stops a block early)
            self.handles.append(block.register_forward_hook(self._leave(i), always_call=True))
        setattr(model, OFFLOAD_ATTR, self)

    def _arrive(self, i: int):
        def hook(block, args):
            for j in list(self.resident - {i}):  # a block left by an interrupted forward goes first
                self.blocks[j].to(self.home)
                self.resident.discard(j)
            block.to(self.device)
            self.resident.add(i)
            self.moves += 1
            self.peak_resident = max(self.peak_resident, len(self.resident))
        return hook

    def _leave(self, i: int):
        def hook(block, args, output):
            block.to(self.home)
            self.resident.discard(i)
        return hook


def offload_of(model: nn.Module) -> BlockOffload | None:
    return getattr(model, OFFLOAD_ATTR, None)


def compute_device(model: nn.Module) -> torch.device:
    """Where `model` computes: its offload's device, else its first parameter's."""
    offload = offload_of(model)
    return offload.device if offload is not None else next(model.parameters()).device


def hold_dense(dense: nn.Module, device: torch.device, dtype: torch.dtype, where: str) -> nn.Module:
    """`dense` (a frozen unpruned copy, e.g. a reloaded teacher) placed as `pruning.dense_device`
    says: on `device` (`run`), or in host memory with its blocks streamed (`cpu`)."""
    dense = dense.to(dtype=dtype).eval().requires_grad_(False)
    if where == "cpu":
        BlockOffload(dense.to("cpu"), device)
        return dense
    return dense.to(device)


def dense_copy(model: nn.Module, where: str) -> nn.Module:
    """A frozen copy of `model` as `pruning.dense_device` says, made without a second full model on
    the device when `cpu`."""
    if where == "cpu":
        dense = host_copy(model).eval().requires_grad_(False)
        BlockOffload(dense, compute_device(model))
        return dense
    return copy.deepcopy(model).eval().requires_grad_(False)
