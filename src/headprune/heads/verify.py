"""Surgery verifies its result: after `prune_heads` slices heads out of the weights, one tiny forward
of the pruned model must give what the masked model (the same heads gated to zero) gave before the
slicing. A parameter left unsliced (a per-head norm weight, an attention sink, a bias vector an
adapter did not declare) either breaks that forward or changes its result; both are raised here,
as `SurgeryError`, naming the module and the parameters that kept their old head count, before the
pruned model can be saved or exported.

The check costs two forwards of a (1, 8)-token input (an image or audio frame of the model's own
size for vision / speech models). It runs in every `prune_heads` call (every run's physical
removal and export through `deploy.fold`, and the Python API); it is switched off only explicitly:
`prune_heads(..., verify=False)`, `fold(..., verify=False)`, or `pruning.verify_surgery=false` for
a run (`set_verify`). Loading a saved layout (`deploy.hf.load_pruned`) has no masked model to
compare with and does not verify.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)

VERIFY_ATTR = "headprune_verify_surgery"  # False on a model whose surgery a run asked not to verify
TOKENS = 8
# max |pruned - masked| allowed, times the outputs' scale (the largest |masked|, at least 1): the
# sliced projections sum the same products in another order (a few ulps of the dtype)
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class SurgeryError(RuntimeError):
    """The pruned model does not compute what the masked model computes."""


def set_verify(model: nn.Module, verify: bool) -> nn.Module:
    """Whether `prune_heads` verifies its surgery on `model` when not told (`pruning.verify_surgery`)."""
    setattr(model, VERIFY_ATTR, bool(verify))
    return model


def wanted(model: nn.Module, verify: bool | None) -> bool:
    """`verify` when given, else the model's setting (`set_verify`), else True; never on a model whose
    weights are not materialised (meta tensors, inside `from_pretrained`)."""
    if verify is None:
        verify = getattr(model, VERIFY_ATTR, True)
    return bool(verify) and not any(p.is_meta for p in model.parameters())


def probe_inputs(model: nn.Module) -> dict | None:
    """A one-example batch of the model's main input (token ids, an image, audio features), plus
    decoder ids for an encoder-decoder, on the model's device; None when the input is not one of those."""
    param = next(model.parameters())
    config = model.config
    g = torch.Generator().manual_seed(0)
    name = getattr(model, "main_input_name", "input_ids")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 16
    ids = torch.randint(min(3, vocab - 1), vocab, (1, TOKENS), generator=g)  # (1, T)
    if name == "input_ids":
        batch = {"input_ids": ids}
    elif name == "input_features" and hasattr(config, "num_mel_bins") and hasattr(config, "max_source_positions"):
        batch = {"input_features": torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions, generator=g)}
    elif name == "pixel_values":
        vision = getattr(config, "vision_config", config)
        size, channels = getattr(vision, "image_size", 32), getattr(vision, "num_channels", 3)
        size = size if isinstance(size, int) else size[0]
        batch = {"pixel_values": torch.randn(1, channels, size, size, generator=g)}
    else:
        return None
    if getattr(config, "is_encoder_decoder", False):
        batch["decoder_input_ids"] = ids[:, :4]
    return {k: v.to(param.device, dtype=param.dtype if v.is_floating_point() else v.dtype) for k, v in batch.items()}


def _output(out) -> torch.Tensor:
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value.float()
    return (out[0] if isinstance(out, (tuple, list)) else out).float()


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) with the RNG untouched, as it was afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training


@contextmanager
def _tracked(model: nn.Module, attention: dict[str, nn.Module]) -> Iterator[tuple[list[str], dict[str, torch.Tensor]]]:
    """While inside: the names of the modules whose forward has begun and not ended (on an exception,
    the last is where it was raised), and each attention module's output by name."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    outputs: dict[str, torch.Tensor] = {}
    handles = []

    def enter(module, args):
        stack.append(names.get(id(module), type(module).__name__))

    def leave(module, args, out):
        if stack:
            stack.pop()

    def keep(name):
        def hook(module, args, out):
            first = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(first, torch.Tensor):
                outputs[name] = first.detach().float().clone()
        return hook

    for module in model.modules():
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    for name, module in attention.items():
        handles.append(module.register_forward_hook(keep(name)))
    try:
        yield stack, outputs
    finally:
        for handle in handles:
            handle.remove()


def _differ(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> str:
    """'' when `got` equals `want` to `tolerance` x their scale, else how they differ."""
    if got.shape != want.shape:
        return f"output shape {tuple(got.shape)} != the masked model's {tuple(want.shape)}"
    if not torch.equal(torch.isnan(got), torch.isnan(want)):
        return "NaN where the masked model has none"
    finite = ~torch.isnan(want)
    if not bool(finite.any()):
        return ""
    diff = (got - want).abs()[finite].max().item()
    allowed = tolerance * max(1.0, want[finite].abs().max().item())
    return "" if diff <= allowed else f"max |pruned - masked| {diff:.3g} > {allowed:.3g}"


class SurgeryProbe:
    """One verification: `before(model, request)` runs the masked forward (the heads of `request`,
    rows -> head ids, gated to zero) and notes each pruned layer's attention parameters; `after(model)`
    runs the pruned forward and raises `SurgeryError` when it fails or differs."""

    def __init__(self, model: nn.Module, adapter, request: dict[int, set[int]]):
        from headprune.heads.adapters import head_layout

        self.adapter, self.request = adapter, {k: v for k, v in request.items() if v}
        self.batch = probe_inputs(model)
        blocks = adapter.blocks(model)
        names = {id(m): n for n, m in model.named_modules()}
        layout = head_layout(model)
        self.attention = {names[id(adapter.attention(blocks[layer]))]: layer for layer in self.request}
        # each pruned layer's parameters before the slicing, and the head counts they may carry
        self.shapes: dict[str, dict[str, tuple]] = {}
        self.counts: dict[str, set[int]] = {}
        d = adapter.head_dim(model.config)
        for name, layer in self.attention.items():
            module = model.get_submodule(name)
            self.shapes[name] = {p: tuple(t.shape) for p, t in module.named_parameters()}
            before = [h for h in layout[layer]]
            after = [h for h in before if h not in self.request[layer]]
            kv_before, kv_after = len(adapter.kv_groups(model.config, before)), len(adapter.kv_groups(model.config,
                                                                                                        after))
            self.counts[name] = {n for n, m in ((len(before), len(after)), (len(before) * d, len(after) * d),
                                                (kv_before, kv_after), (kv_before * d, kv_after * d)) if n != m}
        self.want: torch.Tensor | None = None
        self.want_layers: dict[str, torch.Tensor] = {}
        self.skipped = ""

    def before(self, model: nn.Module) -> None:
        from headprune.heads.mask import HeadMask

        if self.batch is None:
            self.skipped = f"no probe input for main_input_name={getattr(model, 'main_input_name', None)!r}"
            return
        mask = HeadMask.for_model(model)
        for layer, heads in self.request.items():
            for head in heads:
                mask.mask[layer, head] = 0.0
        mask.to(next(model.parameters()).device)
        try:
            with _eval_mode(model), _tracked(model, self._modules(model)) as (_, layers):
                self.want = _output(model(**self.batch))
                self.want_layers = dict(layers)
        except Exception as err:  # noqa: BLE001 - the unpruned model's own limits are not the surgery's
            self.skipped = f"the masked model's probe forward raised {type(err).__name__}: {err}"
        finally:
            mask.detach()

    def after(self, model: nn.Module) -> None:
        if self.skipped or self.want is None:
            log.warning("prune_heads could not verify its surgery on %s (%s)", type(model).__name__, self.skipped)
            return
        tolerance = TOLERANCE.get(next(model.parameters()).dtype, 1e-4)
        with _eval_mode(model), _tracked(model, self._modules(model)) as (stack, layers):
            try:
                got = _output(model(**self.batch))
            except Exception as err:  # noqa: BLE001 - any failure of the pruned forward is the surgery's
                where = stack[-1] if stack else type(model).__name__
                raise SurgeryError(f"prune_heads left a model whose forward fails in {where or 'the model'} "
                                   f"({type(err).__name__}: {err}){self._unsliced(model, where)}; "
                                   f"{_ADVICE}") from err
        problem = _differ(got, self.want, tolerance)
        if problem:
            where = next((name for name in self.attention if name in layers and name in self.want_layers
                          and _differ(layers[name], self.want_layers[name], tolerance)), None)
            raise SurgeryError(f"prune_heads left a model that does not compute what the masked model computes "
                               f"({problem}; first differing attention module: {where or 'none of the pruned ones'})"
                               f"{self._unsliced(model, where)}; {_ADVICE}")

    def _modules(self, model: nn.Module) -> dict[str, nn.Module]:
        return {name: model.get_submodule(name) for name in self.attention}

    def _unsliced(self, model: nn.Module, where: str | None) -> str:
        """', parameter(s) left unsliced: ...' for the pruned layers' parameters that kept a head count
        their layer no longer has (those of the module `where` first)."""
        found = []
        order = sorted(self.shapes, key=lambda name: not (where and (where.startswith(name) or name.startswith(where))))
        for name in order:
            module = model.get_submodule(name)
            for pname, tensor in module.named_parameters():
                shape = tuple(tensor.shape)
                if self.shapes[name].get(pname) == shape and self.counts[name] & set(shape):
                    found.append(f"{name}.{pname} {list(shape)}")
        if not found:
            return f" (in {where})" if where else ""
        return f"; parameter(s) left unsliced, still sized for the layer's heads before pruning: {', '.join(found)}"


_ADVICE = ("the model is not saved or exported. The family's ArchAdapter (heads/adapters.py) must name every per-head "
           "parameter (head_params, head_vectors, head_columns, projection norms); prune_heads(..., verify=False) / "
           "pruning.verify_surgery=false switch this check off")
