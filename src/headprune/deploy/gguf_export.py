"""Pruned Llama-family models as GGUF files that llama.cpp serves: `llama` when every layer keeps the
same heads, `deci` (Nemotron-51B's architecture) when layers differ, `granite_swa` when whole
layers are windowed (a layer-granular KV layout with no sink tokens, heads/windows.py).

Why `granite_swa` for windows: llama.cpp's sliding windows restrict whole layers, chosen per
layer by the GGUF array `<arch>.attention.sliding_window_pattern`, which `granite_swa` reads
unconditionally (src/models/granite-swa.cpp, `load_arch_hparams`: `get_arr(...SLIDING_WINDOW_
PATTERN, hparams.is_swa_impl)`, `swa_type = LLAMA_SWA_TYPE_STANDARD`; llama-cpp-python 0.3.36's
vendored llama.cpp). Its block is Llama's (RMSNorm, rotary in llama.cpp's NORM layout, SiLU-gated
FFN, optional Q/K/V biases) with Granite's scalars, written neutral here (`logit_scale` 1; residual,
embedding and attention scales absent: 1, 1, 1/sqrt(head_dim)), and a per-head learned sink
logit (`attn_sinks`, added to each softmax's denominator as exp(sink)), written as -inf so it adds
nothing. A key at p0 is hidden from the query at p1 when p1 - p0 >= n_swa
(src/llama-hparams.h `is_masked_swa`, STANDARD), which is headprune's window of `window` tokens
with `sink` = 0: llama.cpp keeps no sink tokens, so a layout with sinks is refused, as is one
whose windowed layer keeps a full unit (per-head windows: no engine serves them) and an uneven
one (`granite_swa` builds every layer with layer 0's head counts).

Why two architectures: llama.cpp reads per-layer `attention.head_count` / `head_count_kv` arrays
for every architecture, but only `deci` builds each layer's tensors with that layer's shapes (a
`llama` file with arrays fails on layer 1's shapes). In `deci`, a layer with 0 query and 0 KV
heads is attention-free (its input passes straight to the FFN) and its KV cache is 0 bytes wide.

What the file holds (llama.cpp's conventions, read in its src/llama-model.cpp, src/models/deci.cpp
and its converter; the code is ours):
- per layer, the query / KV head counts and the FFN width (scalars for `llama`, arrays for
  `deci`), and `attention.key_length` / `value_length` / `rope.dimension_count` = head_dim written
  explicitly (llama.cpp otherwise derives the head size as hidden / layer 0's heads);
- Q and K rows permuted per layer, with that layer's own head counts, from transformers' rotary
  layout (rotate_half: pairs (i, i + d/2)) to llama.cpp's (pairs (2i, 2i+1));
- a layer whose kept KV groups keep different numbers of query heads gets zero query heads
  padded in (zero Q rows, zero output-projection columns), as headprune's own pruned model pads
  them, so each layer's query heads are a multiple of its KV heads (llama.cpp reads query head h
  from KV head h // (heads / kv_heads)); `GGUFExport.padded_heads` counts them;
- weights F32, F16 or Q8_0 (the `gguf` package's quantizer; a matrix whose rows are not a whole
  number of 32-value blocks stays F16, norms and biases F32, as llama.cpp's converter does);
- the tokenizer and chat template copied from a source GGUF's `tokenizer.*` metadata (SmolLM2: BPE
  with the `smollm` pre-tokenizer), or written from a transformers BPE tokenizer (byte-level,
  GPT-2 pre-tokenizer) for other models.

Refused with the reason before anything is written (`gguf_refusal`): encoders, families without
Llama's rotary layout (GPT-2, BERT, ...), rotary scaling, sliding windows, activations other than
SiLU, an attention-free layer 0 (llama.cpp takes the head size from layer 0's head count), and a
vocabulary whose size differs from the embedding's. A layer without heads whose output projection
keeps a bias (a recovery's fit; an attention-free `deci` layer adds nothing) has that bias folded
into the FFN down-projection bias of the layer before it, which llama.cpp's `deci` FFN adds.

The file is written under a temporary name beside `path` and renamed when complete (atomic.py;
the staging a killed export left is removed by the next export to that path). Besides llama.cpp's
keys it records `headprune.kept_heads` and the dense head counts, from which headprune's reader
(gguf_import.py) loads the file back as the pruned model it was written from.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from headprune.atomic import staged_file
from headprune.costs.kv_bytes import token_bytes
from headprune.heads.adapters import get_adapter, layer_heads
from headprune.heads.layout import FULL, WINDOW, Layout
from headprune.tasks import CAUSAL_LM, task_of

log = logging.getLogger(__name__)

WEIGHT_TYPES = ("f32", "f16", "q8_0")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # model_types with Llama's rotary layout and block
# Written as llama.cpp's architecture of the same name (its own tensors, rotary as transformers'
# rotate_half: Q/K rows not permuted), for uniform layouts only: `deci` has no per-head q_norm / k_norm.
OWN_ARCH = ("qwen3",)
KV_CACHE_BYTES = 2  # llama.cpp's default cache type: F16
_BLOCK = 32  # values per Q8_0 block


@dataclass(frozen=True)
class GGUFLayout:
    """What each layer of the file holds, decided before writing from the model's
    `heads.layout.Layout` (`gguf_layout`): `arch` ("llama", "deci", "granite_swa" or the family's
    own), query heads (padded ones included), KV heads, FFN width per layer, and the head size.
    Export-specific: the padding and per-architecture shapes are llama.cpp's, not the layout's."""

    arch: str
    heads: list[int]
    kv_heads: list[int]
    ffn: list[int]
    head_dim: int
    padded_heads: int  # zero query heads added so every layer's KV groups hold equal query heads
    swa: tuple[bool, ...] = ()  # granite_swa: per layer, whether its attention is a sliding window
    window: int = 0  # granite_swa: the sliding window's tokens (the query's own included)

    def kv_bytes_per_token(self, cache_bytes: int = KV_CACHE_BYTES) -> list[int]:
        """Per layer, the K plus V bytes one token adds to llama.cpp's cache (flash attention: V
        as wide as K; without it llama.cpp pads every layer's V to the widest)."""
        return [token_bytes(kv, self.head_dim, cache_bytes) for kv in self.kv_heads]


@dataclass(frozen=True)
class GGUFExport:
    """What `save_gguf` wrote: the file, its architecture and weight type, bytes, the layout, and
    the tensors a Q8_0 export kept as F16 (rows not a whole number of 32-value blocks)."""

    path: Path
    arch: str
    weights: str
    bytes: int
    layout: GGUFLayout
    f16_fallback: list[str] = field(default_factory=list)

    def __fspath__(self) -> str:
        return str(self.path)


def gguf_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot become a GGUF llama.cpp runs as this model (None: it can)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    windowed = swa_refusal(model)
    if windowed:
        return windowed
    if getattr(config, "is_encoder_decoder", False) or model_type not in FAMILIES:
        kind = "an encoder" if model_type in ("bert", "roberta", "xlm-roberta", "distilbert", "electra") else \
            f"model_type={model_type!r}"
        return (f"{kind} has no Llama-style decoder with rotary positions in the layout llama.cpp's llama/deci "
                f"architectures compute; allowed model_types: {', '.join(FAMILIES)}")
    if task_of(model) is not CAUSAL_LM:  # a check of the model's head
        return f"{type(model).__name__} is no causal LM (its head does {task_of(model).name}); allowed: *ForCausalLM models"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r}: llama.cpp's llama/deci FFN is SiLU-gated; allowed: silu"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        return f"rope_type={rope_type!r} (rotary scaling) is not written by this exporter; allowed: default rotary"
    if (getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        return "partial_rotary_factor != 1: llama.cpp's llama/deci rotate the whole head (rope.dimension_count = head_dim)"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None:
        return (f"sliding_window={window}: llama.cpp's llama/deci attend to the whole context; allowed: models "
                "without a sliding window")
    layout = _layout_or_reason(model)
    if isinstance(layout, str):
        return layout
    return None


SWA_FAMILIES = ("llama", "mistral", "qwen2")  # written as granite_swa: Llama's block (qwen3's q/k norms it has not)


def windows_of(model: nn.Module) -> Layout | None:
    """The model's layout (`Layout.of_model`) when it has windowed units (heads/windows.py), else None."""
    layout = Layout.of_model(model)
    return layout if layout.windowed else None


def swa_refusal(model: nn.Module) -> str | None:
    """Why `model`'s windowed KV units cannot be llama.cpp sliding-window layers (None: it has none,
    or they can: every kept unit of a windowed layer windowed, no sink tokens, a Llama-block family)."""
    layout = windows_of(model)
    if layout is None:
        return None
    mixed = [l for l, layer in enumerate(layout.modes) if WINDOW in layer and FULL in layer]
    if mixed:
        return (f"layer {mixed[0]} has both windowed and full KV units (per-head windows), which no llama.cpp "
                "architecture expresses: its sliding windows restrict whole layers (granite_swa's "
                "sliding_window_pattern); allowed: layer-granular layouts (every kept unit of a windowed layer "
                "windowed, kv_modes.granularity=layer), or save_pruned / load_pruned, which keep any layout")
    if layout.sink:
        return (f"kv_modes.sink={layout.sink}: llama.cpp's sliding windows keep no sink tokens (a key is hidden once "
                "it is window tokens behind the query); allowed: sink=0, or save_pruned / load_pruned, which keep "
                "the sinks")
    if model.config.model_type not in SWA_FAMILIES:
        return (f"model_type={model.config.model_type!r} with windowed layers: they are written as llama.cpp's "
                f"granite_swa, a Llama block; allowed model_types: {', '.join(SWA_FAMILIES)}")
    return None


def gguf_layout(model: nn.Module) -> GGUFLayout:
    """The GGUF layout of `model`; a ValueError with the reason when it has none (`gguf_refusal`)."""
    reason = gguf_refusal(model)
    if reason is not None:
        raise ValueError(f"GGUF export refused: {reason}")
    return _layout_or_reason(model)


def _layout_or_reason(model: nn.Module) -> GGUFLayout | str:
    adapter, config = get_adapter(model), model.config
    whole = Layout.of_model(model)
    layout, d = whole.heads, adapter.head_dim(config)
    heads, kv_heads, padded = [], [], 0
    for i, kept in enumerate(layout):
        groups = adapter.kv_groups(config, kept)
        per_group = max((len(g) for g in groups.values()), default=0)
        heads.append(per_group * len(groups))
        kv_heads.append(len(groups))
        padded += heads[-1] - len(kept)
    ffn = [int(adapter.blocks(model)[i].mlp.up_proj.weight.shape[0]) for i in range(len(layout))]
    uniform = len(set(zip(heads, kv_heads, ffn))) == 1 and heads[0] > 0
    if config.model_type in OWN_ARCH:
        if getattr(config, "attention_bias", False):
            return f"attention_bias=True: llama.cpp's {config.model_type} has no Q/K/V biases; allowed: attention_bias=False"
        if not uniform:
            return (f"layers keep different heads ({sorted(set(zip(heads, kv_heads)))} query / KV heads) or none: "
                    f"only llama.cpp's deci architecture holds per-layer shapes, and it has no {config.model_type} "
                    "q_norm / k_norm; allowed: the same whole KV groups kept in every layer")
        return GGUFLayout(config.model_type, heads, kv_heads, ffn, d, padded)
    windows = whole if whole.windowed else None
    if windows is not None:
        if not uniform:
            return (f"windowed layers with layers keeping different heads ({sorted(set(zip(heads, kv_heads)))} query / "
                    "KV heads) or none: llama.cpp's granite_swa builds every layer with layer 0's head counts; "
                    "allowed: the same whole KV groups kept in every layer (or no windows: the deci architecture)")
        swa = tuple(WINDOW in layer for layer in windows.modes)
        return GGUFLayout("granite_swa", heads, kv_heads, ffn, d, padded, swa, windows.window)
    if not uniform and heads[0] == 0:
        return ("layer 0 keeps no heads: llama.cpp takes the head size from layer 0's head count, so every layer's "
                "KV cache would be 0 wide; allowed: layouts whose layer 0 keeps at least one KV group")
    return GGUFLayout("llama" if uniform else "deci", heads, kv_heads, ffn, d, padded)


def save_gguf(model: nn.Module, path: str | Path, tokenizer=None, source_gguf: str | Path | None = None,
              weights: str = "f16", overwrite: bool = False, name: str | None = None) -> GGUFExport:
    """Write `model` (pruned or not) as a GGUF file llama.cpp loads (module docstring).

    The vocabulary comes from `source_gguf` (a GGUF of the same model: its `tokenizer.*` metadata,
    chat template included, is copied) or else from `tokenizer` (a transformers BPE tokenizer);
    one of them is required. `weights`: one of WEIGHT_TYPES. An existing `path` is refused unless
    `overwrite`. Everything is checked before the first byte is written."""
    import gguf

    path = Path(path)
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"save_gguf: weights={weights!r} is not allowed; allowed: {', '.join(WEIGHT_TYPES)}")
    if path.is_dir():
        raise IsADirectoryError(f"save_gguf: {path} is a folder; allowed: a file path (e.g. {path / 'model.gguf'})")
    if path.exists() and not overwrite:
        raise FileExistsError(f"save_gguf: {path} exists; pass overwrite=True to replace it")
    layout = gguf_layout(model)
    vocab = _vocabulary(model, tokenizer, source_gguf)
    tensors, fallback = _tensors(model, layout, weights)
    with staged_file(path) as tmp:  # published over `path` once complete (atomic.py)
        writer = gguf.GGUFWriter(str(tmp), layout.arch)
        _hparams(writer, model, layout, weights, name)
        for key, value, vtype, sub in vocab:
            writer.add_key_value(key, value, vtype, sub)
        _headprune_keys(writer, model)
        for tensor_name, data, raw_dtype in tensors:
            writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    result = GGUFExport(path, layout.arch, weights, path.stat().st_size, layout, fallback)
    log.info("save_gguf: %s (%s, %s, %.1f MB)%s", path, layout.arch, weights, result.bytes / 1e6,
             f"; {len(fallback)} tensors kept as F16" if fallback else "")
    return result


def _headprune_keys(writer, model: nn.Module) -> None:
    """What headprune's reader (gguf_import.py) needs to rebuild the pruned model exactly: the
    original ids of the heads each layer keeps and the dense model's head counts (padded query
    heads are then told from kept ones)."""
    adapter, layout = get_adapter(model), Layout.of_model(model)
    writer.add_string("headprune.kept_heads", json.dumps([list(kept) for kept in layout.heads]))
    writer.add_uint32("headprune.num_attention_heads", int(adapter.num_heads(model.config)))
    writer.add_uint32("headprune.num_key_value_heads", int(adapter.num_kv_heads(model.config)))
    if layout.windowed:  # what the sliding-window layers came from (headprune's reader does not read granite_swa)
        writer.add_string("headprune.kv_modes", json.dumps({k: v for k, v in layout.to_json().items() if k != "heads"}))


def _hparams(writer, model: nn.Module, layout: GGUFLayout, weights: str, name: str | None) -> None:
    import gguf

    config = model.config
    per_layer = layout.arch == "deci"
    writer.add_name(name or getattr(config, "_name_or_path", None) or f"headprune {config.model_type}")
    writer.add_block_count(len(layout.heads))
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_feed_forward_length(layout.ffn if per_layer else layout.ffn[0])
    writer.add_head_count(layout.heads if per_layer else layout.heads[0])
    writer.add_head_count_kv(layout.kv_heads if per_layer else layout.kv_heads[0])
    writer.add_key_length(layout.head_dim)
    writer.add_value_length(layout.head_dim)
    writer.add_rope_dimension_count(layout.head_dim)
    writer.add_rope_freq_base(float(_rope_theta(config)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weights])
    if weights == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if layout.arch == "granite_swa":  # module docstring; Granite's scalars neutral (absent ones are not applied)
        T = gguf.GGUFValueType
        writer.add_key_value("granite_swa.attention.sliding_window", int(layout.window), T.UINT32)
        writer.add_key_value("granite_swa.attention.sliding_window_pattern", [bool(w) for w in layout.swa], T.ARRAY,
                             T.BOOL)
        writer.add_key_value("granite_swa.logit_scale", 1.0, T.FLOAT32)


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return theta if theta is not None else getattr(config, "rope_theta", 10000.0)


# -- weights ------------------------------------------------------------------------------------------
def permute_rotary(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Q or K rows (heads * d, ...) from transformers' rotary layout (each head's dimension i
    rotates with i + d/2) to llama.cpp's (dimension 2i with 2i + 1), per head."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def pad_heads(rows: torch.Tensor, slots: list[int], total: int, d: int, dim: int) -> torch.Tensor:
    """`rows` (kept heads along `dim`, d features each) placed at head slots `slots` of `total`, zeros elsewhere."""
    if len(slots) == total:
        return rows
    shape = list(rows.shape)
    shape[dim] = total * d
    out = rows.new_zeros(shape)
    for pos, slot in enumerate(slots):
        out.narrow(dim, slot * d, d).copy_(rows.narrow(dim, pos * d, d))
    return out


def _layer_tensors(model: nn.Module, layer: int, layout: GGUFLayout) -> dict[str, torch.Tensor]:
    """GGUF name -> float tensor (transformers' (out, in) layout) of one layer."""
    adapter = get_adapter(model)
    block = adapter.blocks(model)[layer]
    attn = adapter.attention(block)
    n_q, n_kv, d = layout.heads[layer], layout.kv_heads[layer], layout.head_dim
    out = {}
    if n_q:
        groups = adapter.kv_groups(model.config, layer_heads(model, layer))
        per_group = n_q // n_kv
        slots = [g * per_group + t for g, members in enumerate(groups.values()) for t in range(len(members))]
        q, k, v, o = (attn.get_submodule(p) for p in (adapter.q, adapter.k, adapter.v, adapter.o))
        out["attn_norm.weight"] = block.input_layernorm.weight
        out["attn_q.weight"] = permute_rotary(pad_heads(q.weight, slots, n_q, d, 0), n_q)
        out["attn_k.weight"] = permute_rotary(k.weight, n_kv)
        if layout.arch in OWN_ARCH:  # rotate_half rotary as transformers': rows unpermuted, per-head norms
            out["attn_q.weight"], out["attn_k.weight"] = pad_heads(q.weight, slots, n_q, d, 0), k.weight
            out["attn_q_norm.weight"], out["attn_k_norm.weight"] = attn.q_norm.weight, attn.k_norm.weight
        out["attn_v.weight"] = v.weight
        out["attn_output.weight"] = pad_heads(o.weight, slots, n_q, d, 1)
        if q.bias is not None:
            out["attn_q.bias"] = permute_rotary(pad_heads(q.bias, slots, n_q, d, 0), n_q)
        if k.bias is not None:
            out["attn_k.bias"] = permute_rotary(k.bias, n_kv)
        if v.bias is not None:
            out["attn_v.bias"] = v.bias
        if o.bias is not None:
            out["attn_output.bias"] = o.bias
        if layout.arch == "granite_swa":  # no learned sink logit: exp(-inf) adds nothing to the softmax
            out["attn_sinks.weight"] = torch.full((n_q,), float("-inf"))
    mlp = block.mlp
    out["ffn_norm.weight"] = block.post_attention_layernorm.weight
    out["ffn_gate.weight"] = mlp.gate_proj.weight
    out["ffn_up.weight"] = mlp.up_proj.weight
    out["ffn_down.weight"] = mlp.down_proj.weight
    for part in ("gate", "up", "down"):
        bias = getattr(mlp, f"{part}_proj").bias
        if bias is not None:
            out[f"ffn_{part}.bias"] = bias
    return {f"blk.{layer}.{key}": value for key, value in out.items()}


def _folded_headless_biases(model: nn.Module, layout: GGUFLayout, named: dict) -> dict[str, torch.Tensor]:
    """A layer without heads outputs only its projection's bias (a recovery's fit), which llama.cpp's
    attention-free `deci` layer cannot add. Between layer l-1's FFN output and layer l's attention
    there is only the residual sum, so adding that bias to layer l-1's FFN down-projection bias
    computes the same residual stream (layer 0 keeps heads: `_layout_or_reason`)."""
    adapter, out = get_adapter(model), {}
    for layer, heads in enumerate(layout.heads):
        bias = getattr(adapter.out_proj(adapter.blocks(model)[layer]), "bias", None)
        if heads or bias is None or not bool(bias.detach().abs().max() > 0):
            continue
        key = f"blk.{layer - 1}.ffn_down.bias"
        down = out.get(key, named.get(key))
        out[key] = bias.detach().float() + (down.detach().float() if down is not None else 0.0)  # (E,)
    return out


def _tensors(model: nn.Module, layout: GGUFLayout, weights: str) -> tuple[list[tuple], list[str]]:
    """[(GGUF name, numpy data, raw dtype or None)] in file order, and the Q8_0 export's F16 fallbacks."""
    from gguf import GGMLQuantizationType, quants

    base = model.base_model
    named = {"token_embd.weight": base.embed_tokens.weight}
    for layer in range(len(layout.heads)):
        named.update(_layer_tensors(model, layer, layout))
    named.update(_folded_headless_biases(model, layout, named))
    named["output_norm.weight"] = base.norm.weight
    lm_head = model.lm_head.weight
    if not (getattr(model.config, "tie_word_embeddings", False) and lm_head.data_ptr() == base.embed_tokens.weight.data_ptr()):
        named["output.weight"] = lm_head
    out, fallback = [], []
    with torch.no_grad():
        for tensor_name, tensor in named.items():
            data = tensor.detach().to(torch.float32).cpu().numpy()
            if data.ndim == 1 or weights == "f32":
                out.append((tensor_name, np.ascontiguousarray(data), None))
            elif weights == "q8_0" and data.shape[-1] % _BLOCK == 0:
                out.append((tensor_name, quants.quantize(data, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0))
            else:
                if weights == "q8_0":
                    fallback.append(tensor_name)
                out.append((tensor_name, data.astype(np.float16), None))
    return out, fallback


# -- vocabulary ---------------------------------------------------------------------------------------
def _vocabulary(model: nn.Module, tokenizer, source_gguf) -> list[tuple]:
    """[(key, value, GGUFValueType, array element type or None)] of the tokenizer metadata."""
    vocab_size = int(model.config.vocab_size)
    if source_gguf is not None:
        return _copied_vocabulary(Path(source_gguf), vocab_size)
    if tokenizer is not None:
        return _written_vocabulary(tokenizer, vocab_size)
    raise ValueError("save_gguf needs the vocabulary: source_gguf=<a GGUF of the same model> (its tokenizer and chat "
                     "template are copied) or tokenizer=<a transformers BPE tokenizer>")


def _copied_vocabulary(source: Path, vocab_size: int) -> list[tuple]:
    import gguf

    if not source.is_file():
        raise FileNotFoundError(f"save_gguf: source_gguf={source} does not exist; allowed: a .gguf file")
    try:
        reader = gguf.GGUFReader(str(source))
    except (ValueError, OSError) as err:
        raise ValueError(f"save_gguf: source_gguf={source} is not a readable GGUF file ({err})") from None
    out = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    tokens = next((v for k, v, *_ in out if k == "tokenizer.ggml.tokens"), None)
    if tokens is None:
        raise ValueError(f"save_gguf: source_gguf={source} holds no tokenizer.ggml.tokens; allowed: a GGUF with its "
                         "vocabulary")
    if len(tokens) != vocab_size:
        raise ValueError(f"save_gguf: source_gguf={source} has {len(tokens)} tokens, the model's embedding "
                         f"{vocab_size} rows; allowed: a GGUF of the same model")
    return out


def _written_vocabulary(tokenizer, vocab_size: int) -> list[tuple]:
    """A byte-level BPE tokenizer (GPT-2 style) as llama.cpp's `gpt2` tokenizer model."""
    from gguf import GGUFValueType as T
    from gguf import TokenType

    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model_spec, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model_spec.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError(f"save_gguf: tokenizer {type(tokenizer).__name__} (model {model_spec.get('type')!r}, "
                         f"pre-tokenizer {pre.get('type')!r}) cannot be written: allowed: a byte-level BPE tokenizer "
                         "with GPT-2's pre-tokenizer, or source_gguf=<a GGUF of the same model> to copy its vocabulary")
    ids = dict(model_spec["vocab"])
    for added in spec.get("added_tokens", []):
        ids[added["content"]] = added["id"]
    if max(ids.values()) >= vocab_size:
        raise ValueError(f"save_gguf: the tokenizer has token id {max(ids.values())}, the model's embedding only "
                         f"{vocab_size} rows")
    special = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
    user = {a["content"] for a in spec.get("added_tokens", []) if not a.get("special")}
    by_id = {i: t for t, i in ids.items()}
    tokens, types = [], []
    for i in range(vocab_size):  # embedding rows beyond the vocabulary: unused padding tokens
        token = by_id.get(i, f"[PAD{i}]")
        tokens.append(token)
        types.append(int(TokenType.CONTROL if token in special else TokenType.USER_DEFINED if token in user
                         else TokenType.UNUSED if i not in by_id else TokenType.NORMAL))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_spec.get("merges", [])]
    if not merges:
        raise ValueError(f"save_gguf: tokenizer {type(tokenizer).__name__} has no BPE merges, and llama.cpp's gpt2 "
                         "tokenizer requires them (a GGUF array may not be empty); allowed: a BPE tokenizer with "
                         "merges, or source_gguf=<a GGUF of the same model>")
    out = [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", "gpt-2", T.STRING, None),
           ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING), ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
           ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING)]
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                          ("unknown", tokenizer.unk_token_id), ("padding", tokenizer.pad_token_id)):
        if token_id is not None:
            out.append((f"tokenizer.ggml.{key}_token_id", int(token_id), T.UINT32, None))
    out.append(("tokenizer.ggml.add_bos_token", bool(getattr(tokenizer, "add_bos_token", False)), T.BOOL, None))
    if getattr(tokenizer, "chat_template", None):
        out.append(("tokenizer.chat_template", str(tokenizer.chat_template), T.STRING, None))
    return out
