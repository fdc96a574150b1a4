"""Multi-head latent attention (MLA: DeepSeek-V2 / V3 and the families that copy their attention).

An MLA layer compresses each token's keys and values into one latent shared by every query head:
`kv_a_proj_with_mqa` writes a `kv_lora_rank` latent plus one `qk_rope_head_dim` rotary key, and
`kv_b_proj` expands the latent into each head's non-rotary key (`qk_nope_head_dim`) and value
(`v_head_dim`), per head [k_nope_h | v_h]. Queries come from `q_b_proj` (after the `q_a_proj`
LoRA) or from `q_proj` when the config's `q_lora_rank` is None, per head [q_nope_h | q_rope_h].

So a head owns: its `qk_nope_head_dim + qk_rope_head_dim` query rows, its `qk_nope_head_dim`
key rows and `v_head_dim` value rows of `kv_b_proj`, and its `v_head_dim` input columns of
`o_proj`. The forward reshapes with -1 heads everywhere, so slicing those is all physical removal
needs. Every head reads its own (expanded) keys and values: there are no KV groups, a unit is a
head.

What removal does not shrink: the latent. The cache holds `kv_lora_rank + qk_rope_head_dim`
values per token and layer whatever heads the layer keeps (only a layer left without heads,
whose attention is replaced by `HeadlessAttention`, stops caching it), and `q_a_proj`,
`kv_a_proj_with_mqa` and their norms stay whole. The KV-bytes budget says so (`latent_kv_note`,
`costs.tables.kv_costs`), and the FLOPs table counts MLA's own products (`costs.flops`).

`head_dim` of this adapter is `v_head_dim`: the width of one head's context, what the output
projection, the head masks and the scale / bias-compensation code read per head.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from headprune.heads.adapters import ArchAdapter, Rows, layer_heads, register_adapter


@dataclass(frozen=True)
class LatentAdapter(ArchAdapter):
    """An MLA family: `q` names the query projection after the LoRA (`q_b_proj`; `for_model` answers
    with `q_proj` for a config with `q_lora_rank=None`), `k` and `v` both name `kv_b_proj`, `o` the
    output projection. `latent` names the projection writing the cached latent (left whole)."""

    latent: str = "kv_a_proj_with_mqa"
    q_without_lora: str = "q_proj"

    def for_model(self, model: nn.Module) -> "LatentAdapter":
        if getattr(self.config_of(model.config), "q_lora_rank", None) is None and self.q != self.q_without_lora:
            return dataclasses.replace(self, q=self.q_without_lora)
        return self

    def head_dim(self, config) -> int:
        """`v_head_dim`: one head's context (its output-projection columns)."""
        return int(self.config_of(config).v_head_dim)

    def query_width(self, config) -> int:
        config = self.config_of(config)
        return int(config.qk_nope_head_dim + config.qk_rope_head_dim)

    def latent_width(self, config) -> int:
        """Values cached per token and layer: the latent plus the shared rotary key."""
        config = self.config_of(config)
        return int(config.kv_lora_rank + config.qk_rope_head_dim)

    def head_rows(self, model: nn.Module, layer: int) -> dict[int, dict[str, Rows]]:
        """{head: {"q": its query rows (nope + rope), "k": its k_nope rows of kv_b_proj, "v": its value
        rows of kv_b_proj, "o": its o_proj columns}}, at its position among the kept heads."""
        config = self.config_of(model.config)
        attn = self.attention(self.blocks(model)[layer])
        q, kv, o = (attn.get_submodule(path) for path in (self.q, self.k, self.o))
        qk, nope, dv = self.query_width(config), int(config.qk_nope_head_dim), self.head_dim(config)
        per_kv = nope + dv  # kv_b_proj rows per head: [k_nope_h | v_h]
        return {head: {"q": Rows(q, True, pos * qk, (pos + 1) * qk),
                       "k": Rows(kv, True, pos * per_kv, pos * per_kv + nope),
                       "v": Rows(kv, True, pos * per_kv + nope, (pos + 1) * per_kv),
                       "o": Rows(o, False, pos * dv, (pos + 1) * dv)}
                for pos, head in enumerate(layer_heads(model, layer))}


def is_latent(adapter: ArchAdapter) -> bool:
    """True for an MLA family: its KV cache is a latent that removing heads does not shrink."""
    return isinstance(adapter, LatentAdapter)


def latent_kv_note(model_type: str) -> str:
    """What budget=kv means for an MLA model, for the log and results.json."""
    return (f"model_type={model_type!r} uses multi-head latent attention: each layer caches one latent "
            "(kv_lora_rank + qk_rope_head_dim values per token) shared by all its heads, so removing heads saves "
            "no KV bytes unless a layer loses every head; the KV table counts a layer's latent while it keeps "
            "any head (budget=flops or latency price the heads themselves)")


def onnx_refusal(model: nn.Module, graph: str) -> str:
    """Why the ONNX exporter of `graph` ("forward" or "decode") refuses an MLA model, or ''."""
    from headprune.heads.adapters import get_adapter

    if not is_latent(get_adapter(model)):
        return ""
    why = ("the decode graph passes one key and one value cache per KV head, while MLA caches one latent per layer "
           "that kv_b_proj expands at every step" if graph == "decode" else
           "torch.onnx does not convert the MLA forward (dense or pruned: translating an aten.unsqueeze of the rotary "
           "part fails, torch 2.13)")
    return f"ONNX export ({graph}) of model_type={model.config.model_type!r} refused: {why}; allowed: save_pruned"


# DeepSeek-V2 / V3 and the families whose attention is theirs (same projection names and per-head
# layout). Each passes the coverage check (docs/coverage.md); DeepSeek-V3.2 and GLM-MoE-DSA (a
# token indexer inside the attention) are refused in adapters.REFUSED.
LATENT_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu", "axk1")
register_adapter(LatentAdapter(
    name="mla", model_types=LATENT_TYPES, layers_path="layers", attn_path="self_attn",
    q="q_b_proj", k="kv_b_proj", v="kv_b_proj", o="o_proj", size_attrs=(("num_heads", "heads"),),
))
