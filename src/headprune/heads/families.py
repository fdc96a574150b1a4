"""The architecture families headprune prunes: one `register_adapter(ArchAdapter(...))` per family,
in the families' own words (block path, Q/K/V/O projections, what the forward reads). Registered when
`headprune.heads.adapters` is imported; the adapter type is there, the multi-stack, latent and hybrid
families in stacks.py, latent.py and hybrid.py (docs/adding_an_architecture.md)."""
from __future__ import annotations

from headprune.heads.adapters import ArchAdapter, register_adapter

_BERT_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "xlm_roberta",
               "data2vec-text", "roberta-prelayernorm", "megatron-bert", "xlm-roberta-xl", "bert-generation", "roc_bert",
               "rembert", "roformer")
register_adapter(ArchAdapter(
    name="bert", model_types=_BERT_TYPES, layers_path="encoder.layer", attn_path="attention",
    q="self.query", k="self.key", v="self.value", o="output.dense",
    core="self", size_attrs=(("num_attention_heads", "heads"), ("all_head_size", "width")),
))
register_adapter(ArchAdapter(
    name="distilbert", model_types=("distilbert",), layers_path="transformer.layer",
    attn_path="attention", q="q_lin", k="k_lin", v="v_lin", o="out_lin", heads_attr="n_heads",
    size_attrs=(("n_heads", "heads"),),
))
register_adapter(ArchAdapter(
    name="gpt2", model_types=("gpt2",), layers_path="h", attn_path="attn",
    q="c_attn", k="c_attn", v="c_attn", o="c_proj", heads_attr="n_head",
    size_attrs=(("num_heads", "heads"), ("split_size", "width")),
))
# The Llama layout: blocks `model.layers`, attention `self_attn` with separate q_proj / k_proj / v_proj /
# o_proj Linears, a forward that reshapes with -1 heads and reads only `num_key_value_groups`. Every
# model type listed here passes the coverage check (mask == removal == reload, generate; see
# tools/coverage.py and docs/coverage.md), in each config variant that reaches its attention: their
# differences (per-head q_norm / k_norm over head_dim, head_dim apart from hidden / heads,
# query_pre_attn_scalar, soft-capping, sliding-window or rotary-less layers, multipliers, MoE
# feed-forwards) are all outside the heads' slices, but for norm weights with a row per head (below).
LLAMA_LAYOUT_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "mixtral", "smollm3", "granite",
    # decoders found by `python -m tools.coverage --probe` (transformers 5.24)
    "apertus", "apertus1p5_text", "arcee", "aria_text", "cohere", "cohere2", "cohere2_moe", "cwm", "dots1",
    "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "gemma", "glm", "glm4", "glm4_moe", "granitemoe",
    "granitemoeshared", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder",
    "jais2", "kolibri1", "mellum", "minimax_m3_vl_text", "ministral", "ministral3", "nanochat", "nemotron", "olmo",
    "phimoe", "qwen2_moe", "sarvam_moe", "seed_oss", "solar_open", "starcoder2", "vaultgemma",
    "cohere_compass_text", "emu3_text_model",  # (emu3's causal LM is its text model alone)
    # encoders with the same layout (bidirectional attention)
    "eurobert", "gte", "jina_embeddings_v3", "nomic_bert", "ultrabert",
)
# q_norm / k_norm with a weight row per head (Cohere's under use_qk_norm: (heads, head_dim)) go with their
# heads; the per-head norms shared over heads (a vector over head_dim: Qwen3, Gemma 3) are left alone.
PER_HEAD_NORMS = (("q_norm", "q"), ("k_norm", "k"))
register_adapter(ArchAdapter(
    name="llama", model_types=LLAMA_LAYOUT_TYPES, layers_path="layers",
    attn_path="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
    kv_heads_attr="num_key_value_heads", size_attrs=(("num_key_value_groups", "groups"),), config_head_dim=True,
    head_norms=PER_HEAD_NORMS,
))
# The same layout where a config with fewer heads is not the pruned model (Helium's config derives
# what its head_dim field says otherwise): uniform layouts too are saved with their layout file.
register_adapter(ArchAdapter(
    name="llama_layout_file", model_types=("helium",), layers_path="layers",
    attn_path="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
    kv_heads_attr="num_key_value_heads", size_attrs=(("num_key_value_groups", "groups"),),
))
# The Llama layout plus one attention-sink logit per query head (`sinks`).
register_adapter(ArchAdapter(
    name="llama_sinks", model_types=("gpt_oss", "granite_swa", "granitemoe_swa", "flint"),
    layers_path="layers", attn_path="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
    kv_heads_attr="num_key_value_heads", size_attrs=(("num_key_value_groups", "groups"),), config_head_dim=True,
    head_params=("sinks",),
))
# The Llama layout with a sigmoid output gate per query head (gate_proj; Beam's with a per-head bias).
register_adapter(ArchAdapter(
    name="llama_gated", model_types=("afmoe", "beam"), layers_path="layers", attn_path="self_attn",
    q="q_proj", k="k_proj", v="v_proj", o="o_proj", kv_heads_attr="num_key_value_heads",
    size_attrs=(("num_key_value_groups", "groups"),), config_head_dim=True, gates=("gate_proj",),
    head_params=("gate_bias",),
))
# Phi-3 / Phi-4-mini: one fused qkv_proj [all q | all k | all v]; the forward splits it at
# config.num_attention_heads * head_dim and reads num_key_value_heads from the module.
register_adapter(ArchAdapter(
    name="phi3", model_types=("phi3",), layers_path="layers", attn_path="self_attn",
    q="qkv_proj", k="qkv_proj", v="qkv_proj", o="o_proj", kv_heads_attr="num_key_value_heads",
    size_attrs=(("num_key_value_groups", "groups"), ("num_key_value_heads", "kv_heads")),
    config_attrs=(("num_attention_heads", "heads"),), config_head_dim=True,
))
# OLMo 2: the Llama layout, but q_norm / k_norm are RMSNorms over the whole projection.
register_adapter(ArchAdapter(
    name="olmo2", model_types=("olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2"), layers_path="layers",
    attn_path="self_attn",
    q="q_proj", k="k_proj", v="v_proj", o="o_proj", kv_heads_attr="num_key_value_heads",
    size_attrs=(("num_key_value_groups", "groups"),), projection_norms=("q_norm", "k_norm"),
))
# GPT-NeoX / Pythia: fused query_key_value viewed (B, T, H, 3 * D), i.e. [q_h | k_h | v_h] per head.
register_adapter(ArchAdapter(
    name="gpt_neox", model_types=("gpt_neox",), layers_path="layers", attn_path="attention",
    q="query_key_value", k="query_key_value", v="query_key_value", o="dense", qkv_layout="per_head",
))


# Older decoders whose forward reads the head count from the attention module (`num_heads`).
register_adapter(ArchAdapter(
    name="phi", model_types=("phi",), layers_path="layers", attn_path="self_attn", q="q_proj", k="k_proj",
    v="v_proj", o="dense", kv_heads_attr="num_key_value_heads", size_attrs=(("num_key_value_groups", "groups"),),
))
register_adapter(ArchAdapter(
    name="opt", model_types=("opt", "xglm", "biogpt"), layers_path=("decoder.layers", "layers"), attn_path="self_attn",
    q="q_proj", k="k_proj", v="v_proj", o="out_proj", size_attrs=(("num_heads", "heads"), ("embed_dim", "width")),
))
register_adapter(ArchAdapter(
    name="gptj", model_types=("gptj",), layers_path="h", attn_path="attn", q="q_proj", k="k_proj", v="v_proj",
    o="out_proj", heads_attr="n_head", size_attrs=(("num_attention_heads", "heads"),),
))
register_adapter(ArchAdapter(
    name="gpt_neo", model_types=("gpt_neo",), layers_path="h", attn_path="attn.attention", q="q_proj", k="k_proj",
    v="v_proj", o="out_proj", heads_attr="num_heads", size_attrs=(("num_heads", "heads"),),
))
# Persimmon: GPT-NeoX's per-head fused query_key_value, viewed (B, T, H, 3, D).
register_adapter(ArchAdapter(
    name="persimmon", model_types=("persimmon",), layers_path="layers", attn_path="self_attn",
    q="query_key_value", k="query_key_value", v="query_key_value", o="dense", qkv_layout="per_head",
    size_attrs=(("num_heads", "heads"),),
))
# ModernBERT: fused Wqkv viewed (..., 3, H, D), i.e. [all q | all k | all v]; alternating local
# (sliding-window) and global layers; its decoder variant has separate q/k/v projections.
register_adapter(ArchAdapter(
    name="modernbert", model_types=("modernbert",), layers_path="layers", attn_path="attn",
    q="Wqkv", k="Wqkv", v="Wqkv", o="Wo",
))
register_adapter(ArchAdapter(
    name="modernbert_decoder", model_types=("modernbert-decoder",), layers_path="layers", attn_path="attn",
    q="q_proj", k="k_proj", v="v_proj", o="Wo",
))
# DeBERTa-v2 / v3: BERT's layout (attention.self, attention.output.dense) with disentangled attention:
# the relative position embeddings go through query_proj / key_proj (share_att_key) or through
# pos_key_proj (c2p) / pos_query_proj (p2c), each viewed per head by the forward with the layer's
# num_attention_heads, so their rows go with the heads. The score scale sqrt(head_dim x (1 + number of
# pos_att_type terms)) does not depend on the head count.
register_adapter(ArchAdapter(
    name="deberta_v2", model_types=("deberta-v2",), layers_path="encoder.layer", attn_path="attention",
    q="self.query_proj", k="self.key_proj", v="self.value_proj", o="output.dense", core="self",
    size_attrs=(("num_attention_heads", "heads"), ("all_head_size", "width")),
    position_projections=("self.pos_key_proj", "self.pos_query_proj"),
))
# DeBERTa (v1): fused in_proj viewed (B, T, H, 3 * D), i.e. [q_h | k_h | v_h] per head, without bias; the
# forward adds q_bias / v_bias (head_dim entries per head) and projects the relative positions per head
# with pos_proj (c2p) / pos_q_proj (p2c).
register_adapter(ArchAdapter(
    name="deberta", model_types=("deberta",), layers_path="encoder.layer", attn_path="attention",
    q="self.in_proj", k="self.in_proj", v="self.in_proj", o="output.dense", core="self", qkv_layout="per_head",
    size_attrs=(("num_attention_heads", "heads"), ("all_head_size", "width")),
    position_projections=("self.pos_proj", "self.pos_q_proj"), head_vectors=("q_bias", "v_bias"),
    refused_settings=(("talking_head", "talking-head attention mixes every head's attention logits and weights "
                                       "(head_logits_proj / head_weights_proj), so removing a head changes the kept "
                                       "heads (not done)"),),
))
# Vision encoders (transformers 5 gives ViT, DeiT and DINOv2 the q_proj..o_proj layout too; DINOv2 with
# registers, ViT-MSN and I-JEPA share it).
register_adapter(ArchAdapter(
    name="vit", model_types=("vit", "deit", "dinov2", "dinov2_with_registers", "vit_msn", "ijepa"),
    layers_path=("layers", "encoder.layers", "encoder.layer"),
    attn_path="attention", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
    size_attrs=(("num_attention_heads", "heads"),),
))
# BEiT (and its look-alikes): ViT's layout, with a relative position bias table per layer that the block
# adds to the attention mask ((distances, heads): each layer keeps its heads' columns); a table shared by
# every layer (use_shared_relative_position_bias) is refused.
register_adapter(ArchAdapter(
    name="beit", model_types=("beit",), layers_path=("layers", "encoder.layers", "encoder.layer"),
    attn_path="attention", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
    size_attrs=(("num_attention_heads", "heads"),),
    head_columns=("relative_position_bias.relative_position_bias_table",),
    refused_settings=(("use_shared_relative_position_bias",
                       "one relative position bias table shared by every layer: a column could go only when every "
                       "layer has lost that head, and each layer would pick its own heads' maps from it (not done)"),),
))
# Data2Vec-Vision: BEiT's model in BERT's layout (attention.attention.query .. attention.output.dense), its
# per-layer table inside the self-attention.
register_adapter(ArchAdapter(
    name="data2vec_vision", model_types=("data2vec-vision",), layers_path="encoder.layer", attn_path="attention",
    q="attention.query", k="attention.key", v="attention.value", o="output.dense", core="attention",
    size_attrs=(("num_attention_heads", "heads"), ("all_head_size", "width")),
    head_columns=("attention.attention.relative_position_bias.relative_position_bias_table",),
    refused_settings=(("use_shared_relative_position_bias",
                       "one relative position bias table shared by every layer: a column could go only when every "
                       "layer has lost that head, and each layer would pick its own heads' maps from it (not done)"),),
))
# SigLIP / CLIP vision towers (their image classifiers and vision models; a two-tower model's vision
# tower: the text tower is not pruned).
register_adapter(ArchAdapter(
    name="clip_vision", model_types=("clip", "clip_vision_model", "siglip", "siglip_vision_model", "siglip2",
                                     "siglip2_vision_model", "metaclip_2"),
    layers_path=("vision_model.encoder.layers", "encoder.layers"), attn_path="self_attn",
    q="q_proj", k="k_proj", v="v_proj", o="out_proj", size_attrs=(("num_heads", "heads"),), sub_config="vision_config",
))
