"""ONNX export of (physically pruned) models, with the exporter torch recommends (the
`torch.export`-based one, `torch.onnx.export(..., dynamo=True)`), checked against PyTorch with
ONNX Runtime.

Inputs are `input_ids` and `attention_mask` (and `token_type_ids` for BERT-family encoders whose
config has segment embeddings), with dynamic batch and sequence axes; the output is `logits`:
(batch, classes) for sequence classification, (batch, seq, vocab) for a causal LM. Uneven heads
per layer and layers with no heads left export like any other model: after `prune_heads` they
are plain smaller matrices. Decoders are exported without a KV cache (`use_cache=False`): the
transformers cache object is not a type torch.export can trace through cleanly, so past
key/values are not inputs or outputs; each call reruns the whole prompt. Needs the `onnx` extra
(`pip install "headprune[onnx]"`: onnx, onnxruntime, onnxscript).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from headprune.tasks import is_causal_lm


class _Logits(nn.Module):
    """The model as a function of tensors to logits (no cache, no output dataclass)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.extra = {"use_cache": False} if is_causal_lm(model) else {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        segments = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **segments, **self.extra).logits


def input_names(model: nn.Module) -> tuple[str, ...]:
    """The inputs the exported graph takes."""
    segments = getattr(model.config, "type_vocab_size", 0) or 0
    return ("input_ids", "attention_mask", "token_type_ids") if segments > 1 else ("input_ids", "attention_mask")


def example_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids with one left-padded row (padding must be honoured), on the model's device."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1 and seq > 2:
        mask[0, : seq // 4] = 0
    out = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return {name: out[name].to(device) for name in input_names(model)}


def export_onnx(model: nn.Module, path: str | Path, batch: int = 2, seq: int = 16) -> Path:
    """Write `model` as ONNX to `path` (dynamic batch and sequence axes); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = input_names(model)
    example = example_inputs(model, batch, seq)
    wrapper = _Logits(model.eval()).eval()
    dynamic = {name: {0: "batch", 1: "seq"} for name in names}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, tuple(example[n] for n in names), str(path), dynamo=True, input_names=list(names),
                          output_names=["logits"], dynamic_shapes=dynamic, verbose=False)
    return path


def onnx_session(path: str | Path, threads: int | None = None):
    """An ONNX Runtime CPU session (`threads` intra-op threads; None: its default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@torch.no_grad()
def check_onnx(model: nn.Module, path: str | Path, batch: int = 3, seq: int = 11, seed: int = 1) -> dict:
    """Max absolute difference between ONNX Runtime's and PyTorch's logits on a batch of another
    shape than the export's (causal LM: on real tokens only; padded positions are not defined)."""
    example = example_inputs(model, batch, seq, seed)
    session = onnx_session(path)
    got = torch.from_numpy(session.run(None, {k: v.cpu().numpy() for k, v in example.items()})[0])
    want = model.eval()(**example).logits.float().cpu()
    diff = (got - want).abs()
    if diff.dim() == 3:
        diff = diff[example["attention_mask"].bool().cpu()]
    return {"max_abs_diff": float(diff.max()), "batch": batch, "seq": seq, "logits_shape": list(got.shape)}
