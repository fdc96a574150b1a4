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
- KV windows attached (heads/windows.py): in a layer with windowed units `<i>.key` / `<i>.value`
  hold its full units' KV heads only, and `past_key_values.<i>.window_key` / `.window_value`
  (B, windowed KV heads, sink + window, head_dim) its windowed units' fixed-size ring, with one
  `past_window_slots` (B, sink + window) int64 for every ring (which token each entry of each row
  holds; `EMPTY_SLOT` unused; a left-padded row's sinks are its first real tokens);
  `present.<i>.window_key` / `.window_value` / `present.window_slots` come
  back the same size (deploy/onnx_ring.py). A prefill starts from `empty_past` (every entry unused).

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
from headprune.deploy.onnx_ring import RingCacheLayer
from headprune.heads.windowed_attention import EMPTY_SLOT
from headprune.heads.layout import WINDOW, Layout
from headprune.heads.windows import KVWindows, WindowedCacheLayer
from headprune.tasks import CAUSAL_LM, task_of

DECODE_INPUTS = ("input_ids", "attention_mask", "position_ids")


def _cache_names(prefix: str, slots: str, layers: int, rings) -> list[str]:
    names = []
    for i in range(layers):
        names += [f"{prefix}.{i}.{kind}" for kind in (("key", "value", "window_key", "window_value") if i in rings
                                                       else ("key", "value"))]
    return names + ([slots] if rings else [])


def past_names(layers: int, rings=()) -> list[str]:
    """The past inputs in graph order: each layer's key and value (and its ring's, for the layers in
    `rings`), then `past_window_slots` when there are rings."""
    return _cache_names("past_key_values", "past_window_slots", layers, rings)


def present_names(layers: int, rings=()) -> list[str]:
    """The present outputs, in the order of `past_names`."""
    return _cache_names("present", "present.window_slots", layers, rings)


def rings_of(model: nn.Module) -> tuple[dict[int, list[bool]], int, int]:
    """({layer: per kept KV head, whether its unit is windowed} for the layers with windowed units,
    sink, window) of the model's layout (`heads.layout.Layout.of_model`); ({}, 0, 0) without windows."""
    layout = Layout.of_model(model)
    if not layout.windowed:
        return {}, 0, 0
    view = KVWindows(layout)  # not attached: it reads the layout and the model's kept heads
    return ({l: view.kv_windowed(model, l) for l, layer in enumerate(layout.modes) if WINDOW in layer},
            layout.sink, layout.window)


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
    (logits, *present), the past flattened as `past_names` orders it: key_0, value_0, key_1, ...,
    a windowed layer's ring after its keys and values, the rings' slots last."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.rings, self.sink, self.window = rings_of(model)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        past, slots = (past[:-1], past[-1]) if self.rings else (past, None)
        cache, layer, at = DynamicCache(), 0, 0
        while at < len(past):  # layer by layer: two tensors, four with a ring
            if layer in self.rings:
                cache.layers.append(RingCacheLayer(self.rings[layer], self.sink, self.window, *past[at:at + 4], slots))
                at += 4
            else:
                cache.layers.append(_cache([(past[at], past[at + 1])]).layers[0])
                at += 2
            layer += 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True)
        flat = []
        for layer in out.cache.layers:
            flat += [layer.keys, layer.values]
            if isinstance(layer, RingCacheLayer):
                flat += [layer.window_keys, layer.window_values]
                slots = layer.slots
        return (out.logits, *flat, *([slots] if self.rings else []))


def kv_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(kv_heads_kept, head_dim) of each layer's cache, read from a one-token PyTorch forward."""
    device = next(model.parameters()).device
    ids = torch.full((1, 1), 3, dtype=torch.long, device=device)
    with torch.no_grad():
        cache = model.eval()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).cache
    return [(int(layer.keys.shape[1]), int(layer.keys.shape[3])) for layer in cache.layers]


def empty_past(model: nn.Module, batch: int, past_len: int = 0, shapes=None, seed: int | None = None) -> list[torch.Tensor]:
    """Past tensors in `past_names` order: every layer's keys and values, zeros of length
    `past_len` (random if `seed` is given); with KV windows, a windowed layer's ring (sink +
    window entries, zeros or random alike) and the rings' slots: those a `past_len`-token past
    leaves held (`ring_slots`; every entry unused for a prefill)."""
    shapes = shapes or kv_shapes(model)
    rings, sink, window = rings_of(model)
    param = next(model.parameters())
    g = torch.Generator().manual_seed(seed) if seed is not None else None

    def tensor(*shape):
        t = torch.randn(*shape, generator=g) if g is not None else torch.zeros(*shape)
        return t.to(device=param.device, dtype=param.dtype)

    out = []
    for layer, (heads, dim) in enumerate(shapes):
        out += [tensor(batch, heads, past_len, dim), tensor(batch, heads, past_len, dim)]
        if layer in rings:  # (B, W, S, D) twice
            out += [tensor(batch, sum(rings[layer]), sink + window, dim) for _ in range(2)]
    if rings:
        out.append(ring_slots(past_len, sink, window).expand(batch, -1).contiguous().to(param.device))  # (B, S)
    return out


def ring_slots(past_len: int, sink: int, window: int) -> torch.Tensor:
    """(sink + window,) int64: the slots a ring holds after `past_len` tokens (the first `sink` and
    the last `window`), `EMPTY_SLOT` for the entries still unused."""
    held = [t for t in range(past_len) if t < sink or t >= past_len - window]
    return torch.tensor(held + [EMPTY_SLOT] * (sink + window - len(held)), dtype=torch.long)


def positions(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """HF's position ids for the last `new_tokens` of `attention_mask`: cumsum - 1, padding at 0."""
    pos = attention_mask.long().cumsum(-1) - 1
    pos = pos.masked_fill(attention_mask == 0, 0)
    return pos[:, -new_tokens:]


def export_onnx_decode(model: nn.Module, path: str | Path, batch: int = 2, new: int = 3, past: int = 5) -> Path:
    """Write `model`'s decode step (past key/values in, logits and present key/values out) as ONNX
    to `path`; returns the path. Raises ValueError naming the reason for models it cannot serve."""
    problem = onnx_refusal(model, "decode") or decode_problem(_config(model))
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
    layers, rings = len(shapes), rings_of(model)[0]
    batch_, new_, past_ = torch.export.Dim("batch"), torch.export.Dim("new_tokens"), torch.export.Dim("past_len")
    total = torch.export.Dim.DYNAMIC  # the mask's length, past_len + new_tokens (torch.export infers it)
    cache_axes = []
    for layer in range(layers):
        cache_axes += [{0: batch_, 2: past_}] * 2 + ([{0: batch_}] * 2 if layer in rings else [])  # rings: fixed size
    dynamic = ({0: batch_, 1: new_}, {0: batch_, 1: total}, {0: batch_, 1: new_},
               tuple(cache_axes + ([{0: batch_}] if rings else [])))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Decode(model).eval(), (ids, mask, pos, *past_tensors), str(path), dynamo=True,
                          input_names=[*DECODE_INPUTS, *past_names(layers, rings)],
                          output_names=["logits", *present_names(layers, rings)], dynamic_shapes=dynamic,
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


def _feed(session, ids, mask, pos, past) -> dict:
    """The graph's inputs: the past in the session's order (`past_names`)."""
    feed = {"input_ids": ids.cpu().numpy(), "attention_mask": mask.cpu().numpy(), "position_ids": pos.cpu().numpy()}
    names = [i.name for i in session.get_inputs()][len(DECODE_INPUTS):]
    if len(names) != len(past):
        raise ValueError(f"the decode graph takes {len(names)} past tensors, {len(past)} were given (a graph exported "
                         "from another layout of KV windows?)")
    feed.update({name: t.cpu().numpy() if isinstance(t, torch.Tensor) else t for name, t in zip(names, past)})
    return feed


@torch.no_grad()
def check_onnx_decode(model: nn.Module, path: str | Path, batch: int = 3, prompt: int | None = None,
                      steps: int = 4, seed: int = 2) -> dict:
    """The decode graph in ONNX Runtime against PyTorch with its own DynamicCache: a prefill of
    `prompt` tokens (one row left-padded, empty past; default 9, or sink + window + 3 with KV
    windows, so that the rings overflow) and `steps` greedy decode steps of one token, each side
    feeding back its own argmax and its own cache. Returns deploy/onnx.py's `agreement` figures
    of the prefill (real tokens) and of the decode steps' logits, both sides' greedy tokens, the
    KV heads of every layer's ONNX present and of PyTorch's cache (full units' and windowed
    units' apart), the cache's bytes per token and the rings' fixed bytes per sequence;
    `judge_decode` applies the bounds."""
    from headprune.deploy.onnx import agreement, onnx_session

    model = model.eval()
    device = next(model.parameters()).device
    session = onnx_session(path)
    shapes = kv_shapes(model)
    rings, sink, window = rings_of(model)
    prompt = prompt if prompt is not None else (sink + window + 3 if rings else 9)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, : prompt // 3] = 0
    real = mask.bool().cpu()
    pos = positions(mask, prompt)

    out = session.run(None, _feed(session, ids, mask, pos, empty_past(model, batch, 0, shapes)))
    ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=DynamicCache(), use_cache=True)
    prefill = agreement(torch.from_numpy(out[0])[real], ref.logits.float().cpu()[real])
    present = dict(zip((o.name for o in session.get_outputs()), out))
    onnx_heads = [int(present[f"present.{i}.key"].shape[1]) for i in range(len(shapes))]
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
        out = session.run(None, _feed(session, onnx_next, onnx_mask, positions(onnx_mask, 1), out[1:]))
        ref = model(input_ids=torch_next, attention_mask=torch_mask, position_ids=positions(torch_mask, 1),
                    cache=cache, use_cache=True)
        cache = ref.cache
        onnx_last, torch_last = out[0][:, -1], ref.logits[:, -1]
        got.append(torch.from_numpy(onnx_last))
        want.append(torch_last.float().cpu())
    itemsize = next(model.parameters()).element_size()
    present = dict(zip((o.name for o in session.get_outputs()), out))
    onnx_rings = [tuple(present[f"present.{i}.window_key"].shape[1:3]) if f"present.{i}.window_key" in present
                  else (0, 0) for i in range(len(shapes))]  # (windowed KV heads, ring entries) per layer
    torch_rings = [int(layer.window_keys.shape[1]) if isinstance(layer, WindowedCacheLayer) else 0
                   for layer in cache.layers]
    report = {"prefill": prefill, "decode": agreement(torch.cat(got), torch.cat(want)),
              "tokens_equal": onnx_tokens == torch_tokens, "onnx_tokens": onnx_tokens, "torch_tokens": torch_tokens,
              "kv_heads": onnx_heads, "torch_kv_heads": [heads for heads, _ in shapes],
              "kv_heads_total": sum(onnx_heads), "head_dim": shapes[0][1] if shapes else 0,
              "cache_bytes_per_token": sum(2 * heads * dim * itemsize for heads, dim in shapes),
              "past_len_after": prompt + steps, "batch": batch, "prompt": prompt, "steps": steps}
    if rings:
        report.update(window_kv_heads=[heads for heads, _ in onnx_rings], torch_window_kv_heads=torch_rings,
                      ring_entries=sink + window, onnx_ring_entries=sorted({n for h, n in onnx_rings if h}),
                      ring_bytes=sum(2 * heads * n * dim * itemsize for (heads, n), (_, dim) in zip(onnx_rings, shapes)))
    return report


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
    if report.get("window_kv_heads") != report.get("torch_window_kv_heads"):
        failures.append(f"windowed KV heads per layer differ: ONNX {report.get('window_kv_heads')} vs PyTorch "
                        f"{report.get('torch_window_kv_heads')}")
    if "ring_entries" in report and report["onnx_ring_entries"] != [report["ring_entries"]]:
        failures.append(f"the rings hold {report['onnx_ring_entries']} entries, not sink + window = "
                        f"{report['ring_entries']}")
    return failures
