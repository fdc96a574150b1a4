"""Why a model type headprune has checked is refused: the text `get_adapter`'s error and the coverage
table (docs/coverage.md) give, by model type. Only words: a type listed here has no adapter."""
from __future__ import annotations

_HYBRID = ("a hybrid: some layers are linear-attention or state-space mixers with no softmax heads; headprune prunes "
           "the attention layers of the hybrids in heads/hybrid.py (Qwen3-Next / Qwen3.5, Granite-4 hybrid, OLMo "
           "hybrid), and this family's attention layers have not been checked with one of their layouts (not done)")
_MLA = ("multi-head latent attention of its own layout: headprune prunes DeepSeek-V2/V3-style MLA (heads/latent.py: "
        "q_b_proj rows, kv_b_proj rows and o_proj columns per head), and this family's attention differs (not done)")
_INDEXER = "multi-head latent attention with a sparse token indexer inside the attention (DeepSeek sparse attention): "

_STACKS = ("several attention stacks (encoder self-attention, decoder self- and cross-attention) laid out unlike "
           "Whisper's, BART's and T5's, which heads/stacks.py prunes: no stacked adapter says where this family's "
           "heads and per-head terms are (not done)")
_SINKS = ("per-head attention sinks (`sinks`, one logit per query head, read inside the attention kernel) are not "
          "sliced with the heads (not done)")
# Model types checked and refused, with what stands in the way (the coverage table lists them too).
REFUSED: dict[str, str] = {
    **dict.fromkeys(("bamba", "falcon_h1", "jamba", "kimi_linear", "bailing_hybrid", "lfm2", "lfm2_moe", "lfm3",
                     "qwen4_exp_text",
                     "minimax", "nemotron_h", "zamba", "zamba2", "recurrent_gemma"), _HYBRID),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"),
                    "a state-space / recurrent model: no attention heads"),
    **dict.fromkeys(("deepseek_v4", "longcat_flash", "axk2", "hy_v4"), _MLA),
    "deepseek_v32": _INDEXER + ("with the MLA layout its removal equals masking in one forward, but greedy generate() "
                                "with the cache gave other tokens than the masked model's (not done)"),
    "glm_moe_dsa": _INDEXER + ("its attention returns the indexer's output as a third value, which a layer left "
                               "without heads does not give (not done)"),
    **dict.fromkeys(("mvp", "prophetnet", "bigbird_pegasus", "longt5", "trocr", "moshi", "musicgen",
                     "musicgen_melody", "musicgen_decoder", "musicgen_melody_decoder"), _STACKS),
    **dict.fromkeys(("inkling2_text", "inkling2_loop_text"), _SINKS),
    "laguna": "head counts that vary per layer (num_attention_heads_per_layer) and a per-head output gate (not done)",
    "dory": "an RMSNorm over the concatenated heads' contexts (attn_sub_norm) before o_proj (not done)",
    "bloom": "ALiBi: each head's position bias slope is computed from the head count, so removing heads would change "
             "the kept heads' biases (not done)",
    "mpt": "ALiBi: each head's position bias slope is computed from the head count, so removing heads would change "
           "the kept heads' biases (not done)",
    "bitnet": "an RMSNorm over the concatenated heads' contexts (attn_sub_norm) before o_proj: removing a head changes "
              "the statistic the kept heads are divided by (not done)",
    "diffllama": "differential attention: heads are used in pairs whose softmax maps are subtracted (not done)",
    "doge": "dynamic mask attention: per-head dt_proj / A computed from the value states (not done)",
    "stablelm": "per-head LayerNorms as a list (q_layernorm / k_layernorm with qk_layernorm) applied by position: "
                "not sliced with the heads (not done)",
    "inkling_text": "per-head relative-position projections (r_proj) and separate sliding-window head counts "
                    "(not done)",
    "mimo_v2_flash": "values of their own head size (v_head_dim apart from head_dim): V rows and O columns per head "
                     "are not Q's (not done)",
    **dict.fromkeys(("gemma4_text", "gemma4_unified_text"),
                    "head_dim and head counts vary per layer (per-layer config attributes; not done)"),
    "big_bird": "block-sparse attention reshapes with the config's head count (not done)",
}
