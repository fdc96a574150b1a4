"""Analytic FLOP counts: the speed-up a variant could reach if time followed arithmetic.

A multiply-add counts 2 FLOPs. Only matrix products are counted: softmax, scaling, biases,
LayerNorm and activations are left out (they are a few FLOPs per element, but on CPU they are
memory-bound, which is one reason the measured ratio falls short of these).

Per attention layer with `heads` query heads and `kv_heads` key/value heads of size `head_dim`,
model width `hidden`, `batch` sequences of `q_len` new tokens attending to `kv_len` keys:

    Q and O projections       2 * batch * q_len * hidden * heads * head_dim    (each)
    K and V projections       2 * batch * q_len * hidden * kv_heads * head_dim (each; new tokens only)
    scores Q K^T              2 * batch * heads * q_len * kv_len * head_dim
    weighted sum P V          2 * batch * heads * q_len * kv_len * head_dim

`weight_density` (nonzero share of the Q/K/V/O weights) scales the projections: the count a
kernel that skipped every zero weight would do (unstructured pruning leaves the scores alone).
"""
from __future__ import annotations

from collections.abc import Sequence


def attention_flops(batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int, head_dim: int,
                    hidden: int, weight_density: float = 1.0) -> float:
    """FLOPs of one attention layer (projections + scores + weighted sum)."""
    projection_weights = hidden * head_dim * (2 * heads + 2 * kv_heads)  # Q, O + K, V
    projections = 2 * batch * q_len * projection_weights * weight_density
    scores_and_sum = 2 * (2 * batch * heads * q_len * kv_len * head_dim)
    return projections + scores_and_sum


def latent_attention_flops(batch: int, q_len: int, kv_len: int, heads: int, hidden: int, q_lora_rank: int | None,
                           kv_lora_rank: int, nope: int, rope: int, v_dim: int) -> float:
    """FLOPs of one multi-head latent attention layer (DeepSeek-V2/V3, `heads.latent`) keeping `heads`
    heads: the query LoRA (`q_lora_rank`: hidden -> rank -> heads x (nope + rope); None: one hidden ->
    heads x (nope + rope) product), the latent (hidden -> kv_lora_rank + rope, for the new tokens), its
    expansion into each head's keys and values (kv_lora_rank -> heads x (nope + v), over the `kv_len`
    cached tokens, as transformers computes it), scores over nope + rope, the weighted sum over v, and
    the output projection. The LoRA and latent products do not depend on the heads kept; a layer with
    no heads runs none of them (its attention is replaced)."""
    if heads == 0:
        return 0.0
    qk = nope + rope
    query = hidden * q_lora_rank + q_lora_rank * heads * qk if q_lora_rank else hidden * heads * qk
    per_new = query + hidden * (kv_lora_rank + rope) + heads * v_dim * hidden  # per new token: Q, latent, O
    expand = kv_lora_rank * heads * (nope + v_dim)  # per cached token
    scores_and_sum = heads * q_len * kv_len * (qk + v_dim)
    return 2.0 * batch * (q_len * per_new + kv_len * expand + scores_and_sum)


def ffn_flops(batch: int, tokens: int, hidden: int, intermediate: int) -> float:
    """FLOPs of one feed-forward block of two matrices (BERT, GPT-2)."""
    return 2 * batch * tokens * hidden * intermediate * 2


def model_attention_flops(batch: int, q_len: int, kv_len: int, heads: Sequence[int], kv_heads: Sequence[int],
                          head_dim: int, hidden: int, densities: Sequence[float] | None = None) -> float:
    """Sum of `attention_flops` over layers with per-layer head counts (and weight densities)."""
    densities = densities if densities is not None else [1.0] * len(heads)
    return sum(attention_flops(batch, q_len, kv_len, h, g, head_dim, hidden, dens)
               for h, g, dens in zip(heads, kv_heads, densities, strict=True))


def ratio(dense: float, variant: float) -> float:
    """dense / variant (2.0 = half the work); infinite when the variant does nothing."""
    return dense / variant if variant > 0 else float("inf")
