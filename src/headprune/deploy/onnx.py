"""ONNX export of (physically pruned) models, with the exporter torch recommends (the
`torch.export`-based one, `torch.onnx.export(..., dynamo=True)`), checked against PyTorch with
ONNX Runtime.

Inputs are `input_ids` and `attention_mask` (and `token_type_ids` for BERT-family encoders whose
config has segment embeddings), with dynamic batch and sequence axes; the output is `logits`:
(batch, classes) for sequence classification, (batch, seq, vocab) for a causal LM. Uneven heads
per layer and layers with no heads left export like any other model: after `prune_heads` they
are plain smaller matrices. This graph has no KV cache (`use_cache=False`: each call reruns the
whole sequence); a causal LM's decode graph with past key/values is deploy/onnx_decode.py's.
Per-unit KV windows (`heads.windows`) attached to a causal LM are in this graph too, as per-head
masks (`export_onnx`); in the decode graph they keep fixed-size rings (deploy/onnx_ring.py).

`check_onnx` measures how ONNX Runtime's logits agree with PyTorch's (`agreement`: max abs
diff, that relative to max |logit|, argmax agreement) and `judge` applies the bounds (module
constants below, headprune-export's options). Needs the `onnx` extra (`pip install
"headprune[onnx]"`: onnx, onnxruntime, onnxscript).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
from torch import nn

from headprune.heads.stacks import stacked
from headprune.heads.latent import onnx_refusal
from headprune.heads.windowed_attention import per_head_masks
from headprune.tasks import CAUSAL_LM, Task, task_for


class _Logits(nn.Module):
    """The model as a function of tensors to logits (no cache, no output dataclass)."""

    def __init__(self, model: nn.Module, task: Task):
        super().__init__()
        self.model = model
        self.extra = dict(task.forward_options)  # a causal LM runs without its KV cache

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
    """Write `model` as ONNX to `path` (dynamic batch and sequence axes); returns the path. The
    graph runs the forward of the task the saved model's head does (`task_for`, read once here).
    KV windows attached (`heads.windows`): the graph computes them, each windowed layer under one
    per-head mask (`per_head_masks`: the banded chunks loop over the sequence, which torch.export
    cannot trace with a dynamic length); the decode graph with a cache keeps their
    units' keys in fixed-size rings (`deploy.onnx_decode`)."""
    latent = onnx_refusal(model, "forward")
    if latent:
        raise ValueError(latent)
    if stacked(model) is not None:
        raise ValueError(f"ONNX export of {type(model).__name__} refused: an encoder-decoder (several attention "
                         "stacks) needs an encoder graph and a decoder graph with its self- and cross-attention "
                         "caches, and this exporter traces one forward over input_ids / attention_mask; allowed: "
                         "models with one attention stack")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = input_names(model)
    example = example_inputs(model, batch, seq)
    wrapper = _Logits(model.eval(), task_for(model)).eval()
    dynamic = {name: {0: "batch", 1: "seq"} for name in names}
    with warnings.catch_warnings(), torch.no_grad(), per_head_masks(model):
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


# The agreement rule: `agreement` measures, `judge` applies the bounds (headprune-export's
# --tolerance, --rel-tolerance, --min-argmax-agreement; these are their defaults). The relative
# bound is the working one; the absolute one is a ceiling for logits so large that 1e-4 of them
# would hide a real error. Measured on the pruned SmolLM2-135M (30 layers, float32, logits up to
# ~30): 6.6e-4 on the full graph, 1.0e-3 on the decode steps (rel 2e-5 / 3.4e-5), so a 1e-3
# ceiling failed correct exports (experiments/llm_kv/onnx/abs_1e-3/).
ABS_TOLERANCE = 1e-2
REL_TOLERANCE = 1e-4
MIN_ARGMAX_AGREEMENT = 1.0


def agreement(got: torch.Tensor, want: torch.Tensor) -> dict:
    """How ONNX Runtime's logits `got` agree with PyTorch's `want`, both (..., classes or vocab),
    holding only the positions that are compared (causal LM: real tokens):

    - `max_abs_diff`: max |got - want|;
    - `logit_scale`: max |want|, and `rel_diff` = max_abs_diff / logit_scale (the difference
      against the size of the logits, which grows with depth and width: a 30-layer float32
      decoder differs by ~1e-4 in absolute terms with logits of tens);
    - `argmax_agreement`: the fraction of the `positions` whose argmax (class, next token) is
      the same in both, and `min_top2_margin`, the smallest gap between PyTorch's two largest
      logits (a disagreement where it is below 2 x max_abs_diff is a near-tie).

    A figure that is not a finite number (NaN in the logits; rel_diff with all-zero PyTorch
    logits) is None, and `finite` is False then: results files are strict JSON."""
    got, want = got.float().reshape(-1, got.shape[-1]), want.float().reshape(-1, want.shape[-1])
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    same = got.argmax(-1) == want.argmax(-1)
    top2 = want.topk(2, dim=-1).values if want.shape[-1] > 1 and want.shape[0] else None
    finite = all(math.isfinite(x) for x in (diff, scale, rel))
    diff, scale, rel = (x if math.isfinite(x) else None for x in (diff, scale, rel))
    return {"finite": finite, "max_abs_diff": diff, "logit_scale": scale, "rel_diff": rel,
            "argmax_agreement": float(same.float().mean()) if same.numel() else 1.0, "positions": int(same.numel()),
            "min_top2_margin": float((top2[:, 0] - top2[:, 1]).min()) if top2 is not None else None}


def judge(figures: dict, tolerance: float = ABS_TOLERANCE, rel_tolerance: float = REL_TOLERANCE,
          min_argmax: float = MIN_ARGMAX_AGREEMENT) -> list[str]:
    """The bounds `figures` (from `agreement`) break, one line each; empty when it passes. Passing
    means all of: max_abs_diff <= `tolerance` (an absolute ceiling), rel_diff <= `rel_tolerance`,
    argmax_agreement >= `min_argmax` (default 1.0: every argmax equal). A figure `figures`
    lacks is not judged."""
    failures = [] if figures.get("finite", True) else [
        f"a figure is not finite (max_abs_diff {figures.get('max_abs_diff')}, rel_diff {figures.get('rel_diff')}): "
        "NaN or infinite logits, or all-zero PyTorch logits with a difference"]
    diff, rel, argmax = figures.get("max_abs_diff"), figures.get("rel_diff"), figures.get("argmax_agreement")
    if diff is not None and not diff <= tolerance:
        failures.append(f"max_abs_diff {diff:.3g} exceeds --tolerance {tolerance:g}")
    if rel is not None and not rel <= rel_tolerance:
        failures.append(f"rel_diff {rel:.3g} (max_abs_diff / max |PyTorch logit| {figures.get('logit_scale', 0):.4g}) "
                        f"exceeds --rel-tolerance {rel_tolerance:g}")
    if argmax is not None and not argmax >= min_argmax:
        failures.append(f"argmax_agreement {argmax:.4f} over {figures.get('positions')} positions (smallest PyTorch "
                        f"top-2 margin {figures.get('min_top2_margin')}) is below --min-argmax-agreement {min_argmax:g}")
    return failures


@torch.no_grad()
def check_onnx(model: nn.Module, path: str | Path, batch: int = 3, seq: int = 11, seed: int = 1) -> dict:
    """`agreement` of ONNX Runtime's and PyTorch's logits on a batch of another shape than the
    export's (causal LM: on real tokens only; padded positions are not defined)."""
    example = example_inputs(model, batch, seq, seed)
    session = onnx_session(path)
    got = torch.from_numpy(session.run(None, {k: v.cpu().numpy() for k, v in example.items()})[0])
    shape = list(got.shape)
    want = model.eval()(**example).logits.float().cpu()
    if task_for(model) is CAUSAL_LM:  # the export of a saved model: its head says what it computes
        real = example["attention_mask"].bool().cpu()
        got, want = got[real], want[real]
    return {**agreement(got, want), "batch": batch, "seq": seq, "logits_shape": shape}
