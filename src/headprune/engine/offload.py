"""A model kept in host memory, its transformer blocks brought to the device one at a time.

Why: a run holds the pruned model and, for the repairs, a frozen unpruned copy (the distillation
teacher, the reconstructions' targets, the measured allocation's reference); together they double
what the accelerator must hold. Two settings stream them:

- `pruning.dense_device=cpu`: the dense copy is made straight into host memory (never a second
  full model on the device, even for a moment);
- `pruning.model_device=cpu`: the pruned model itself, in runs without training (scoring, the
  allocation, the reconstructions, the evaluations; a model that trains stays on the device).

Either way the model's small modules (embeddings, final norm, head, rotary tables) sit on the
device and each transformer block moves to the device right before it runs and back right after
(forward pre/post hooks, `BlockOffload`), so the device holds one block of each model. Everything
that runs a model (a forward, `recovery.blockwise.run_block`) goes through the blocks' `__call__`
and needs no change. Three things do:

- code that reads or writes a block's weights outside its forward (a reconstruction's solve and
  its in-place writes) does it inside `blocks_held(layer, model, dense)`: the block is on the device
  (pinned, so its own forward does not send it home) and what is written there goes home with it;
- a block whose forward is replaced by a pass-through (`recovery.blockwise.capture`, the measured
  allocation's carried states) computes nothing of its own: `PASS_THROUGH` marks it, and it
  stays home;
- a backward pass (Fisher / Taylor scores: gradients with respect to the head mask) would keep
  every block's device weights alive in the autograd graph until it runs; with `grads=True` the
  graph saves a reference to the home copy instead and fetches it to the device when the backward
  needs it (saved-tensor hooks), one tensor at a time. Under autocast the graph saves the cast
  copies (new tensors), which stay until the backward: headprune's runs without training score in
  the weights' dtype (no autocast around the pipeline), so this does not arise there.

Moving a block keeps its Parameter objects (`Module.to` swaps their `.data`), so code holding a
Parameter sees the home copy once the block left. On a CPU run home and device are the same and
the moves are no-ops; the residency trace (`resident`, `peak_resident`, `moves`) is what the tests
check there, and they replace `transfer` by a copy to see that nothing reads a stale tensor.
"""
from __future__ import annotations

import copy
from collections import Counter
from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
from torch import nn

from headprune.heads.adapters import get_adapter

OFFLOAD_ATTR = "_headprune_offload"
PASS_THROUGH = "_headprune_pass_through"  # set on a function that replaces a block's forward
DENSE_DEVICES = ("run", "cpu")
MODEL_DEVICES = ("run", "cpu")


def check_dense_device(value: str, budget_kind: str) -> None:
    """`pruning.dense_device`: refused before any work when unknown, or with a budget whose dense
    model is timed (streamed blocks would time the transfers)."""
    if value not in DENSE_DEVICES:
        raise ValueError(f"pruning.dense_device={value!r} is not allowed; allowed: run (the dense copy on the run's "
                         "device), cpu (in host memory, one block at a time on the device)")
    if value == "cpu" and budget_kind == "latency":
        raise ValueError("pruning.dense_device=cpu streams the dense copy's blocks to the device, so budget=latency "
                         "would time the transfers; allowed: pruning.dense_device=run with budget=latency")


def check_model_device(value: str, budget_kind: str, training: str | None = None) -> None:
    """`pruning.model_device`: refused before any work when unknown, with budget=latency (the timed
    model would include the transfers), or when the run trains the model (`training` says what
    trains: a streamed block has no device-resident weights an optimizer could step)."""
    if value not in MODEL_DEVICES:
        raise ValueError(f"pruning.model_device={value!r} is not allowed; allowed: run (the pruned model on the "
                         "run's device), cpu (in host memory, one block at a time on the device; runs without training)")
    if value == "cpu" and budget_kind == "latency":
        raise ValueError("pruning.model_device=cpu streams the pruned model's blocks to the device, so budget=latency "
                         "would time the transfers; allowed: pruning.model_device=run with budget=latency")
    if value == "cpu" and training:
        raise ValueError(f"pruning.model_device=cpu streams the pruned model's blocks, which only runs without "
                         f"training, but {training} trains the model; allowed: pruning.model_device=run, or a run "
                         "that trains nothing (schedule epochs 0, a recovery without steps)")


def host_copy(model: nn.Module, home: torch.device | str = "cpu") -> nn.Module:
    """A deep copy of `model` whose parameters and buffers are made directly on `home`: the device
    never holds a second full copy. Gradients are not copied; a streamed model's hooks are not
    copied (the copy is a plain model)."""
    home = torch.device(home)
    with without_offload(model):
        memo: dict = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) in memo:
                continue
            data = tensor.detach().to(home, copy=True)
            memo[id(tensor)] = nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
        return copy.deepcopy(model, memo)


class _Saved:
    """What the autograd graph keeps of a streamed block's weight (`BlockOffload`, `grads=True`):
    where its home copy is and how the saved view sits in it."""

    __slots__ = ("module", "name", "size", "stride", "offset")

    def __init__(self, module: nn.Module, name: str, tensor: torch.Tensor, base: torch.Tensor):
        self.module, self.name = module, name
        self.size, self.stride = tensor.size(), tensor.stride()
        self.offset = tensor.storage_offset() - base.storage_offset()

    def current(self) -> torch.Tensor:
        return self.module._parameters[self.name] if self.name in self.module._parameters else self.module._buffers[self.name]


class BlockOffload:
    """Hooks that keep `model`'s blocks on `home` except while one runs (or is `hold`) on `device`
    (module docstring). `grads`: a backward pass fetches the weights it needs instead of keeping
    every block's device copy alive (set for a model that is scored by gradients).

    `resident`: the blocks on the device now; `peak_resident`: the most at once since
    installation (1 when the hooks work); `moves`: blocks brought to the device."""

    def __init__(self, model: nn.Module, device: torch.device | str, home: torch.device | str = "cpu",
                 grads: bool = False):
        self.model = model
        self.device, self.home, self.grads = torch.device(device), torch.device(home), grads
        self.blocks = get_adapter(model).blocks(model)
        self.resident: set[int] = set()
        self.pinned: Counter = Counter()
        self.peak_resident = 0
        self.moves = 0
        self._saving: dict[int, torch.autograd.graph.saved_tensors_hooks] = {}
        in_blocks = {id(p) for block in self.blocks for p in [*block.parameters(), *block.buffers()]}
        for module in model.modules():  # the small modules outside the blocks live on the device
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in in_blocks:
                    param.data = param.data.to(self.device)
            for name, buf in list(module.named_buffers(recurse=False)):
                if id(buf) not in in_blocks:
                    module._buffers[name] = buf.to(self.device)
        for block in self.blocks:
            self.transfer(block, self.home)
        self.handles: list = []
        self.install()

    def __deepcopy__(self, memo):
        # a deep copy of the model would copy its blocks' hooks, which move the ORIGINAL's blocks
        raise RuntimeError("a streamed model (engine.offload) is copied with host_copy / dense_copy, or inside "
                           "without_offload(model); copy.deepcopy would copy hooks that move the original's blocks")

    # -- installation ---------------------------------------------------------------------------
    def install(self) -> None:
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(self._arrive(i)))
            # always_call: also when the forward raises (a reconstruction stops a block early)
            self.handles.append(block.register_forward_hook(self._leave(i), always_call=True))
        setattr(self.model, OFFLOAD_ATTR, self)

    def uninstall(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if getattr(self.model, OFFLOAD_ATTR, None) is self:
            delattr(self.model, OFFLOAD_ATTR)

    # -- moves ----------------------------------------------------------------------------------
    def transfer(self, block: nn.Module, device: torch.device) -> None:
        """The one place a block travels (tests replace it by a copy to see stale tensors)."""
        block.to(device)

    def bring(self, i: int) -> None:
        """Block i on the device; any other block not held goes home first."""
        for j in list(self.resident - {i}):
            if not self.pinned[j]:
                self.send(j)
        if i not in self.resident:
            self.transfer(self.blocks[i], self.device)
            self.resident.add(i)
            self.moves += 1
            self.peak_resident = max(self.peak_resident, len(self.resident))

    def send(self, i: int) -> None:
        if i in self.resident:
            self.transfer(self.blocks[i], self.home)
            self.resident.discard(i)

    @contextmanager
    def hold(self, i: int) -> Iterator[nn.Module]:
        """Block i on the device for the whole context, its own forwards included (pinned); what is
        written to its weights inside goes home with it at the end."""
        self.pinned[i] += 1
        try:
            self.bring(i)
            yield self.blocks[i]
        finally:
            self.pinned[i] -= 1
            if not self.pinned[i]:
                del self.pinned[i]
                self.send(i)

    # -- hooks ----------------------------------------------------------------------------------
    def _arrive(self, i: int):
        def hook(block, args):
            if getattr(block.forward, PASS_THROUGH, False):  # replaced by a pass-through: computes nothing
                return
            self.bring(i)
            if self.grads and torch.is_grad_enabled() and i not in self._saving:
                saving = torch.autograd.graph.saved_tensors_hooks(*self._graph_refs(block))
                saving.__enter__()
                self._saving[i] = saving
        return hook

    def _leave(self, i: int):
        def hook(block, args, output):
            saving = self._saving.pop(i, None)
            if saving is not None:
                saving.__exit__(None, None, None)
            if not self.pinned[i]:
                self.send(i)
        return hook

    def _graph_refs(self, block: nn.Module):
        """(pack, unpack) for the autograd graph of one block's forward: a saved tensor that is a
        view of one of the block's parameters or buffers is kept as a reference to it (`_Saved`)
        and fetched to the device when the backward unpacks it; anything else is kept as it is."""
        owners = {}
        for module in block.modules():
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None and tensor.device.type != "meta":
                    owners[tensor.untyped_storage().data_ptr()] = (module, name, tensor)

        def pack(tensor):
            if tensor.layout != torch.strided or tensor.device.type == "meta":
                return tensor
            owner = owners.get(tensor.untyped_storage().data_ptr())
            if owner is None or owner[2].dtype != tensor.dtype:
                return tensor
            return _Saved(owner[0], owner[1], tensor, owner[2])

        def unpack(saved):
            if not isinstance(saved, _Saved):
                return saved
            base = saved.current().detach().to(self.device)
            return base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)
        return pack, unpack


def offload_of(model: nn.Module) -> BlockOffload | None:
    return getattr(model, OFFLOAD_ATTR, None)


@contextmanager
def without_offload(model: nn.Module) -> Iterator[None]:
    """`model` without its offload hooks inside the context (a deep copy made there is a plain
    model, not one whose hooks move the original's blocks); reinstalled after."""
    offload = offload_of(model)
    if offload is None:
        yield
        return
    if offload.resident:
        raise RuntimeError(f"blocks {sorted(offload.resident)} are on the device; copy the model between forwards")
    offload.uninstall()
    try:
        yield
    finally:
        offload.install()


@contextmanager
def blocks_held(layer: int, *models: nn.Module) -> Iterator[None]:
    """Block `layer` of every streamed model among `models` on the device for the context (a
    reconstruction reads and writes its weights there); a no-op for models not streamed."""
    with ExitStack() as stack:
        for model in models:
            offload = offload_of(model) if model is not None else None
            if offload is not None:
                stack.enter_context(offload.hold(layer))
        yield


def compute_device(model: nn.Module) -> torch.device:
    """Where `model` computes: its offload's device, else its first parameter's."""
    offload = offload_of(model)
    return offload.device if offload is not None else next(model.parameters()).device


def residency(model: nn.Module) -> dict:
    """results.json's record of a streamed model's blocks: how many, the most on the device at once
    during the run, and how many times one was brought there ({} when not streamed)."""
    offload = offload_of(model)
    if offload is None:
        return {}
    return {"blocks": len(offload.blocks), "peak_resident_blocks": offload.peak_resident, "block_moves": offload.moves}


def device_bytes(model: nn.Module) -> int:
    """The most bytes of `model`'s weights (parameters and buffers, shared ones once) on its device
    at once: all of them when not streamed; streamed, the small modules plus the residency trace's
    peak number of blocks at the largest block's size (what an accelerator would hold of it)."""
    def size(tensors) -> int:
        seen = {id(t): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in seen.values())

    everything = [*model.parameters(), *model.buffers()]
    offload = offload_of(model)
    if offload is None:
        return size(everything)
    in_blocks = {id(t) for block in offload.blocks for t in [*block.parameters(), *block.buffers()]}
    small = size(t for t in everything if id(t) not in in_blocks)
    largest = max(size([*block.parameters(), *block.buffers()]) for block in offload.blocks)
    return small + offload.peak_resident * largest


def stream_model(model: nn.Module, device: torch.device | str | None = None) -> BlockOffload:
    """`pruning.model_device=cpu`: `model`'s blocks in host memory, streamed to `device` (None:
    where its first parameter is), its backward passes fetching weights as they need them. An
    already streamed model keeps its offload."""
    offload = offload_of(model)
    if offload is not None:
        return offload
    return BlockOffload(model, device if device is not None else next(model.parameters()).device, grads=True)


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
    the device when `cpu`; with `run`, whole on the device `model` computes on (also when `model`
    itself is streamed)."""
    if where == "cpu":
        dense = host_copy(model).eval().requires_grad_(False)
        BlockOffload(dense, compute_device(model))
        return dense
    with without_offload(model):
        dense = copy.deepcopy(model)
    return dense.to(compute_device(model)).eval().requires_grad_(False)
