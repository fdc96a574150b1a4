"""GGUF files of Llama-layout models read back as the (pruned) models they hold: the `llama`,
`deci` and `qwen3` files headprune writes (gguf_export.py), and other `llama` / `deci` files
transformers' GGUF loader would read wrongly or not at all.

Why headprune reads these itself: transformers' loader drops every bias a `llama` file holds
(`blk.N.attn_output.bias`, a recovery's fitted output bias: it sets attention_bias=False, and
the logits of such an export differed by 0.5-0.9 with no warning), refuses a `llama` file whose
query heads do not divide the hidden size (a pruned layout: "hidden size 64 is not a multiple of
6"), does not read `deci` (per-layer head counts) at all, and takes a pruned `qwen3` file's head
size from its head count (re-initialising every attention weight). `own_reader_reason` says when a
file needs this reader; models/gguf.py converts such a file with it into the cached folder.

What the reader undoes (the writer's steps, in gguf_export.py's module docstring):
- per layer, the query / KV head counts and the FFN width (arrays in `deci`, scalars in `llama`);
- Q and K rows (and biases) back from llama.cpp's rotary layout to transformers' (`unpermute_rotary`;
  not in `qwen3`, whose rotary llama.cpp computes as transformers does; its per-head q/k norms as they are);
- the zero query heads padded into a layer whose KV groups keep different numbers of heads;
- a headless layer's fitted output bias, which the writer folded into the FFN down-projection
  bias of the layer before it (no other FFN bias in the file): moved back.

The model is rebuilt as the dense Llama it was pruned from (`headprune.num_attention_heads` /
`num_key_value_heads`), its kept heads filled in from the file, then pruned to
`headprune.kept_heads` (the original head ids) with headprune's own surgery, so it is the model
that was exported, head ids included. A file without those keys (written before them, or by
another writer) is rebuilt from its head counts alone: the dense head count is hidden size / head
size, the KV heads the fewest that hold every layer's groups, and each layer keeps its first KV
groups and their first query heads, padded ones included (zero rows: they add nothing). Anything
the reader does not know (rotary scaling, partial rotary, tensors of other names, layers with
different FFN widths) is refused with the reason.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

# architecture -> (transformers family, Q/K rows in llama.cpp's rotary order, tensors of that family only)
ARCHES = {"llama": ("llama", True, ()), "deci": ("llama", True, ()),
          "qwen3": ("qwen3", False, ("attn_q_norm", "attn_k_norm"))}
LAYER_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def unpermute_rotary(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Q or K rows (heads * d, ...) from llama.cpp's rotary layout (dimension 2i with 2i + 1) back to
    transformers' (i with i + d/2): the inverse of gguf_export.permute_rotary."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, d // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


_VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


def _fields(reader) -> dict:
    """The file's metadata as Python values, the vocabulary arrays left out (parsing them is slow)."""
    return {key: field.contents() for key, field in reader.fields.items() if key not in _VOCABULARY}


def own_reader_reason(reader) -> str | None:
    """Why transformers' GGUF loader would not load the file `reader` reads as it is (None: it
    would): a `deci` file, a file headprune wrote, or a `llama` file holding biases."""
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch == "deci":
        return "architecture deci (per-layer head counts), which transformers does not read"
    if arch in ARCHES and "headprune.kept_heads" in reader.fields:
        return "written by headprune (pruned heads, padded query heads)"
    if arch != "llama":
        return None
    biases = [t.name for t in reader.tensors if t.name.endswith(".bias")]
    if biases:
        return (f"it holds biases ({', '.join(biases[:3])}{', ...' if len(biases) > 3 else ''}) that transformers' "
                "llama loader drops")
    return None


def load_gguf(path: str | Path, reader=None) -> nn.Module:
    """The LlamaForCausalLM (Qwen3ForCausalLM for `qwen3`), pruned as the file says, that a `llama`,
    `deci` or `qwen3` GGUF file holds, float32; a ValueError naming the file and the reason for what
    it cannot express (module docstring)."""
    import gguf

    path = Path(path)
    reader = reader if reader is not None else gguf.GGUFReader(str(path))
    fields = _fields(reader)
    arch = fields.get("general.architecture")

    def refuse(why: str) -> ValueError:
        return ValueError(f"GGUF file {path}: {why}; headprune reads llama, deci and qwen3 files of Llama's "
                          "layout (as headprune-export --gguf writes them)")

    if arch not in ARCHES:
        raise refuse(f"architecture {arch!r} is not read by headprune's GGUF reader")

    def key(name: str, default=KeyError):
        value = fields.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise refuse(f"{arch}.{name} is missing")
        return value

    n_layers, hidden = int(key("block_count")), int(key("embedding_length"))

    def per_layer(name: str) -> list[int]:
        value = key(name)
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n_layers
        if len(values) != n_layers:
            raise refuse(f"{arch}.{name} has {len(values)} entries for {n_layers} layers")
        return values

    heads, kv_heads, ffn = per_layer("attention.head_count"), per_layer("attention.head_count_kv"), \
        per_layer("feed_forward_length")
    if not any(heads):
        raise refuse("no layer has attention heads")
    d = int(key("attention.key_length", 0) or hidden // max(heads))
    scaling = sorted(k for k in fields if k.startswith(f"{arch}.rope.scaling"))
    if scaling:
        raise refuse(f"rotary scaling ({', '.join(scaling)}) is not read")
    if int(key("attention.value_length", d)) != d or int(key("rope.dimension_count", d)) != d:
        raise refuse("the value size or the rotary dimensions differ from the key size (partial rotary)")
    if len(set(ffn)) != 1:
        raise refuse(f"its layers have different FFN widths ({sorted(set(ffn))}); headprune prunes heads only")
    if any(q and (not kv or q % kv) for q, kv in zip(heads, kv_heads)) or any(kv and not q for q, kv in
                                                                                zip(heads, kv_heads)):
        raise refuse(f"its per-layer head counts ({heads}) are not multiples of the KV head counts ({kv_heads})")

    family, permuted, own = ARCHES[arch]
    known = {short for short in LAYER_TENSORS if short not in ("attn_q_norm", "attn_k_norm") or short in own}
    tensors = {t.name: t for t in reader.tensors}
    unknown = [n for n in tensors if n not in ("token_embd.weight", "output_norm.weight", "output.weight")
               and not ((m := _LAYER_NAME.fullmatch(n)) and m.group(2) in known
                        and int(m.group(1)) < n_layers and not (m.group(2).endswith("norm") and m.group(3) == "bias"))]
    if unknown:
        raise refuse(f"it holds tensors the reader does not know ({', '.join(unknown[:5])})")
    if family != "llama" and any(n.endswith(".bias") for n in tensors):
        raise refuse(f"a {arch} file holding biases ({', '.join(n for n in tensors if n.endswith('.bias'))[:80]})")

    total, total_kv, layout, slots = _layout(fields, heads, kv_heads, hidden, d, refuse)
    biases = {n for n in tensors if n.endswith(".bias")}
    folded = _folded(biases, heads)
    attention_bias = bool(folded) or any(_LAYER_NAME.fullmatch(n).group(2).startswith("attn_") for n in biases)
    mlp_bias = not folded and any(_LAYER_NAME.fullmatch(n).group(2).startswith("ffn_") for n in biases)

    def load(name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        tensor = tensors[name]
        return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))  # a copy

    embed = load("token_embd.weight")
    config = _config(fields, arch, family, n_layers, hidden, ffn[0], total, total_kv, d, embed.shape[0],
                     tied="output.weight" not in tensors, attention_bias=attention_bias, mlp_bias=mlp_bias,
                     refuse=refuse)
    state = {"model.embed_tokens.weight": embed, "model.norm.weight": load("output_norm.weight"),
             "lm_head.weight": load("output.weight") if "output.weight" in tensors else embed}
    for layer in range(n_layers):
        state.update(_layer_state(layer, heads[layer], kv_heads[layer], slots[layer], total, total_kv, d, hidden,
                                  ffn[0], config, tensors, load, folded, permuted))
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # no random init of weights that are replaced next
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, assign=True, strict=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers are not in the state
    if config.tie_word_embeddings:
        model.tie_weights()
    from headprune.heads.surgery import apply_layout

    return apply_layout(model.eval(), layout)


def _layout(fields: dict, heads: list[int], kv_heads: list[int], hidden: int, d: int, refuse):
    """(dense query heads, dense KV heads, kept head ids per layer, {kept head: slot in the file's
    padded query heads} per layer), from headprune's keys when the file has them (module docstring)."""
    kept = fields.get("headprune.kept_heads")
    total, total_kv = fields.get("headprune.num_attention_heads"), fields.get("headprune.num_key_value_heads")
    if kept is not None and total and total_kv:
        try:
            layout = [[int(h) for h in layer] for layer in json.loads(kept)]
        except (ValueError, TypeError):
            raise refuse(f"headprune.kept_heads is not a list of head id lists ({str(kept)[:80]})") from None
        total, total_kv = int(total), int(total_kv)
    else:
        groups = [q // kv for q, kv in zip(heads, kv_heads) if kv]
        widest, most_kv = max(groups, default=1), max(kv_heads)
        total = hidden // d if hidden % d == 0 else widest * most_kv
        choices = [kv for kv in range(most_kv, total + 1) if total % kv == 0 and total // kv >= widest]
        if not choices:
            total, choices = widest * most_kv, [most_kv]
        total_kv = choices[0]
        per = total // total_kv
        layout = [[g * per + t for g in range(kv) for t in range((q // kv) if kv else 0)]
                  for q, kv in zip(heads, kv_heads)]
    if len(layout) != len(heads) or total % total_kv:
        raise refuse(f"headprune.kept_heads has {len(layout)} layers and {total} / {total_kv} dense query / KV heads "
                     f"for a file of {len(heads)} layers")
    per, slots = total // total_kv, []
    for i, kept_heads in enumerate(layout):
        groups: dict[int, list[int]] = {}
        for h in sorted(kept_heads):
            if not 0 <= h < total:
                raise refuse(f"headprune.kept_heads layer {i} keeps head {h}, outside 0..{total - 1}")
            groups.setdefault(h // per, []).append(h)
        width = max((len(g) for g in groups.values()), default=0)
        if (width * len(groups), len(groups)) != (heads[i], kv_heads[i]):
            raise refuse(f"headprune.kept_heads layer {i} ({sorted(kept_heads)}) does not give its {heads[i]} query / "
                         f"{kv_heads[i]} KV heads")
        slots.append({h: g * width + t for g, members in enumerate(groups.values()) for t, h in enumerate(members)})
    return total, total_kv, layout, slots


def _folded(biases: set[str], heads: list[int]) -> dict[int, str]:
    """{headless layer: the FFN down-projection bias before it that holds its folded output bias},
    when the file's only FFN biases are such ones (the writer folds; a model with MLP biases keeps
    them all where they are)."""
    ffn = {n for n in biases if _LAYER_NAME.fullmatch(n).group(2).startswith("ffn_")}
    folded = {layer: f"blk.{layer - 1}.ffn_down.bias" for layer in range(1, len(heads))
              if not heads[layer] and f"blk.{layer - 1}.ffn_down.bias" in ffn}
    return folded if ffn and set(folded.values()) == ffn else {}


def _config(fields: dict, arch: str, family: str, n_layers: int, hidden: int, ffn: int, total: int, total_kv: int,
            d: int, vocab: int, tied: bool, attention_bias: bool, mlp_bias: bool, refuse):
    from transformers import LlamaConfig, Qwen3Config

    def token(name: str):
        value = fields.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None else None

    cls, extra = (LlamaConfig, {"attention_bias": attention_bias, "mlp_bias": mlp_bias}) if family == "llama" else \
        (Qwen3Config, {})
    try:
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=n_layers,
                   num_attention_heads=total, num_key_value_heads=total_kv, head_dim=d,
                   max_position_embeddings=int(fields.get(f"{arch}.context_length", 2048)),
                   rms_norm_eps=float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
                   rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)), tie_word_embeddings=tied,
                   bos_token_id=token("bos"), eos_token_id=token("eos"), pad_token_id=token("padding"),
                   architectures=[cls.__name__.replace("Config", "ForCausalLM")], **extra)
    except Exception as err:  # noqa: BLE001 - transformers' config validation (huggingface_hub's errors)
        raise refuse(f"a Llama config of {total} query / {total_kv} KV heads of {d} cannot be made "
                     f"({err})".replace("\n", " ")) from None


def _layer_state(layer: int, n_q: int, n_kv: int, slots: dict[int, int], total: int, total_kv: int, d: int,
                 hidden: int, ffn: int, config, tensors: dict, load, folded: dict[int, str], permuted: bool) -> dict:
    """The dense layer's state dict: the file's kept heads at their dense positions, zeros elsewhere."""
    prefix, out = f"model.layers.{layer}.", {}
    per = total // total_kv

    def unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
        return unpermute_rotary(rows, heads) if permuted else rows

    def name(short: str, kind: str = "weight") -> str:
        return f"blk.{layer}.{short}.{kind}"

    q, k, v = torch.zeros(total * d, hidden), torch.zeros(total_kv * d, hidden), torch.zeros(total_kv * d, hidden)
    o = torch.zeros(hidden, total * d)
    qb, kb, vb, ob = torch.zeros(total * d), torch.zeros(total_kv * d), torch.zeros(total_kv * d), torch.zeros(hidden)
    if n_q:
        groups = sorted({h // per for h in slots})
        file_q, file_k = unpermute(load(name("attn_q")), n_q), unpermute(load(name("attn_k")), n_kv)
        file_v, file_o = load(name("attn_v")), load(name("attn_output"))
        for h, s in slots.items():
            q[h * d:(h + 1) * d], o[:, h * d:(h + 1) * d] = file_q[s * d:(s + 1) * d], file_o[:, s * d:(s + 1) * d]
        for j, g in enumerate(groups):
            k[g * d:(g + 1) * d], v[g * d:(g + 1) * d] = file_k[j * d:(j + 1) * d], file_v[j * d:(j + 1) * d]
        if name("attn_q", "bias") in tensors:
            file_qb = unpermute(load(name("attn_q", "bias")), n_q)
            for h, s in slots.items():
                qb[h * d:(h + 1) * d] = file_qb[s * d:(s + 1) * d]
        for dense, short, rotary in ((kb, "attn_k", True), (vb, "attn_v", False)):
            if name(short, "bias") in tensors:
                bias = load(name(short, "bias"))
                bias = unpermute(bias, n_kv) if rotary else bias
                for j, g in enumerate(groups):
                    dense[g * d:(g + 1) * d] = bias[j * d:(j + 1) * d]
        if name("attn_output", "bias") in tensors:
            ob = load(name("attn_output", "bias"))
    elif layer in folded:
        ob = load(folded[layer])
    out[prefix + "input_layernorm.weight"] = load(name("attn_norm")) if name("attn_norm") in tensors else \
        torch.ones(hidden)
    out.update({prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": o})
    for short in ("attn_q_norm", "attn_k_norm"):  # qwen3: one (d,) norm shared by the heads
        if config.model_type == "qwen3":
            out[prefix + LAYER_TENSORS[short] + ".weight"] = load(name(short)) if name(short) in tensors else \
                torch.ones(d)
    if getattr(config, "attention_bias", False):
        out.update({prefix + "self_attn.q_proj.bias": qb, prefix + "self_attn.k_proj.bias": kb,
                    prefix + "self_attn.v_proj.bias": vb, prefix + "self_attn.o_proj.bias": ob})
    out[prefix + "post_attention_layernorm.weight"] = load(name("ffn_norm"))
    for short in ("ffn_gate", "ffn_up", "ffn_down"):
        out[prefix + LAYER_TENSORS[short] + ".weight"] = load(name(short))
        if getattr(config, "mlp_bias", False):
            rows = hidden if short == "ffn_down" else ffn
            out[prefix + LAYER_TENSORS[short] + ".bias"] = load(name(short, "bias")) if name(short, "bias") in \
                tensors else torch.zeros(rows)
    return out
