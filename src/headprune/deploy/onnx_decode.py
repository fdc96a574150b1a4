"""ONNX export of a causal LM's decode step with past key/values (the KV cache as graph inputs and
outputs), so a served pruned LLM keeps its smaller cache.

The graph (`export_onnx_decode`):

- inputs: `input_ids` (B, T) int64 (T = the prompt for prefill, 1 per decode step);
  `attention_mask` (B, P + T) int64 over the past and the new tokens (0 = padding);
  `position_ids` (B, T) int64 (HF's convention: `cumsum(attention_mask) - 1`, padding at 0);
  `past_key_values.<i>.key` and `past_key_values.<i>.value` for every layer i:
  (B, kv_heads_kept[i], P, head_dim) float, P = past length (0 for prefill).
- outputs: `logits` (B, T, vocab) and `present.<i>.key` / `present.<i>.value`:
  (B, kv_heads_kept[i], P + T, head_dim), fed back as the next step's past.

Batch, new tokens and past length are dynamic axes (named `batch`, `new_tokens`, `past_len`); each layer's KV head count is the number
of KV heads it kept after pruning (0 for a layer with no heads left: its past stays an empty
(B, 0, P, head_dim) tensor that only counts tokens, see heads/headless.py). One graph serves
prefill (P = 0) and decode (P > 0).

How: `_Decode` turns the explicit past tensors into a transformers `DynamicCache` whose layers
report their length from the token axis (heads/headless.py's `HeadlessCacheLayer`, so the
length is symbolic in the trace and empty layers count too), runs the model with
`use_cache=True` and returns the updated cache's tensors; `torch.onnx.export(..., dynamo=True)`
traces it with `torch.export`. Supported: decoders whose every layer is full attention with a
`DynamicCache` (tested: Llama, Qwen2, GPT-2); sliding-window layers (Mistral's config default) are
refused: their cache layer crops to the window, which this interface does not model.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from headprune.heads.headless import HeadlessCacheLayer
from headprune.heads.latent import onnx_refusal
from headprune.heads.windows import windows_refusal
from headprune.tasks import CAUSAL_LM, task_of

DECODE_INPUTS = ("input_ids", "attention_mask", "position_ids")


def past_names(layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def present_names(layers: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def decode_problem(config) -> str | None:
    """Why a model with this config cannot get a decode graph; None when it can."""
    architectures = list(getattr(config, "architectures", None) or [])
    if task_of(config) is not CAUSAL_LM:  # a check of the saved model's head
        return (f"the model ({', '.join(architectures) or 'no architectures in its config'}) is not a causal LM: "
                "the decode graph (past key/values) is for decoders (ForCausalLM / LMHeadModel); "
                "export an encoder with --onnx alone")
    layer_types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if any(t != "full_attention" for t in layer_types) or (window and not layer_types):
        kinds = f"layer_types {sorted(set(layer_types))}, " if layer_types else ""
        return (f"the model has sliding-window or other non-full-attention layers ({kinds}sliding_window {window}): "
                "the decode graph supports decoders whose every layer is full attention")
    return None


def _cache(past: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache holding `past` (one (keys, values) per layer), its length read from the token axis."""
    cache = DynamicCache()
    for keys, values in past:
        layer = HeadlessCacheLayer()
        layer.device, layer.keys, layer.values, layer.is_initialized = keys.device, keys, values, True
        cache.layers.append(layer)
    return cache


class _Decode(nn.Module):
    """The model as a function of (input_ids, attention_mask, position_ids, *past) to
    (logits, *present), the past flattened as key_0, value_0, key_1, value_1, ..."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = _cache([(past[i], past[i + 1]) for i in range(0, len(past), 2)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True)
        present = out.cache
        flat = []
        for layer in present.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def kv_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(kv_heads_kept, head_dim) of each layer's cache, read from a one-token PyTorch forward."""
    device = next(model.parameters()).device
    ids = torch.full((1, 1), 3, dtype=torch.long, device=device)
    with torch.no_grad():
        cache = model.eval()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).cache
    return [(int(layer.keys.shape[1]), int(layer.keys.shape[3])) for layer in cache.layers]


def empty_past(model: nn.Module, batch: int, past_len: int = 0, shapes=None, seed: int | None = None) -> list[torch.Tensor]:
    """Past tensors for every layer: zeros of length `past_len` (random if `seed` is given)."""
    shapes = shapes or kv_shapes(model)
    param = next(model.parameters())
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = []
    for heads, dim in shapes:
        for _ in range(2):
            t = (torch.randn(batch, heads, past_len, dim, generator=g) if g is not None
                 else torch.zeros(batch, heads, past_len, dim))
            out.append(t.to(device=param.device, dtype=param.dtype))
    return out


def positions(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """HF's position ids for the last `new_tokens` of `attention_mask`: cumsum - 1, padding at 0."""
    pos = attention_mask.long().cumsum(-1) - 1
    pos = pos.masked_fill(attention_mask == 0, 0)
    return pos[:, -new_tokens:]


def export_onnx_decode(model: nn.Module, path: str | Path, batch: int = 2, new: int = 3, past: int = 5) -> Path:
    """Write `model`'s decode step (past key/values in, logits and present key/values out) as ONNX
    to `path`; returns the path. Raises ValueError naming the reason for models it cannot serve."""
    problem = (onnx_refusal(model, "decode") or decode_problem(_config(model))
               or windows_refusal(model, "this decode graph (one cache per layer)"))
    if problem:
        raise ValueError(problem)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    shapes = kv_shapes(model)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, new), generator=g).to(device)
    mask = torch.ones(batch, past + new, dtype=torch.long, device=device)
    mask[0, :2] = 0
    pos = positions(mask, new)
    past_tensors = empty_past(model, batch, past, shapes, seed=1)
    layers = len(shapes)
    batch_, new_, past_ = torch.export.Dim("batch"), torch.export.Dim("new_tokens"), torch.export.Dim("past_len")
    total = torch.export.Dim.DYNAMIC  # the mask's length, past_len + new_tokens (torch.export infers it)
    dynamic = ({0: batch_, 1: new_}, {0: batch_, 1: total}, {0: batch_, 1: new_},
               tuple([{0: batch_, 2: past_}] * (2 * layers)))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Decode(model).eval(), (ids, mask, pos, *past_tensors), str(path), dynamo=True,
                          input_names=[*DECODE_INPUTS, *past_names(layers)],
                          output_names=["logits", *present_names(layers)], dynamic_shapes=dynamic,
                          verbose=False)
    return path


def _config(model: nn.Module):
    """What decode_problem reads of the model's config, the architectures taken from the class when
    the config has none (models built from a config)."""
    from types import SimpleNamespace

    config = model.config
    return SimpleNamespace(architectures=getattr(config, "architectures", None) or [type(model).__name__],
                           layer_types=getattr(config, "layer_types", None),
                           sliding_window=getattr(config, "sliding_window", None))


def _feed(ids, mask, pos, past) -> dict:
    feed = {"input_ids": ids.cpu().numpy(), "attention_mask": mask.cpu().numpy(), "position_ids": pos.cpu().numpy()}
    feed.update({name: t.cpu().numpy() if isinstance(t, torch.Tensor) else t
                 for name, t in zip(past_names(len(past) // 2), past)})
    return feed


@torch.no_grad()
def check_onnx_decode(model: nn.Module, path: str | Path, batch: int = 3, prompt: int = 9, steps: int = 4,
                      seed: int = 2) -> dict:
    """The decode graph in ONNX Runtime against PyTorch with its own DynamicCache: a prefill of
    `prompt` tokens (one row left-padded, empty past) and `steps` greedy decode steps of one token,
    each side feeding back its own argmax and its own cache. Returns deploy/onnx.py's `agreement`
    figures of the prefill (real tokens) and of the decode steps' logits, both sides' greedy
    tokens, the KV heads of every layer's ONNX present and of PyTorch's cache, and the cache's
    bytes per token; `judge_decode` applies the bounds."""
    from headprune.deploy.onnx import agreement, onnx_session

    model = model.eval()
    device = next(model.parameters()).device
    session = onnx_session(path)
    shapes = kv_shapes(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, : prompt // 3] = 0
    real = mask.bool().cpu()
    pos = positions(mask, prompt)

    out = session.run(None, _feed(ids, mask, pos, empty_past(model, batch, 0, shapes)))
    ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=DynamicCache(), use_cache=True)
    prefill = agreement(torch.from_numpy(out[0])[real], ref.logits.float().cpu()[real])
    onnx_heads = [int(out[1 + 2 * i].shape[1]) for i in range(len(shapes))]
    cache = ref.cache
    onnx_tokens, torch_tokens, got, want = [], [], [], []
    onnx_last, torch_last, onnx_mask, torch_mask = out[0][:, -1], ref.logits[:, -1], mask, mask
    for _ in range(steps):
        onnx_next = torch.from_numpy(onnx_last.argmax(-1)).view(batch, 1).to(device)
        torch_next = torch_last.argmax(-1).view(batch, 1)
        onnx_tokens.append(onnx_next.view(-1).tolist())
        torch_tokens.append(torch_next.view(-1).tolist())
        onnx_mask = torch.cat([onnx_mask, torch.ones_like(onnx_next)], 1)
        torch_mask = torch.cat([torch_mask, torch.ones_like(torch_next)], 1)
        out = session.run(None, _feed(onnx_next, onnx_mask, positions(onnx_mask, 1), out[1:]))
        ref = model(input_ids=torch_next, attention_mask=torch_mask, position_ids=positions(torch_mask, 1),
                    cache=cache, use_cache=True)
        cache = ref.cache
        onnx_last, torch_last = out[0][:, -1], ref.logits[:, -1]
        got.append(torch.from_numpy(onnx_last))
        want.append(torch_last.float().cpu())
    itemsize = next(model.parameters()).element_size()
    return {"prefill": prefill, "decode": agreement(torch.cat(got), torch.cat(want)),
            "tokens_equal": onnx_tokens == torch_tokens, "onnx_tokens": onnx_tokens, "torch_tokens": torch_tokens,
            "kv_heads": onnx_heads, "torch_kv_heads": [heads for heads, _ in shapes], "kv_heads_total": sum(onnx_heads),
            "head_dim": shapes[0][1] if shapes else 0,
            "cache_bytes_per_token": sum(2 * heads * dim * itemsize for heads, dim in shapes),
            "past_len_after": prompt + steps, "batch": batch, "prompt": prompt, "steps": steps}


def judge_decode(report: dict, **bounds) -> list[str]:
    """The checks a `check_onnx_decode` report fails, one line each (empty: it passes): the prefill's
    and the decode steps' figures within deploy/onnx.py's `judge` bounds (`bounds`: tolerance,
    rel_tolerance, min_argmax), equal greedy tokens, equal KV heads per layer."""
    from headprune.deploy.onnx import judge

    failures = [f"{part}: {line}" for part in ("prefill", "decode") for line in judge(report[part], **bounds)]
    if not report["tokens_equal"]:
        failures.append(f"greedy tokens differ: ONNX {report['onnx_tokens']} vs PyTorch {report['torch_tokens']}")
    if report["kv_heads"] != report["torch_kv_heads"]:
        failures.append(f"past KV heads per layer differ: ONNX {report['kv_heads']} vs PyTorch {report['torch_kv_heads']}")
    return failures
