"""Pruned Llama-family models as vLLM `DeciLMForCausalLM` checkpoints (`block_configs`), for the
layouts that architecture can express.

vLLM's reading rules (vllm/model_executor/models/nemotron_nas.py, read, not served here: vLLM
does not run on our CPUs): a layer whose `block_configs[i].attention.no_op` is true has no
attention (no input norm, no Q/K/V/O weights); any other layer has all `num_attention_heads`
query heads and `num_attention_heads // attention.n_heads_in_group` KV heads; its FFN width is
`ffn.ffn_mult` through DeciLM's rounding (int(2 * ffn_mult * hidden / 3), rounded up to a multiple
of 256). So a pruned layout is expressible when every layer keeps all its KV groups (and so all
its query heads) or none, no attention-free layer keeps a fitted output bias (a no-op layer adds
nothing), and the FFN width survives that rounding; anything else is refused with the reason
(`deci_refusal`).

`save_deci` (`headprune-export --vllm-deci <dir>`) writes config.json (model_type `nemotron-nas`,
architectures DeciLMForCausalLM, block_configs) and model.safetensors in the model's dtype without
the attention weights of the no-op layers (and the tokenizer when given), into a new folder
published in one step (atomic.py). Loading it in vLLM also needs the DeciLM config class (NVIDIA's
`configuration_decilm.py`, trust_remote_code); this module does not ship it.
"""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from headprune.atomic import staged_folder
from headprune.heads.adapters import get_adapter
from headprune.heads.layout import Layout
from headprune.heads.windows import windows_refusal

_FFN_ROUND = 256  # DeciLM rounds FFN widths up to multiples of this


def ffn_mult_to_width(ffn_mult: float, hidden: int) -> int:
    """The FFN width DeciLM (and vLLM, llama.cpp's converter) derive from `ffn_mult`."""
    width = int(2 * ffn_mult * hidden / 3)
    return width if width % _FFN_ROUND == 0 else width + _FFN_ROUND - width % _FFN_ROUND


def deci_refusal(model: nn.Module) -> str | None:
    """Why vLLM's DeciLMForCausalLM cannot express `model`'s layout (None: it can)."""
    config = model.config
    windowed = windows_refusal(model, "vLLM's DeciLMForCausalLM")
    if windowed:
        return windowed
    if config.model_type != "llama":
        return f"model_type={config.model_type!r}: DeciLM is a Llama variant; allowed: llama"
    adapter = get_adapter(model)
    n_heads = adapter.num_heads(config)
    for i, kept in enumerate(Layout.of_model(model).heads):
        bias = getattr(adapter.out_proj(adapter.blocks(model)[i]), "bias", None)
        if not kept and bias is not None and bool(bias.detach().abs().max() > 0):
            return (f"layer {i} keeps no heads but its output projection has a non-zero bias (a recovery's fit); "
                    "a DeciLM attention.no_op layer adds nothing, so the checkpoint would compute something else; "
                    "allowed: a layer without heads with no (or a zero) bias (the `deci` GGUF folds it into the "
                    "FFN before it)")
        if kept and len(kept) != n_heads:
            return (f"layer {i} keeps {len(kept)} of {n_heads} query heads: DeciLM's layers have all "
                    f"num_attention_heads={n_heads} query heads or no attention (attention.no_op); allowed: layouts "
                    "where every layer keeps all its KV groups or none (the `deci` GGUF expresses the others)")
    hidden = int(config.hidden_size)
    mult = _ffn_mult(config)
    if ffn_mult_to_width(mult, hidden) != int(config.intermediate_size):
        return (f"intermediate_size={config.intermediate_size} is not what DeciLM derives from any ffn_mult with "
                f"hidden_size={hidden} (int(2 * ffn_mult * hidden / 3) rounded up to a multiple of {_FFN_ROUND}); "
                f"allowed: FFN widths that are multiples of {_FFN_ROUND}")
    if all(not kept for kept in Layout.of_model(model).heads):
        return "every layer is attention-free; allowed: at least one layer with attention"
    return None


def _ffn_mult(config) -> float:
    return 3 * int(config.intermediate_size) / (2 * int(config.hidden_size))


def deci_config(model: nn.Module) -> dict:
    """config.json of the DeciLM checkpoint (a ValueError with the reason when refused)."""
    reason = deci_refusal(model)
    if reason is not None:
        raise ValueError(f"vLLM DeciLM export refused: {reason}")
    config = model.config.to_dict()
    adapter = get_adapter(model)
    n_heads, n_kv = adapter.num_heads(model.config), adapter.num_kv_heads(model.config)
    blocks = []
    for kept in Layout.of_model(model).heads:
        attention = {"no_op": not kept, "replace_with_linear": False,
                     "n_heads_in_group": n_heads // n_kv if kept else None}
        blocks.append({"attention": attention,
                       "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": _ffn_mult(model.config)}})
    config.pop("num_key_value_heads", None)  # per layer now
    config.update(model_type="nemotron-nas", architectures=["DeciLMForCausalLM"], block_configs=blocks)
    return config


def read_block_configs(config: dict) -> list[tuple[int, int, int]]:
    """(query heads, KV heads, FFN width) per layer as vLLM's DeciLM reads config.json (its rules, in
    the module docstring); (0, 0, width) for a no-op attention."""
    out = []
    for block in config["block_configs"]:
        attention, ffn = block["attention"], block["ffn"]
        width = ffn_mult_to_width(ffn["ffn_mult"], config["hidden_size"])
        if attention["no_op"]:
            out.append((0, 0, width))
        else:
            out.append((config["num_attention_heads"], config["num_attention_heads"] // attention["n_heads_in_group"],
                        width))
    return out


def save_deci(model: nn.Module, directory: str | Path, overwrite: bool = False, tokenizer=None) -> Path:
    """Write the DeciLM checkpoint (config.json + model.safetensors, and `tokenizer`'s files when
    given: vLLM reads the tokenizer from the model folder) into `directory`, in the model's own
    dtype (config.json `dtype` says which). A folder holding files is refused unless `overwrite`;
    it is replaced in one step (atomic.py), so a failure leaves it as it was."""
    directory = Path(directory)
    config = deci_config(model)
    check_target(directory, overwrite, "save_deci")
    headless = [i for i, kept in enumerate(Layout.of_model(model).heads) if not kept]
    return write_checkpoint(model, directory, config, headless, {}, tokenizer)


def check_target(directory: Path, overwrite: bool, who: str) -> None:
    """A vLLM checkpoint's folder: refused when it is a file, or holds files and not `overwrite`."""
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{who}: {directory} exists and is not a folder")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"{who}: {directory} is not empty; pass overwrite=True to replace it")


def write_checkpoint(model: nn.Module, directory: Path, config: dict, headless: list[int],
                     replaced: dict, tokenizer=None) -> Path:
    """The model's state dict as a vLLM checkpoint folder (config.json, model.safetensors, the
    tokenizer's files), published in one step: layers in `headless` lose their attention and input
    norm (no-op attention), `replaced` entries (name -> tensor) replace the model's own, a tied
    output head is left to the embedding, and config.json `dtype` says the weights' dtype."""
    from safetensors.torch import save_file

    adapter = get_adapter(model)
    drop = tuple(f"model.layers.{i}." + part for i in headless for part in (f"{adapter.attn_path}.", "input_layernorm."))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.startswith(drop)}
    state.update({k: v.detach().contiguous() for k, v in replaced.items()})
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()})
    config["dtype"] = dtypes[0] if len(dtypes) == 1 else config.get("dtype")
    with staged_folder(directory) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return directory
