"""Hybrid decoders: some layers are softmax attention, the others linear-attention or state-space
mixers (Qwen3-Next / Qwen3.5's Gated DeltaNet, Granite-4's Mamba-2, OLMo hybrid's Gated DeltaNet).

Only the softmax-attention layers have heads to prune. A hybrid adapter's block list
(`blocks`) holds just those layers, in model order, so every head mask, score table, layout and
cost table is indexed by attention layer: row i of a (layers, heads) mask is model layer
`attention_layers(model)[i]`. The other layers are left alone and reported
(`attention_free_layers`): `layer_report` is what `save_pruned`'s layout file and results.json
record. Each attention core keeps its own `layer_idx`, so the cache (one entry per model layer)
is addressed as the model addresses it, a layer left without heads included.

Qwen3-Next's attention projects each query head's queries and output gate together: `q_proj`
gives per head [q_h | gate_h] (viewed (B, T, H, 2 * D) and chunked), and sigmoid(gate) multiplies
the head's context before `o_proj`. Both halves go with their head (`query_gate`); a zero query
padded into a partly kept KV group gets a zero gate, and its context is dropped anyway.

Methods that run the model block by block (least-squares and refit recoveries, measured
sensitivities, layer offloading) would skip the attention-free layers between two attention
blocks, so they refuse hybrids (`blockwise_refusal`).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from headprune.heads.adapters import ArchAdapter, Rows, get_adapter, layer_heads, register_adapter


@dataclass(frozen=True)
class HybridAdapter(ArchAdapter):
    """A family whose blocks are attention or an attention-free mixer: a block is prunable when it
    has `attn_path`. `query_gate`: the query projection holds [q_h | gate_h] per head (Qwen3-Next)."""

    query_gate: bool = False

    def all_blocks(self, model: nn.Module) -> list[nn.Module]:
        """Every block of the model's stack, attention-free ones included."""
        return ArchAdapter.blocks(self, model)

    def attention_layers(self, model: nn.Module) -> list[int]:
        """Model layer index of each prunable block (row i of a head mask is layer [i])."""
        return [i for i, block in enumerate(self.all_blocks(model)) if _has(block, self.attn_path)]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [block for block in self.all_blocks(model) if _has(block, self.attn_path)]

    def query_width(self, config) -> int:
        return (2 if self.query_gate else 1) * self.head_dim(config)

    def head_rows(self, model: nn.Module, layer: int) -> dict[int, dict[str, Rows]]:
        rows = super().head_rows(model, layer)
        if not self.query_gate:
            return rows
        d = self.head_dim(model.config)
        q = self.attention(self.blocks(model)[layer]).get_submodule(self.q)
        for pos, head in enumerate(layer_heads(model, layer)):  # q_proj per head: [q_h | gate_h]
            rows[head]["q"] = Rows(q, True, 2 * pos * d, (2 * pos + 1) * d)
            rows[head]["q_gate"] = Rows(q, True, (2 * pos + 1) * d, (2 * pos + 2) * d)
        return rows


def _has(block: nn.Module, path: str) -> bool:
    try:
        return isinstance(block.get_submodule(path), nn.Module)
    except AttributeError:
        return False


def is_hybrid(adapter: ArchAdapter) -> bool:
    return isinstance(adapter, HybridAdapter)


def layer_report(model: nn.Module) -> dict:
    """{"attention_layers": model layer of each mask row, "attention_free_layers": the layers left
    alone (linear attention, state-space)} for a hybrid; {} for a model whose every layer has heads."""
    adapter = get_adapter(model)
    if not is_hybrid(adapter):
        return {}
    attention = adapter.attention_layers(model)
    free = [i for i in range(len(adapter.all_blocks(model))) if i not in attention]
    return {"attention_layers": attention, "attention_free_layers": free}


def blockwise_refusal(model: nn.Module, what: str, allowed: str = "recovery=none, finetune, distill or lora") -> str:
    """Why `what` (a method that runs the model block by block) cannot run on `model`, or ''."""
    report = layer_report(model)
    if not report:
        return ""
    return (f"{what} runs the model block by block over its attention layers, but "
            f"model_type={model.config.model_type!r} is a hybrid whose layers {report['attention_free_layers']} are "
            f"linear-attention / state-space mixers between them (not run that way: not done); allowed on hybrids: {allowed}")


# Qwen3-Next and Qwen3.5: Gated DeltaNet layers (`linear_attn`) and gated full attention (`self_attn`,
# per-head q_norm / k_norm over head_dim).
register_adapter(HybridAdapter(
    name="hybrid_gated", model_types=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), layers_path="layers",
    attn_path="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj", kv_heads_attr="num_key_value_heads",
    size_attrs=(("num_key_value_groups", "groups"),), config_head_dim=True, query_gate=True,
))
# Granite-4 hybrid (Mamba-2 layers and Llama-layout attention).
register_adapter(HybridAdapter(
    name="hybrid_llama", model_types=("granitemoehybrid",), layers_path="layers", attn_path="self_attn",
    q="q_proj", k="k_proj", v="v_proj", o="o_proj", kv_heads_attr="num_key_value_heads",
    size_attrs=(("num_key_value_groups", "groups"),),
))
# OLMo hybrid: Gated DeltaNet layers and OLMo 2's attention (q_norm / k_norm over the whole projection).
register_adapter(HybridAdapter(
    name="hybrid_olmo2", model_types=("olmo_hybrid",), layers_path="layers", attn_path="self_attn",
    q="q_proj", k="k_proj", v="v_proj", o="o_proj", kv_heads_attr="num_key_value_heads",
    size_attrs=(("num_key_value_groups", "groups"),), projection_norms=("q_norm", "k_norm"),
))
