"""The attention output projection's bias, where reconstruction recoveries put what they fit
(least-squares mask tuning's bias term, bias compensation's removed-head means).

The bias is a real parameter of the model, not a gate: the masked model evaluates it, `fold` and
physical removal leave it as it is (it lies along the output features), and `save_pruned`
writes it. BERT-like models and GPT-2 have one already. Llama's output projection has none, but
its config's `attention_bias=true` gives Q, K, V and O biases, so a plain checkpoint can carry
one: O gets the bias and Q/K/V get exact zeros (adding zeros changes nothing). A family whose
config cannot declare an O bias (Qwen2 and Mistral hard-code it off) is refused: plain
`from_pretrained` would silently drop the bias and compute something else than was evaluated.
"""
from __future__ import annotations

import torch
from torch import nn

from headprune.heads.adapters import get_adapter

FLAG = "attention_bias"  # LlamaConfig: bias on q_proj, k_proj, v_proj and o_proj


def bias_refusal(model: nn.Module, who: str) -> str | None:
    """Why `model` cannot carry an output-projection bias (a message for `who`), or None.

    A run asks once, before any work: the recovery's `check_model` (which `headprune-train` and
    `prune_to_budget` call), or the plain functions (`tune_scales`, `compensate`) on entry when
    called directly; `output_bias` then trusts it."""
    adapter = get_adapter(model)
    o = adapter.out_proj(adapter.blocks(model)[0])
    if getattr(o, "bias", None) is not None or FLAG in model.config.to_dict():
        return None
    return (f"{who} fits an attention output-projection bias, which model_type={model.config.model_type!r} has not "
            f"and its config cannot declare (no '{FLAG}' field), so a saved checkpoint would drop it; allowed: models "
            "whose output projection has a bias (BERT, RoBERTa, DistilBERT, GPT-2) or a Llama config "
            f"('{FLAG}')")


@torch.no_grad()
def output_bias(model: nn.Module, layer: int) -> nn.Parameter:
    """Layer `layer`'s output-projection bias, (E,). When the model has none, every layer's Q, K,
    V and O projections get zero biases (not trained) and `config.attention_bias` becomes true
    (module docstring). The caller has asked `bias_refusal` already (once per run); a config
    with no such flag is a RuntimeError saying so, never a bias a saved checkpoint would drop."""
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    if getattr(adapter.out_proj(blocks[layer]), "bias", None) is None:
        if FLAG not in model.config.to_dict():
            raise RuntimeError(f"output_bias: model_type={model.config.model_type!r} cannot declare an output "
                               "bias; ask bias_refusal before fitting one (a recovery's check_model does)")
        for block in blocks:
            attention = adapter.attention(block)
            for path in dict.fromkeys((adapter.q, adapter.k, adapter.v, adapter.o)):
                _add_zero_bias(attention.get_submodule(path))
        setattr(model.config, FLAG, True)
    return adapter.out_proj(blocks[layer]).bias


def _add_zero_bias(linear: nn.Module) -> None:
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"cannot add a bias to {type(linear).__name__}; allowed: nn.Linear projections")
    if linear.bias is None:
        weight = linear.weight
        linear.bias = nn.Parameter(weight.new_zeros(weight.shape[0]), requires_grad=False)  # (out,)
