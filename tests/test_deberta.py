"""DeBERTa-v2 / v3 and DeBERTa (heads/adapters.py `deberta_v2`, `deberta`): disentangled attention adds,
per head, the products of the head's queries and keys with projected relative position embeddings
(c2p, p2c). With share_att_key (v2) the positions go through query_proj / key_proj; without it through
pos_key_proj (c2p) and pos_query_proj (p2c) (v1: pos_proj, pos_q_proj), whose rows must go with their
heads; v1 fuses Q/K/V per head in a bias-free in_proj and adds q_bias / v_bias per head. Built tiny from
config (no download): removal equals masking to 1e-5 (transformers offers only eager attention for
DeBERTa), uneven heads and a layer without heads, save_pruned / load_pruned, every metric on a pruned
layout; talking-head attention is refused."""
import copy

import pytest
import torch
import transformers as tf

from headprune import HeadMask, count_params, load_pruned, prune_heads, save_pruned
from tools.coverage import check_model
from headprune.heads.adapters import get_adapter
from headprune.heads.optimizer_state import head_parameter_slices
from headprune.scoring import METRICS

HEADS, HIDDEN, LAYERS = 4, 64, 3
D = HIDDEN // HEADS
# the position settings that change which weights a head owns (deberta-v3-base: shared keys, buckets,
# normed relative embeddings, no absolute positions)
POSITIONS = {
    "v3_shared": dict(relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=True, position_buckets=16,
                      norm_rel_ebd="layer_norm", position_biased_input=False),
    "own_c2p_p2c": dict(relative_attention=True, pos_att_type=["c2p", "p2c"], share_att_key=False,
                        max_relative_positions=16),
    "own_c2p": dict(relative_attention=True, pos_att_type=["c2p"], share_att_key=False),
    "own_p2c": dict(relative_attention=True, pos_att_type=["p2c"], share_att_key=False, position_buckets=8),
    "absolute": dict(),
}
# DeBERTa v1 (deberta-base: c2p|p2c, no absolute positions); its q_bias / v_bias start at zero, so the
# builder draws them to see them sliced
POSITIONS_V1 = {
    "v1_c2p_p2c": dict(relative_attention=True, pos_att_type=["c2p", "p2c"], position_biased_input=False),
    "v1_c2p": dict(relative_attention=True, pos_att_type=["c2p"], max_relative_positions=16),
    "v1_p2c": dict(relative_attention=True, pos_att_type=["p2c"]),
    "v1_absolute": dict(),
}
UNEVEN = {0: [0, 1, 2, 3], 1: [1], 2: [0, 3]}  # a layer without heads, one head gone, two heads gone


def tiny_deberta(positions: str, cls=None, attn: str = "eager", seed: int = 0, **extra):
    """A tiny DeBERTa-v2 (`POSITIONS`) or DeBERTa v1 (`POSITIONS_V1`) masked LM (or `cls`)."""
    v1 = positions in POSITIONS_V1
    config = (tf.DebertaConfig if v1 else tf.DebertaV2Config)(
        vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=64,
        max_position_embeddings=64, num_labels=2, **(POSITIONS_V1 if v1 else POSITIONS)[positions], **extra)
    cls = cls or (tf.DebertaForMaskedLM if v1 else tf.DebertaV2ForMaskedLM)
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn).eval()
    if v1:
        with torch.no_grad():
            for layer in model.deberta.encoder.layer:
                layer.attention.self.q_bias.normal_()
                layer.attention.self.v_bias.normal_()
    return model


def batch(n: int = 3, tokens: int = 11, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (n, tokens), generator=g)  # (B, T)
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0  # padding in one row
    return {"input_ids": ids, "attention_mask": mask}


def masked_copy(model, spec):
    twin = copy.deepcopy(model)
    HeadMask.for_model(twin).prune([(layer, h) for layer, heads in spec.items() for h in heads])
    return twin


@pytest.mark.parametrize("positions", sorted(POSITIONS) + sorted(POSITIONS_V1))
def test_deberta_passes_the_coverage_checks(positions, tmp_path):
    """mask == removal (a layer without heads, one head gone, the last head gone) and reload equal."""
    result = check_model(lambda attn: tiny_deberta(positions, attn=attn), "masked_lm", tmp=tmp_path)
    assert result["status"] == "passes", result
    assert result["adapter"] == ("deberta" if positions in POSITIONS_V1 else "deberta_v2")
    assert result["checks"]["eager"] == "passes" and result["checks"]["reload"] == "passes"
    assert result["checks"]["sdpa"].startswith("not offered")  # transformers has no sdpa DeBERTa-v2


@pytest.mark.parametrize("positions", sorted(POSITIONS))
def test_uneven_removal_equals_masking_and_slices_the_position_projections(positions, tmp_path):
    dense = tiny_deberta(positions)
    model = prune_heads(copy.deepcopy(dense), UNEVEN)
    want = masked_copy(dense, UNEVEN)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch()).logits, want(**batch()).logits, atol=1e-5, rtol=0)
    kept = {1: [0, 2, 3], 2: [1, 2]}
    for layer, heads in kept.items():
        new, old = model.deberta.encoder.layer[layer].attention.self, dense.deberta.encoder.layer[layer].attention.self
        assert (new.num_attention_heads, new.all_head_size) == (len(heads), len(heads) * D)
        rows = torch.cat([torch.arange(h * D, (h + 1) * D) for h in heads])
        for name in ("query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj"):
            if hasattr(old, name):
                torch.testing.assert_close(getattr(new, name).weight, getattr(old, name).weight[rows], atol=0, rtol=0)
                torch.testing.assert_close(getattr(new, name).bias, getattr(old, name).bias[rows], atol=0, rtol=0)
    assert model.deberta.encoder.layer[0].attention.self.query_proj.weight.shape == (0, HIDDEN)
    # the pruned layout reloads to the same outputs
    save_pruned(model, tmp_path / "pruned")
    loaded = load_pruned(tmp_path / "pruned", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch()).logits, model(**batch()).logits, atol=1e-6, rtol=0)


def test_position_rows_are_what_the_forward_reads_per_head():
    """The forward views pos_key_proj's output (B, T, H * D) as H heads of D features
    (transpose_for_scores): head h's c2p keys are the rows the adapter gives head h."""
    model = prune_heads(tiny_deberta("own_c2p_p2c"), {1: [1]})
    attn = model.deberta.encoder.layer[1].attention.self
    rows = get_adapter(model).head_rows(model, 1)
    assert sorted(rows) == [0, 2, 3]
    x = torch.randn(1, 5, HIDDEN)
    for path, module in (("self.pos_key_proj", attn.pos_key_proj), ("self.pos_query_proj", attn.pos_query_proj)):
        per_head = attn.transpose_for_scores(module(x), attn.num_attention_heads)  # (B * h, T, D)
        for slot, head in enumerate((0, 2, 3)):
            r = rows[head][path]
            assert r.module is module
            torch.testing.assert_close(module(x)[0, :, r.start:r.stop], per_head[slot])


@pytest.mark.parametrize("positions", ["v3_shared", "own_c2p_p2c"])
def test_head_rows_partition_every_projection(positions):
    model = prune_heads(tiny_deberta(positions), {1: [1], 2: [2, 3]})
    adapter = get_adapter(model)
    for layer in range(LAYERS):
        covered: dict = {}
        for parts in adapter.head_rows(model, layer).values():
            for r in parts.values():
                covered.setdefault((id(r.module), r.outputs), [r.module, r.outputs, set()])[2].update(r.index)
        for module, outputs, index in covered.values():
            assert sorted(index) == list(range(module.weight.shape[0 if outputs else 1]))
        n_projections = 4 + (2 if positions == "own_c2p_p2c" else 0)
        assert len(covered) == n_projections


def test_count_params_and_optimizer_slices_include_the_position_projections():
    dense = tiny_deberta("own_c2p_p2c")
    model = prune_heads(copy.deepcopy(dense), {1: [1]})
    # q, k, v rows (+ bias), o columns, pos_key / pos_query rows (+ bias)
    per_head = 3 * (D * HIDDEN + D) + D * HIDDEN + 2 * (D * HIDDEN + D)
    assert count_params(dense)["attention"] - count_params(model)["attention"] == per_head
    slices = head_parameter_slices(model, 1, 2)
    attn = model.deberta.encoder.layer[1].attention.self
    owned = {id(p) for p, _, _ in slices}
    assert {id(attn.pos_key_proj.weight), id(attn.pos_query_proj.weight), id(attn.pos_query_proj.bias)} <= owned
    # head 2 sits second among the kept heads 0, 2, 3: its rows D..2D
    assert [(d, s) for p, d, s in slices if p is attn.pos_key_proj.weight] == [(0, slice(D, 2 * D))]


@pytest.mark.parametrize("positions", ["v3_shared", "own_c2p_p2c", "v1_c2p_p2c"])
def test_every_metric_scores_a_pruned_deberta_as_the_masked_one(positions):
    """Each metric on the physically pruned classifier equals the metric on the masked one (the
    removed heads score 0, layer 0 has none left)."""
    v1 = positions in POSITIONS_V1
    dense = tiny_deberta(positions, tf.DebertaForSequenceClassification if v1 else
                         tf.DebertaV2ForSequenceClassification)
    data = [dict(batch(), labels=torch.tensor([0, 1, 1])), dict(batch(n=2, seed=1), labels=torch.tensor([1, 0]))]
    pruned = prune_heads(copy.deepcopy(dense), UNEVEN)
    options = {"l0_gates": {"steps": 3}, "confidence": {"eos_token_ids": [2]}}
    alive = torch.ones(LAYERS, HEADS, dtype=torch.bool)
    for layer, heads in UNEVEN.items():
        alive[layer, heads] = False
    for name in sorted(set(METRICS) - {"random"}):
        masked = copy.deepcopy(dense)
        mask = HeadMask.for_model(masked)
        mask.prune([(layer, h) for layer, heads in UNEVEN.items() for h in heads])
        want = METRICS[name](masked, mask, data, **options.get(name, {}))
        got_mask = HeadMask.for_model(pruned)
        got_mask.prune([(layer, h) for layer, heads in UNEVEN.items() for h in heads])
        got = METRICS[name](pruned, got_mask, data, **options.get(name, {}))
        got_mask.detach()
        assert got.shape == (LAYERS, HEADS) and torch.isfinite(got).all(), name
        assert (got[~alive] == 0).all() and (got[alive] != 0).all(), name
        if name != "l0_gates":  # trains gates with sampled noise: its own run each time
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("positions", sorted(POSITIONS_V1))
def test_deberta_v1_uneven_removal_keeps_each_heads_rows_and_biases(positions, tmp_path):
    """v1's in_proj is viewed (B, T, H, 3 * D): head h owns rows [q_h | k_h | v_h]; q_bias / v_bias
    hold D entries per head; pos_proj / pos_q_proj D rows per head."""
    from headprune.heads.surgery import Sliced

    dense = tiny_deberta(positions)
    sliced: list[Sliced] = []
    model = copy.deepcopy(dense)
    q_bias = model.deberta.encoder.layer[1].attention.self.q_bias  # replaced by prune_heads
    prune_heads(model, UNEVEN, sliced=sliced)
    want = masked_copy(dense, UNEVEN)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch()).logits, want(**batch()).logits, atol=1e-5, rtol=0)
    for layer, heads in {1: [0, 2, 3], 2: [1, 2]}.items():
        new, old = model.deberta.encoder.layer[layer].attention.self, dense.deberta.encoder.layer[layer].attention.self
        assert (new.num_attention_heads, new.all_head_size) == (len(heads), len(heads) * D)
        fused = torch.cat([torch.arange(3 * h * D, 3 * (h + 1) * D) for h in heads])
        rows = torch.cat([torch.arange(h * D, (h + 1) * D) for h in heads])
        torch.testing.assert_close(new.in_proj.weight, old.in_proj.weight[fused], atol=0, rtol=0)
        for name in ("q_bias", "v_bias"):
            torch.testing.assert_close(getattr(new, name), getattr(old, name)[rows], atol=0, rtol=0)
        for name in ("pos_proj", "pos_q_proj"):
            if hasattr(old, name):
                torch.testing.assert_close(getattr(new, name).weight, getattr(old, name).weight[rows], atol=0, rtol=0)
    assert [s.index.tolist() for s in sliced if s.old is q_bias] == [list(range(D)) + list(range(2 * D, 4 * D))]
    save_pruned(model, tmp_path / "pruned")
    loaded = load_pruned(tmp_path / "pruned", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch()).logits, model(**batch()).logits, atol=1e-6, rtol=0)


def test_deberta_v1_pruned_twice_equals_masking():
    """Head ids stay the original ones: a second request slices the already sliced biases by position."""
    dense = tiny_deberta("v1_c2p_p2c")
    model = prune_heads(prune_heads(copy.deepcopy(dense), {1: [0], 2: [1]}), {1: [2], 2: [3]})
    want = masked_copy(dense, {1: [0, 2], 2: [1, 3]})
    with torch.no_grad():
        torch.testing.assert_close(model(**batch()).logits, want(**batch()).logits, atol=1e-5, rtol=0)


def test_talking_heads_are_refused_before_any_work():
    model = tiny_deberta("v1_c2p_p2c", talking_head=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for attempt in (lambda: prune_heads(model, {1: [0]}), lambda: HeadMask.for_model(model)):
        with pytest.raises(NotImplementedError, match=r"model_type='deberta' with talking_head=True: talking-head"):
            attempt()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_pre_hooks for m in model.modules())


@pytest.mark.slow  # 12-25 s each (torch.onnx export)
@pytest.mark.parametrize("positions", ["own_c2p_p2c", "v1_c2p_p2c"])
def test_a_pruned_deberta_exports_to_onnx(positions, tmp_path):
    """The pruned classifier (a layer without heads, uneven heads) exported at one shape agrees with
    PyTorch at another (ONNX Runtime); a weight changed after the export is flagged."""
    from headprune.deploy.onnx import check_onnx, export_onnx, judge

    v1 = positions in POSITIONS_V1
    model = prune_heads(tiny_deberta(positions, tf.DebertaForSequenceClassification if v1 else
                                     tf.DebertaV2ForSequenceClassification), UNEVEN)
    path = export_onnx(model, tmp_path / "model.onnx")
    figures = check_onnx(model, path)
    assert judge(figures) == [] and figures["logits_shape"] == [3, 2], figures
    with torch.no_grad():
        model.classifier.weight.mul_(2.0)
    assert judge(check_onnx(model, path))


def test_the_default_sdpa_is_refused_naming_the_eager_setting(tmp_path):
    """DeBERTa has only eager attention in transformers: the CLI's default (sdpa) must be refused
    naming `model.attn_implementation=eager`, not with transformers' own message (issue 56)."""
    from headprune.models.build import build_model

    config = tf.DebertaV2Config(vocab_size=100, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                intermediate_size=64)
    tf.DebertaV2ForSequenceClassification(config).save_pretrained(tmp_path / "trained")
    config.save_pretrained(tmp_path / "config_only")
    for folder, random_init in ((tmp_path / "trained", False), (tmp_path / "config_only", True)):
        with pytest.raises(ValueError, match=r"model\.attn_implementation=sdpa .*deberta-v2.*allowed: "
                                             r"model\.attn_implementation=eager"):
            build_model(str(folder), random_init=random_init)
    assert build_model(str(tmp_path / "trained"), attn_implementation="eager") is not None
