"""The families added for issue 39 (tests/helpers.py MORE_FAMILIES): for each, one build per attention
implementation runs every check the parametrized tests of test_surgery / test_hf make for the
first families (tools.coverage.check_model): removal equals masking to 1e-5 under eager
and sdpa with a layer left without heads, a partly kept KV group and a whole one; greedy generate()
with the KV cache equals the masked model's; save_pruned / load_pruned reload equal; a uniform
whole-group layout reloads with plain from_pretrained where the config can say it. Then what sets
each family apart: the head rows of fused and whole-norm layouts, the cache that shrinks, Phi-3's
per-layer config view, OLMo 2's exact norm and what it costs."""
import copy

import pytest
import torch
import transformers as tf

from headprune import HeadMask, count_params, load_pruned, prune_heads, save_pruned
from tools.coverage import check_model
from headprune.heads.adapters import get_adapter
from tests.helpers import D, HEADS, HIDDEN, MORE_FAMILIES, PRUNE, inputs, tiny

TASKS = {"lm": "causal_lm", "mlm": "masked_lm", "image": "image_classification"}
# transformers offers no sdpa kernel for Gemma 2 (soft-capping) and gpt-oss (sinks): eager only
NO_SDPA = {"gemma2", "gpt_oss"}
# the families whose uniform whole-group layout is a plain checkpoint (their config says head_dim)
PLAIN = {"qwen3", "qwen3_moe", "gemma2", "gemma3_text", "mixtral", "smollm3", "granite", "phi3", "gpt_oss"}


@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_family_prunes_exactly(family, tmp_path):
    task = TASKS[MORE_FAMILIES[family][1]]
    result = check_model(lambda attn: tiny(family, attn), task, tmp=tmp_path)
    assert result["status"] == "passes", result
    checks = result["checks"]
    assert checks["eager"] == "passes"
    assert checks["sdpa"] == ("passes" if family not in NO_SDPA else checks["sdpa"])
    if family in NO_SDPA:
        assert checks["sdpa"].startswith("not offered")
    if task == "causal_lm":
        assert checks["generate (eager)"] == "passes"
        assert family in NO_SDPA or checks["generate (sdpa)"] == "passes"
    assert checks["reload"] == "passes"
    if family in PLAIN:
        assert checks["plain"] == "passes"
    else:
        assert checks["plain"].startswith(("layout file", "one KV group")), checks["plain"]


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3", "olmo2", "gpt_neox"])
def test_the_kv_cache_keeps_only_the_kept_kv_heads(family):
    model = prune_heads(tiny(family, "eager"), PRUNE)
    with torch.no_grad():
        cache = model(**inputs(batch=2, tokens=5), use_cache=True).cache
    kv = get_adapter(model).num_kv_heads(model.config)
    # layer 0: none; layer 1: one head of four gone (GQA: both groups stay); layer 2: one group (or 2 heads) gone
    assert [layer.keys.shape[1] for layer in cache.layers] == [0, kv if kv < HEADS else 3, kv // 2 if kv < HEADS else 2]
    assert cache.get_seq_length() == 5


@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_head_rows_cover_each_projection_once(family):
    """The rows the adapter gives each kept head partition every projection (OLMo 2: Q and K keep
    every head's rows, and the removed heads' rows belong to no head)."""
    model = prune_heads(tiny(family, "eager"), {1: [1], 2: [2, 3]})
    adapter = get_adapter(model)
    for layer in range(3):
        covered: dict = {}
        for parts in adapter.head_rows(model, layer).values():
            for part, r in parts.items():
                covered.setdefault((id(r.module), r.outputs), [r.module, r.outputs, set(), set()])
                covered[(id(r.module), r.outputs)][2].update(r.index)
                covered[(id(r.module), r.outputs)][3].add(part)
        for module, outputs, index, parts in covered.values():
            width = module.weight.shape[0 if outputs else 1]
            if adapter.projection_norms and outputs and parts in ({"q"}, {"k"}):  # whole: every head's rows
                assert width == {"q": HEADS, "k": 2}[parts.pop()] * D and index <= set(range(width))
            else:
                assert sorted(index) == list(range(width)), (layer, parts, width)


def test_gpt_neox_rows_are_per_head_interleaved():
    model = tiny("gpt_neox", "eager")
    attn = model.gpt_neox.layers[0].attention
    rows = get_adapter(model).head_rows(model, 0)
    d = HIDDEN // HEADS
    x = torch.randn(1, 2, HIDDEN)
    fused = attn.query_key_value(x).view(1, 2, HEADS, 3 * d)  # how the forward reads it
    for head in range(HEADS):
        for i, part in enumerate(("q", "k", "v")):
            r = rows[head][part]
            torch.testing.assert_close(attn.query_key_value(x)[..., r.start:r.stop], fused[..., head, i * d:(i + 1) * d])


def test_phi3_layers_see_their_own_head_counts():
    """Phi-3 splits qkv_proj at config.num_attention_heads * head_dim: each pruned layer reads its
    own count through a view of the config that follows the model's (attention implementation)."""
    from headprune.heads.surgery import LayerConfig

    model = prune_heads(tiny("phi3", "eager"), {1: [2, 3], 2: [1]})
    layers = model.model.layers
    assert isinstance(layers[1].self_attn.config, LayerConfig) and layers[0].self_attn.config is model.config
    assert layers[1].self_attn.config.num_attention_heads == 2 and layers[1].self_attn.num_key_value_heads == 1
    assert layers[2].self_attn.config.num_attention_heads == 4  # 3 kept, padded to 2 groups x 2
    assert model.config.num_attention_heads == HEADS  # the model's config still describes the original
    model.set_attn_implementation("sdpa")
    assert layers[1].self_attn.config._attn_implementation == "sdpa"
    twin = copy.deepcopy(model)
    assert twin.model.layers[1].self_attn.config.base is twin.config
    torch.testing.assert_close(twin(**inputs()).logits, model(**inputs()).logits)


def test_olmo2_norm_reads_every_head_and_costs_only_v_and_o():
    """OLMo 2's q_norm / k_norm divide by the RMS over the whole projection: a kept head's queries
    depend on the removed heads' rows, so Q and K keep them (exact: equal to masking; slicing them
    away would change the kept heads). What removal saves is V rows, O columns, attention and cache."""
    dense = tiny("olmo2", "eager")
    model = prune_heads(copy.deepcopy(dense), {1: [2, 3]})
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.shape == (HEADS * D, HIDDEN) and attn.k_proj.weight.shape == (2 * D, HIDDEN)
    assert attn.v_proj.weight.shape == (D, HIDDEN) and attn.o_proj.weight.shape == (HIDDEN, 2 * D)
    saved = count_params(dense)["attention"] - count_params(model)["attention"]
    assert saved == 2 * D * HIDDEN + D * HIDDEN  # two heads' O columns and one KV head's V rows only
    masked = copy.deepcopy(dense)
    HeadMask.for_model(masked).prune([(1, 2), (1, 3)])
    batch = inputs()
    torch.testing.assert_close(model(**batch).logits, masked(**batch).logits, atol=1e-5, rtol=0)
    with torch.no_grad():  # the norm's statistic matters: a norm over the kept heads alone is another model
        q = attn.q_proj(torch.randn(1, 3, HIDDEN))
        kept = attn.q_norm.weight[: 2 * D] * q[..., : 2 * D] * torch.rsqrt(q[..., : 2 * D].pow(2).mean(-1, keepdim=True) + 1e-6)
        assert not torch.allclose(attn.q_norm(q), kept, atol=1e-3)


def test_uniform_qwen3_loads_with_plain_transformers(tmp_path):
    model = prune_heads(tiny("qwen3", "eager"), {layer: [2, 3] for layer in range(3)})
    saved = save_pruned(model, tmp_path)
    assert saved.plain_hf, saved.why
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert (plain.config.num_attention_heads, plain.config.num_key_value_heads, plain.config.head_dim) == (2, 1, 16)
    batch = inputs()
    torch.testing.assert_close(plain(**batch).logits, model(**batch).logits, atol=0, rtol=0)
    assert load_pruned(tmp_path).config.num_attention_heads == 2


def test_a_vision_tower_is_pruned_where_its_model_keeps_it():
    """CLIP's classifier keeps its vision tower at vision_model.encoder.layers and reads head counts
    from vision_config; its vision model at encoder.layers."""
    model = tiny("clip", "eager")
    adapter = get_adapter(model)
    assert adapter.blocks(model) == list(model.vision_model.encoder.layers)
    assert adapter.num_heads(model.config) == HEADS
    vision = tf.CLIPVisionModel(tf.CLIPVisionConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2,
                                                    intermediate_size=64, image_size=32, patch_size=8)).eval()
    assert get_adapter(vision).blocks(vision) == list(vision.encoder.layers)
    pixels = torch.randn(1, 3, 32, 32)
    masked = copy.deepcopy(vision)
    HeadMask.for_model(masked).prune([(0, 1), (1, 0), (1, 1), (1, 2), (1, 3)])
    prune_heads(vision, {0: [1], 1: [0, 1, 2, 3]})
    with torch.no_grad():
        torch.testing.assert_close(vision(pixel_values=pixels).pooler_output, masked(pixel_values=pixels).pooler_output,
                                   atol=1e-5, rtol=0)



@pytest.mark.parametrize("family", ["phi3", "olmo2", "gpt_neox", "gemma2", "qwen3"])
def test_every_metric_scores_the_new_decoders(family):
    """Each metric runs on a pruned layout (layer 1 keeps a partly kept KV group: zero queries padded
    in under GQA) and scores the removed head 0."""
    from headprune.scoring import METRICS, score_heads

    model = prune_heads(tiny(family, "eager"), {1: [1]})
    batch = dict(inputs(), labels=inputs()["input_ids"])
    for metric in sorted(set(METRICS) - {"random", "l0_gates", "confidence"}):  # confidence needs an EOS id: below
        scores = score_heads(model, [batch], metric=metric)
        assert scores.shape == (3, HEADS) and torch.isfinite(scores).all() and scores[1, 1] == 0, metric


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_attention_maps_of_a_padded_layer_are_the_kept_heads(family):
    """Layer 1 keeps heads 0, 2, 3 of 4 (2 KV groups): its kernel computes 4 query slots, one of them
    padded. Entropy and confidence read each kept head's own map: the dense model's for that head
    (layer 0 is untouched, so layer 1 sees the same input)."""
    from headprune.scoring import score_heads

    dense = tiny(family, "eager")
    pruned = prune_heads(copy.deepcopy(dense), {1: [1]})
    batch = inputs()
    for metric in ("entropy", "confidence"):
        want, got = score_heads(dense, [batch], metric=metric), score_heads(pruned, [batch], metric=metric)
        torch.testing.assert_close(got[:2, [0, 2, 3]], want[:2, [0, 2, 3]], atol=1e-5, rtol=0)
        assert got[1, 1] == 0


def test_gpt_oss_sinks_follow_their_heads():
    """gpt-oss adds one learned sink logit per query head inside the kernel: the kept heads keep
    theirs, and a zero query padded into a partly kept KV group gets a kept head's (its context is
    dropped); the optimizer-state record says which entries were kept."""
    from headprune.heads.surgery import Sliced

    model = tiny("gpt_oss", "eager")
    dense = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    sliced: list[Sliced] = []
    prune_heads(model, {1: [1], 2: [2, 3]}, sliced=sliced)
    attn = [layer.self_attn for layer in model.model.layers]
    torch.testing.assert_close(attn[1].sinks, dense[1][[0, 0, 2, 3]])  # slots: head 0, padding, heads 2 and 3
    torch.testing.assert_close(attn[2].sinks, dense[2][[0, 1]])
    assert [s.index.tolist() for s in sliced if s.new is attn[1].sinks] == [[0, 0, 2, 3]]
    prune_heads(model, {1: [0]})  # again, from the sliced parameter: group 0 goes whole
    torch.testing.assert_close(attn[1].sinks, dense[1][[2, 3]])


@pytest.mark.parametrize("model_type", ["afmoe", "beam"])
def test_output_gated_attention_prunes_exactly(model_type):
    """AFMoE and Beam multiply each head's context by a sigmoid gate (gate_proj rows per head; Beam
    adds a per-head gate bias): the gate rows go with their heads and are zero-padded like the
    queries in a partly kept KV group. Their tiny models come from coverage.tiny_config."""
    from tools.coverage import check_model_type

    row = check_model_type(model_type, ["causal_lm"])
    assert row["status"] == "passes", row
    assert row["checks"]["eager"] == row["checks"]["reload"] == row["checks"]["generate (eager)"] == "passes"


BEIT = {"beit": (tf.BeitConfig, tf.BeitForImageClassification),
        "data2vec-vision": (tf.Data2VecVisionConfig, tf.Data2VecVisionForImageClassification)}


def beit_tables(model) -> list:
    """Each layer's relative position bias table (BEiT: in the block; Data2Vec-Vision: in its self-attention)."""
    if hasattr(model, "beit"):
        return [layer.relative_position_bias.relative_position_bias_table for layer in model.beit.layers]
    return [layer.attention.attention.relative_position_bias.relative_position_bias_table
            for layer in model.data2vec_vision.encoder.layer]


def tiny_beit(attn: str = "eager", seed: int = 0, family: str = "beit", **extra):
    """A tiny BEiT (or Data2Vec-Vision) classifier with a relative position bias table per layer
    (beit-base-patch16-224's setting), the tables drawn (they start at zero) so that each head's column matters."""
    config_cls, model_cls = BEIT[family]
    config = config_cls(**{**dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=3,
                                  intermediate_size=64, image_size=32, patch_size=8, num_labels=3,
                                  use_relative_position_bias=True), **extra})
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation=attn).eval()
    if config.use_relative_position_bias:
        with torch.no_grad():
            for table in beit_tables(model):
                table.normal_(0, 2.0)
    return model


@pytest.mark.parametrize("family", sorted(BEIT))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_beit_relative_position_bias_tables_go_with_their_heads(attn, family, tmp_path):
    """BEiT's block adds its table's per-head maps to the attention mask: each layer keeps its kept
    heads' columns (a layer left without heads keeps its table: the block still computes the bias the
    headless attention ignores); a second request slices by position; removal equals masking; reload."""
    from headprune.heads.surgery import Sliced

    dense = tiny_beit(attn, family=family)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    sliced: list[Sliced] = []
    model = copy.deepcopy(dense)
    table = beit_tables(model)[1]  # replaced by prune_heads
    prune_heads(model, {0: [0, 1, 2, 3], 1: [1], 2: [0, 3]}, sliced=sliced)
    prune_heads(model, {2: [1]})  # layer 2 keeps 1, 2 -> 2: the second of its two columns
    tables, before = beit_tables(model), beit_tables(dense)
    for layer, kept in enumerate(([0, 1, 2, 3], [0, 2, 3], [2])):
        torch.testing.assert_close(tables[layer], before[layer][:, kept], atol=0, rtol=0)
    assert [s.index.tolist() for s in sliced if s.old is table] == [[0, 2, 3]]
    masked = copy.deepcopy(dense)
    HeadMask.for_model(masked).prune([(0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (2, 0), (2, 1), (2, 3)])
    with torch.no_grad():
        got, want = model(pixel_values=pixels).logits, masked(pixel_values=pixels).logits
        assert (got - dense(pixel_values=pixels).logits).abs().max() > 1e-4  # the heads did matter
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    save_pruned(model, tmp_path / family)
    loaded = load_pruned(tmp_path / family, attn_implementation=attn).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixel_values=pixels).logits, got, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", sorted(BEIT))
def test_a_shared_beit_position_bias_is_refused(family):
    model = tiny_beit(family=family, use_shared_relative_position_bias=True, use_relative_position_bias=False)
    with pytest.raises(NotImplementedError, match="use_shared_relative_position_bias=True: one relative position"):
        prune_heads(model, {1: [0]})


@pytest.mark.parametrize("model_type", ["beit", "data2vec-vision", "dinov2_with_registers", "vit_msn", "ijepa",
                                        "metaclip_2", "siglip2"])
def test_more_vision_encoders_pass_the_coverage_check(model_type):
    """ViT's layout (DINOv2 with registers, ViT-MSN, I-JEPA), CLIP's vision tower (MetaCLIP 2, SigLIP 2 with
    its NaFlex patches, one image padded) and BEiT (its tiny config with per-layer relative position bias
    tables, Data2Vec-Vision the same in BERT's layout) from coverage.tiny_config."""
    from tools.coverage import check_model_type

    row = check_model_type(model_type, ["image_classification"])
    assert row["status"] == "passes", row
    assert row["checks"]["eager"] == row["checks"]["sdpa"] == row["checks"]["reload"] == "passes"


def _cohere_qk_norm(attn: str = "eager"):
    """A tiny Cohere with `use_qk_norm`: q_norm / k_norm are LayerNorms with a weight row per query /
    KV head ((heads, head_dim)), drawn so that every head's row differs."""
    from tools.coverage import _builder

    model = _builder("cohere", "causal_lm", {"use_qk_norm": True})(attn)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=generator))
    return model


def test_per_head_norm_weights_go_with_their_heads(tmp_path):
    """Cohere's q/k norms under `use_qk_norm` hold a (heads, head_dim) weight: the kept query slots
    keep their rows (a zero query padded into a partly kept KV group gets a kept head's row, as the
    sinks do), the kept KV heads theirs; removal equals masking (eager, sdpa, generate), reloads, and
    a uniform layout loads with plain from_pretrained (the config's head counts size the norms)."""
    from headprune.heads.surgery import Sliced

    model = _cohere_qk_norm()
    attn = [layer.self_attn for layer in model.model.layers]
    dense = [(a.q_norm.weight.detach().clone(), a.k_norm.weight.detach().clone()) for a in attn]
    assert dense[0][0].shape == (4, 16) and dense[0][1].shape == (2, 16)  # coverage.SIZES: 4 heads, 2 KV heads
    sliced: list[Sliced] = []
    prune_heads(model, {1: [1], 2: [2, 3]}, sliced=sliced)
    torch.testing.assert_close(attn[1].q_norm.weight, dense[1][0][[0, 0, 2, 3]])  # head 0, padding, 2, 3
    torch.testing.assert_close(attn[1].k_norm.weight, dense[1][1])
    torch.testing.assert_close(attn[2].q_norm.weight, dense[2][0][[0, 1]])
    torch.testing.assert_close(attn[2].k_norm.weight, dense[2][1][[0]])
    assert [s.index.tolist() for s in sliced if s.new is attn[2].k_norm.weight] == [[0]]
    result = check_model(_cohere_qk_norm, "causal_lm", tmp=tmp_path)
    assert result["status"] == "passes", result
    assert result["checks"]["plain"] == result["checks"]["generate (sdpa)"] == "passes"
