"""Running a model one block at a time on calibration batches.

A layer-by-layer reconstruction (least-squares mask tuning) needs each layer's inputs on every
calibration batch. Re-running the model from the embeddings for every layer costs L^2 / 2
blocks; keeping every layer's outputs costs L x tokens x hidden floats. Instead the hidden
states of one layer are carried forward: `capture` runs the model only as far as its first block,
with every block replaced by a pass-through that records what the model hands it (the embeddings,
masks, rotary position embeddings, ...), and `run_block` then runs one real block on carried
hidden states with those arguments. Cache arguments are dropped, so a block may run twice on the
same input (once up to its output projection, once whole) without seeing its own keys again.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from headprune.engine.offload import PASS_THROUGH
from headprune.heads.adapters import get_adapter, num_features
from headprune.tasks import MODEL_INPUTS, to_device

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def calibration_batches(loader, device, max_batches: int | None, what: str) -> list[dict]:
    """The first `max_batches` batches of `loader` (all when None) on `device`, held in memory: a
    layer-by-layer reconstruction visits every batch once per layer. `what` names the stage in the
    error when there are none."""
    raw = [to_device(b, device) for i, b in enumerate(loader) if max_batches is None or i < max_batches]
    if not raw:
        raise ValueError(f"{what} got no calibration examples (data.score_samples=0?)")
    return raw


@contextmanager
def eval_mode(*models: nn.Module):
    """Every model in eval mode (no dropout) for the block; each one's previous mode restored after."""
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)


class Stop(Exception):
    """Raised by a hook to end a forward pass once what it needed has been seen."""


@dataclass
class BlockInputs:
    """What one calibration batch feeds the blocks: the embeddings (B, T, E) that enter block 0,
    and per block the arguments after the hidden states by name (masks, position embeddings)."""

    hidden: torch.Tensor  # (B, T, E)
    kwargs: list[dict]


@torch.no_grad()
def capture(model: nn.Module, batch: dict) -> BlockInputs:
    """Run `model` on `batch` up to its first block and record every block's inputs (module
    docstring); no block computes anything. A hybrid's attention-free layers sit between its
    attention blocks, which running block by block would skip: refused (`heads.hybrid`)."""
    from headprune.heads.hybrid import blockwise_refusal

    refusal = blockwise_refusal(model, "block-by-block calibration", "whole-forward methods")
    if refusal:
        raise ValueError(refusal)
    blocks = get_adapter(model).blocks(model)
    seen: list[tuple[tuple, dict]] = []

    def pass_through(*args, **kwargs):
        hidden, kwargs = _by_name(blocks[len(seen)], args, kwargs)
        seen.append((hidden, kwargs))
        if len(seen) == len(blocks):
            raise Stop
        return hidden

    setattr(pass_through, PASS_THROUGH, True)  # a streamed model leaves its blocks home (engine.offload)
    for block in blocks:
        block.forward = pass_through  # the instance attribute shadows the class's forward
    try:
        model(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
    except Stop:
        pass
    finally:
        for block in blocks:
            del block.forward
    if len(seen) != len(blocks):
        raise RuntimeError(f"{type(model).__name__}: capture saw {len(seen)} of {len(blocks)} blocks; the model's "
                           "forward does not call each block once on its hidden states")
    return BlockInputs(seen[0][0], [kwargs for _, kwargs in seen])


def blockwise_problem(model: nn.Module, what: str, allowed: str = "recovery=none, finetune, distill or lora") -> str:
    """Why `what` (a method that carries hidden states block by block: least squares, refit) cannot
    run on `model`, or '': a hybrid (`heads.hybrid.blockwise_refusal`), a model with several attention
    stacks (an encoder-decoder's blocks are not one chain), or one whose forward does not call each
    block once on the previous block's hidden states (DeBERTa's encoder unpacks each layer's output).
    The last is found by `capture` on a one-example probe (`heads.verify.probe_inputs`): no block
    computes anything, the model is left as it was."""
    from headprune.heads.hybrid import blockwise_refusal
    from headprune.heads.stacks import StackedAdapter
    from headprune.heads.verify import probe_inputs

    refusal = blockwise_refusal(model, what, allowed)
    if refusal:
        return refusal
    model_type = getattr(model.config, "model_type", None)
    if isinstance(get_adapter(model), StackedAdapter):
        return (f"{what} carries one chain of blocks, but model_type={model_type!r} has several attention stacks "
                f"(encoder and decoder); allowed there: {allowed}")
    batch = probe_inputs(model)
    if batch is None:
        return ""
    try:
        with eval_mode(model):
            capture(model, {**batch, "attention_mask": torch.ones_like(batch["input_ids"])} if "input_ids" in batch
                    else batch)
    except Exception as err:  # noqa: BLE001 - any failure means the blocks cannot be replayed one by one
        return (f"{what} runs the model block by block, but the forward of model_type={model_type!r} does not call its "
                f"blocks one after another on one hidden state ({type(err).__name__}: {err}); allowed there: {allowed}")
    return ""


def run_block(model: nn.Module, layer: int, inputs: BlockInputs, hidden: torch.Tensor) -> torch.Tensor:
    """Block `layer` of `model` on `hidden` (B, T, E) with the batch's recorded arguments."""
    out = get_adapter(model).blocks(model)[layer](hidden, **inputs.kwargs[layer])
    return out[0] if isinstance(out, tuple) else out  # (B, T, E)


def _by_name(block: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
    """(hidden states, every other argument by name with caches dropped) of one block call
    (GPT-2 passes its cache positionally)."""
    signature = inspect.signature(type(block).forward)
    bound = signature.bind(block, *args, **kwargs).arguments
    names = list(signature.parameters)
    named: dict = {}
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise RuntimeError(f"{type(block).__name__} got {len(value)} unnamed extra arguments; cannot replay them")
        elif name != names[0]:  # not self
            named[name] = value
    hidden = named.pop(names[1])
    named = {k: (None if k in CACHE_KWARGS else v) for k, v in named.items()}
    if "use_cache" in named:
        named["use_cache"] = False
    return hidden, named


def block_with_out_proj(model: nn.Module, layer: int, inputs: BlockInputs, hidden: torch.Tensor,
                        stop: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block `layer` of `model` on `hidden`: (its attention output projection's output (B, T, E),
    the block's output (B, T, E), or None with `stop`: the block ends right after the projection). A
    layer with no heads left outputs its projection's bias (zeros without one)."""
    o = get_adapter(model).out_proj(get_adapter(model).blocks(model)[layer])
    seen = {}

    def keep(module, args, output):
        seen["o"] = output
        if stop:
            raise Stop

    handle = o.register_forward_hook(keep)
    try:
        next_hidden = run_block(model, layer, inputs, hidden)
    except Stop:
        next_hidden = None
    finally:
        handle.remove()
    if "o" not in seen:  # no heads left (`HeadlessAttention`): the projection never runs, the layer outputs its bias
        bias = getattr(o, "bias", None)
        zeros = hidden.new_zeros(*hidden.shape[:2], num_features(o, outputs=True))  # (B, T, E)
        seen["o"] = zeros + bias if bias is not None else zeros
    return seen["o"], next_hidden


def out_proj_input(model: nn.Module, layer: int, inputs: BlockInputs, hidden: torch.Tensor) -> torch.Tensor:
    """The input of block `layer`'s attention output projection on `hidden`, after every pre-hook
    registered before this call (a HeadMask's gate): (B, T, kept heads x head_dim). The block stops
    there. A layer whose projection never runs (no heads left) is a ValueError."""
    o = get_adapter(model).out_proj(get_adapter(model).blocks(model)[layer])
    seen = {}

    def capture_input(module, args):
        seen["x"] = args[0]
        raise Stop

    handle = o.register_forward_pre_hook(capture_input)
    try:
        run_block(model, layer, inputs, hidden)
    except Stop:
        pass
    finally:
        handle.remove()
    if "x" not in seen:
        raise ValueError(f"layer {layer}: the attention output projection did not run (a layer without heads?)")
    return seen["x"]
