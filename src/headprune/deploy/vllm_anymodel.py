"""Pruned decoders as vLLM `AnyModel` checkpoints: per-layer KV heads and attention-free layers.

vLLM's AnyModel (`vllm/model_executor/models/anymodel.py`, vllm-project/vllm PR #36512, read at
commit 1b35c8a8df2213a429d42bddf7141e7930db7d59; vLLM is not installed or run here) serves
"heterogeneous" models: the base architecture builds every layer from the global config, then
each layer whose `block_configs[i]` carries overrides is rebuilt from a deep copy of the config
with those overrides applied, and layers marked `no_op` get identity modules. Its reading rules,
as this module writes for them:

- `architectures: ["AnyModel"]` and `base_architecture` name the model class AnyModel wraps
  (`AnyModel._resolve_arch`: a config without `base_architecture` is refused); `model_type` stays
  the base family's, so the config class is the family's own (unknown keys are kept as attributes).
- `_create_layer_config`: for a layer whose `attention.no_op` is false, `attention.num_key_value_heads`
  replaces `num_key_value_heads`; for a layer whose `ffn.no_op` is false, `ffn.intermediate_size`
  replaces `intermediate_size`; then each `ArchInfo.extra_config_fields` entry (`"section.key"` ->
  config attribute) is copied when the block has that key, whatever `no_op` says.
- `_has_overrides`: a layer is rebuilt when it has any of those keys; `_apply_no_ops`: `attention.no_op`
  replaces the layer's `self_attn` by `NoOpAttention` (identity) and `input_layernorm` by `NoOpNorm`,
  which passes the residual through untouched, so the layer adds no attention output; its KV cache
  entries are unregistered (`_unregister_layer`), so it holds no KV cache.
- `AnyModel.load_weights` drops the weights under a no-op module's prefix (`_collect_noop_prefixes`),
  so this export does not write them.
- `_arch_info_from_config`: a config's `anymodel_arch_info` (a dict of `ArchInfo` fields) replaces the
  built-in `_ARCH_REGISTRY` entry; its module paths must resolve inside `vllm.model_executor.models`
  (`_validate_config_arch_info`).

What vLLM's own per-layer override cannot say, and how the export says it: AnyModel changes a layer's
KV heads, not its query heads (the layer is built with the global `num_attention_heads`), while a
headprune removal layout drops a KV group together with its query heads. The export therefore
writes `anymodel_arch_info` = the registry entry of the base architecture plus
`extra_config_fields = {"attention.num_attention_heads": "num_attention_heads"}`, and each attention
layer's `attention.num_attention_heads`, and it writes `head_dim` explicitly in the global config:
vLLM's Llama / Qwen2 / Qwen3 attention takes `config.head_dim` and derives `hidden_size //
num_attention_heads` only without it, which a per-layer head count would change.

A layer whose kept KV groups keep different numbers of query heads gets zero query heads padded in
(zero Q rows, zero output-projection columns), as the GGUF export does (deploy/gguf_export.py), so
each layer's query heads are a multiple of its KV heads (vLLM reads query head h from KV head
h // (heads / kv_heads)).

Refused with the reason (`anymodel_refusal`): families outside AnyModel's registry
(Llama, Mistral, Qwen2, Qwen3 dense decoders here), non-causal-LM heads, windowed KV units (vLLM's
AnyModel attends every kept KV head to the whole context), an attention-free layer whose output
projection keeps a non-zero bias (a no-op layer adds nothing), and a layout where every layer is
attention-free. `save_anymodel` (`headprune-export --vllm-anymodel <dir>`) writes config.json and
model.safetensors in the model's dtype (and the tokenizer when given) into a new folder published in
one step (atomic.py). Loading needs a vLLM with AnyModel (the PR above); it is not tested here.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from headprune.deploy.vllm_deci import check_target, write_checkpoint
from headprune.heads.adapters import get_adapter
from headprune.heads.layout import Layout
from headprune.heads.windows import windows_refusal
from headprune.tasks import CAUSAL_LM, task_of

# AnyModel's `_ARCH_REGISTRY` entries for the dense decoders headprune prunes (anymodel.py at the
# commit above): base architecture -> (decoder_layer_module, decoder_layer_class)
ARCHES = {"LlamaForCausalLM": (".llama", "LlamaDecoderLayer"),
          "MistralForCausalLM": (".mistral", "MistralDecoderLayer"),
          "Qwen2ForCausalLM": (".qwen2", "Qwen2DecoderLayer"),
          "Qwen3ForCausalLM": (".qwen3", "Qwen3DecoderLayer")}
QUERY_HEADS_FIELD = "attention.num_attention_heads"  # the extra_config_fields entry the export adds


def anymodel_refusal(model: nn.Module) -> str | None:
    """Why vLLM's AnyModel cannot serve `model`'s layout as this export writes it (None: it can)."""
    windowed = windows_refusal(model, "vLLM's AnyModel")
    if windowed:
        return windowed
    name = type(model).__name__
    if name not in ARCHES:
        return (f"{name} (model_type={getattr(model.config, 'model_type', None)!r}) is not a base architecture "
                f"this export writes for AnyModel; allowed: {', '.join(ARCHES)}")
    if task_of(model) is not CAUSAL_LM:  # pragma: no cover - the class names above are all causal LMs
        return f"{name} is no causal LM; allowed: *ForCausalLM models"
    adapter = get_adapter(model)
    layout = Layout.of_model(model).heads
    for i, kept in enumerate(layout):
        bias = getattr(adapter.out_proj(adapter.blocks(model)[i]), "bias", None)
        if not kept and bias is not None and bool(bias.detach().abs().max() > 0):
            return (f"layer {i} keeps no heads but its output projection has a non-zero bias (a recovery's fit); an "
                    "AnyModel attention.no_op layer adds nothing, so the checkpoint would compute something else; "
                    "allowed: a layer without heads with no (or a zero) bias")
    if all(not kept for kept in layout):
        return "every layer is attention-free; allowed: at least one layer with attention"
    return None


def layer_heads(model: nn.Module) -> list[tuple[int, int]]:
    """(query heads, KV heads) each layer of the checkpoint holds: the kept KV groups, and as many
    query heads per group as the fullest kept group (zero ones padded in); (0, 0) when none."""
    adapter, config = get_adapter(model), model.config
    out = []
    for kept in Layout.of_model(model).heads:
        groups = adapter.kv_groups(config, kept)
        per_group = max((len(g) for g in groups.values()), default=0)
        out.append((per_group * len(groups), len(groups)))
    return out


def anymodel_config(model: nn.Module) -> dict:
    """config.json of the AnyModel checkpoint (a ValueError with the reason when refused)."""
    reason = anymodel_refusal(model)
    if reason is not None:
        raise ValueError(f"vLLM AnyModel export refused: {reason}")
    adapter = get_adapter(model)
    base = type(model).__name__
    module, layer_class = ARCHES[base]
    config = model.config.to_dict()
    blocks = []
    for i, (n_q, n_kv) in enumerate(layer_heads(model)):
        width = int(adapter.blocks(model)[i].mlp.up_proj.weight.shape[0])
        attention = ({"no_op": True} if not n_kv else
                     {"no_op": False, "num_key_value_heads": n_kv, "num_attention_heads": n_q})
        blocks.append({"attention": attention, "ffn": {"no_op": False, "intermediate_size": width}})
    config.update(architectures=["AnyModel"], base_architecture=base, block_configs=blocks,
                  head_dim=adapter.head_dim(model.config),
                  anymodel_arch_info={"decoder_layer_module": module, "decoder_layer_class": layer_class,
                                      "extra_config_fields": {QUERY_HEADS_FIELD: "num_attention_heads"}})
    return config


def read_layer_configs(config: dict) -> list[dict]:
    """Each layer's config as vLLM's AnyModel builds it from `config` (its `_create_layer_config`,
    `_has_overrides` and `_apply_no_ops`, read in anymodel.py): num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, and `attention` False for a no-op attention
    (identity, no KV cache). vLLM's attention takes config.head_dim, else hidden // heads."""
    if "AnyModel" not in (config.get("architectures") or []) or not config.get("base_architecture"):
        raise ValueError("not an AnyModel config: architectures must hold 'AnyModel' and base_architecture "
                         "must name the base model class (AnyModel._resolve_arch)")
    extra = (config.get("anymodel_arch_info") or {}).get("extra_config_fields") or {}
    out = []
    for block in config["block_configs"]:
        layer = copy.deepcopy({k: config.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                          "hidden_size", "intermediate_size")})
        attn, ffn = block.get("attention", {}), block.get("ffn", {})
        if not attn.get("no_op", False) and attn.get("num_key_value_heads") is not None:
            layer["num_key_value_heads"] = attn["num_key_value_heads"]
        if not ffn.get("no_op", False) and ffn.get("intermediate_size") is not None:
            layer["intermediate_size"] = ffn["intermediate_size"]
        for path, attr in extra.items():
            section, key = path.split(".", 1)
            value = (block.get(section) or {}).get(key)
            if value is not None:
                layer[attr] = value
        layer["head_dim"] = layer["head_dim"] or layer["hidden_size"] // layer["num_attention_heads"]
        layer["attention"] = not attn.get("no_op", False)
        layer["ffn"] = not ffn.get("no_op", False)
        out.append(layer)
    return out


def _layer_state(model: nn.Module, layer: int, n_q: int, n_kv: int, d: int) -> dict[str, torch.Tensor]:
    """The attention weights of one layer as the checkpoint holds them (zero query heads padded
    into partly kept groups), keyed by their name under the layer's attention module."""
    from headprune.deploy.gguf_export import pad_heads

    adapter = get_adapter(model)
    attn = adapter.attention(adapter.blocks(model)[layer])
    groups = adapter.kv_groups(model.config, Layout.of_model(model).heads[layer])
    per_group = n_q // n_kv
    slots = [g * per_group + t for g, members in enumerate(groups.values()) for t in range(len(members))]
    out = {}
    for part, dim in ((adapter.q, 0), (adapter.o, 1)):
        proj = attn.get_submodule(part)
        out[f"{part}.weight"] = pad_heads(proj.weight, slots, n_q, d, dim)
        if part == adapter.q and proj.bias is not None:
            out[f"{part}.bias"] = pad_heads(proj.bias, slots, n_q, d, 0)
    return out


def save_anymodel(model: nn.Module, directory: str | Path, overwrite: bool = False, tokenizer=None) -> Path:
    """Write the AnyModel checkpoint (config.json + model.safetensors, and `tokenizer`'s files when
    given: vLLM reads the tokenizer from the model folder) into `directory`, in the model's own dtype
    (config.json `dtype` says which). A folder holding files is refused unless `overwrite`; it is
    replaced in one step (atomic.py), so a failure leaves it as it was."""
    directory = Path(directory)
    config = anymodel_config(model)
    check_target(directory, overwrite, "save_anymodel")
    adapter = get_adapter(model)
    d = int(config["head_dim"])
    heads = layer_heads(model)
    replaced = {f"model.layers.{i}.{adapter.attn_path}.{k}": v for i, (n_q, n_kv) in enumerate(heads) if n_kv
                for k, v in _layer_state(model, i, n_q, n_kv, d).items()}
    return write_checkpoint(model, directory, config, [i for i, (_, n_kv) in enumerate(heads) if not n_kv],
                            replaced, tokenizer)
