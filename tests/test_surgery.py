"""heads/surgery.py: physical head removal. The pruned model computes what the masked model
computes, for every supported family, with uneven heads per layer and a layer with no heads left;
scale_heads equals a fractional mask. (Saving and loading pruned models: test_hf.py; the
adapters' head rows: test_adapters.py.)"""
import copy

import pytest
import torch
import transformers as tf

from headprune import HeadMask, count_params, heads_of_kv_groups, kv_group_heads, prune_heads
from headprune.heads.adapters import get_adapter
from tests.helpers import D, DECODERS, FAMILIES, HEADS, HIDDEN, PRUNE, V, inputs, tiny


def pairs(heads: dict) -> list:
    return [(layer, h) for layer, ids in heads.items() for h in ids]


def masked_copy(model, heads: dict):
    """A copy of `model` with `heads` gated off by a HeadMask."""
    masked = copy.deepcopy(model)
    HeadMask.for_model(masked).prune(pairs(heads))
    return masked


@torch.no_grad()
def logits(model, batch: dict) -> torch.Tensor:
    return model(**batch).logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pruned_model_equals_masked_model(family, attn):
    model = tiny(family, attn)
    masked = masked_copy(model, PRUNE)
    pruned = prune_heads(model, PRUNE)
    assert pruned is model
    assert pruned.headprune_layout == [[], [0, 2, 3], [0, 1]]
    assert get_adapter(pruned).num_heads(pruned.config) == HEADS  # config still describes the original
    batch = inputs()
    out = logits(pruned, batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, logits(masked, batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", DECODERS)
def test_decoder_generates_the_same_tokens_with_a_smaller_cache(family, attn):
    model = tiny(family, attn)
    masked = masked_copy(model, PRUNE)
    pruned = prune_heads(model, PRUNE)
    batch = inputs(batch=2, tokens=7)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = masked.generate(**batch, **kwargs)
    torch.testing.assert_close(pruned.generate(**batch, **kwargs), expected, atol=0, rtol=0)

    with torch.no_grad():
        full_cache = masked(**batch, use_cache=True).cache
        cache = pruned(**batch, use_cache=True).cache
    kv_heads = get_adapter(model).num_kv_heads(model.config)
    assert [layer.keys.shape[1] for layer in full_cache.layers] == [kv_heads] * 3
    kept_kv = [0, kv_heads, kv_heads // 2]  # GQA: layer 1 keeps both groups; no GQA: 4 -> 3 heads
    if kv_heads == HEADS:
        kept_kv[1] = 3
    assert [layer.keys.shape[1] for layer in cache.layers] == kept_kv
    assert cache.get_seq_length() == full_cache.get_seq_length() == 7


def test_llama_static_cache_generation_matches():
    model = tiny("llama")
    masked = masked_copy(model, PRUNE)
    prune_heads(model, PRUNE)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    batch = inputs(batch=2, tokens=5)
    torch.testing.assert_close(model.generate(**batch, **kwargs), masked.generate(**batch, **kwargs), atol=0, rtol=0)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "qwen2"])
def test_parameter_counts_drop_by_exactly_the_removed_slices(family):
    model = tiny(family)
    before = count_params(model)
    prune_heads(model, PRUNE)
    after = count_params(model)
    bias = get_adapter(model).name in ("bert", "gpt2") or family == "qwen2"
    slice_in = HIDDEN * D + (D if bias else 0)  # one head's rows of Q (or K, or V), with bias
    slice_out = D * HIDDEN  # one head's columns of O (O's bias stays)
    removed_q = 7
    removed_kv = 3 if family in ("llama", "qwen2") else 7  # GQA: groups of layers 0 (2) and 2 (1)
    removed = removed_q * (slice_in + slice_out) + removed_kv * 2 * slice_in
    assert before["attention"] - after["attention"] == removed
    assert before["total"] - after["total"] == removed


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_successive_calls_use_original_numbering(family):
    model = tiny(family)
    masked = masked_copy(model, {0: [1, 2], 1: [3], 2: [0, 1, 2, 3]})
    prune_heads(model, {0: [1], 2: [0, 1]})
    prune_heads(model, [(0, 2), (0, 1), (1, 3), (2, 2), (2, 3)])  # (0, 1) is already gone: skipped
    assert model.headprune_layout == [[0, 3], [0, 1, 2], []]
    batch = inputs()
    torch.testing.assert_close(logits(model, batch), logits(masked, batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attach_first", [True, False], ids=["mask-then-prune", "prune-then-mask"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_head_mask_on_pruned_model_gates_by_original_id(family, attach_first):
    model = tiny(family)
    physical = {0: [1], 2: [0, 3]}
    gated = [(0, 2), (1, 1), (2, 1)]
    masked = masked_copy(model, {0: [1, 2], 1: [1], 2: [0, 1, 3]})
    if attach_first:  # as in HeadPruneModule: mask attached at construction, removal after fit
        mask = HeadMask.for_model(model)
        prune_heads(model, physical)
    else:
        prune_heads(model, physical)
        mask = HeadMask.for_model(model)
    mask.prune(gated)
    batch = inputs()
    torch.testing.assert_close(logits(model, batch), logits(masked, batch), atol=1e-5, rtol=0)
    with mask.differentiable_gates(batch_size=3) as gates:
        model(**batch).logits.sum().backward()
    assert gates.grad.shape == (3, 3, HEADS) and torch.isfinite(gates.grad).all()


def test_kv_group_selection_shrinks_the_kv_projections():
    model = tiny("llama")
    assert kv_group_heads(model) == [[0, 1], [2, 3]]
    heads = heads_of_kv_groups(model, {1: [0], 2: [0, 1]})
    assert heads == {1: [0, 1], 2: [0, 1, 2, 3]}
    masked = masked_copy(model, heads)
    prune_heads(model, heads)
    attn = get_adapter(model).attention(model.model.layers[1])
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (D, HIDDEN)
    assert attn.q_proj.weight.shape == (2 * D, HIDDEN) and attn.num_key_value_groups == 2
    assert attn._headprune_hooks == []  # whole groups: no padded queries needed
    batch = inputs()
    torch.testing.assert_close(logits(model, batch), logits(masked, batch), atol=1e-5, rtol=0)


def test_bad_requests_name_the_value_and_the_range():
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"layer 3 .*0\.\.2"):
        prune_heads(model, {3: [0]})
    with pytest.raises(ValueError, match=r"head 4 .*0\.\.3"):
        prune_heads(model, {0: [4]})
    with pytest.raises(ValueError, match=r"head -1 .*0\.\.3"):
        prune_heads(model, [(1, -1)])
    with pytest.raises(ValueError, match=r"KV group 2 .*0\.\.1"):
        heads_of_kv_groups(model, {0: [2]})
    assert not hasattr(model, "headprune_layout")  # nothing was touched


def test_unsupported_architecture_says_how_to_add_one():
    model = tf.AutoModelForCausalLM.from_config(tf.CodeGenConfig(
        vocab_size=V, n_embd=HIDDEN, n_head=HEADS, n_layer=1, n_positions=64, rotary_dim=4, bos_token_id=1, eos_token_id=2))
    with pytest.raises(NotImplementedError, match=r"codegen.*CodeGenAttention.*\['out_proj', 'qkv_proj'\].*"
                                                  r"bert.*gpt2.*llama.*docs/adding_an_architecture.md"):
        prune_heads(model, {0: [0]})


# -- bad requests are named ---------------------------------------------------------------------------
@pytest.mark.parametrize("heads,pattern", [
    ([1, 2], r"heads: 1 is not a \(layer, head\) pair"),
    ({0: [1.5]}, r"head \(layer 0\) id 1\.5 is not an integer"),
    ({0: 1}, r"heads\[0\]=1 is not a list of head ids"),
    ([(0.5, 1)], r"layer id 0\.5 is not an integer"),
])
def test_malformed_head_requests_are_named(heads, pattern):
    with pytest.raises(ValueError, match=pattern):
        prune_heads(tiny("bert"), heads)
    assert prune_heads(tiny("bert"), {0: [1.0]}).headprune_layout[0] == [0, 2, 3]  # 1.0 from JSON is head 1


def test_kv_groups_of_a_layer_that_does_not_exist_are_refused():
    with pytest.raises(ValueError, match=r"layer 7 is out of range: the model has layers 0\.\.2"):
        heads_of_kv_groups(tiny("llama"), {7: [0]})


@pytest.mark.parametrize("family", ["bert", "gpt2"])  # Linear and Conv1D output projections
def test_scale_heads_equals_fractional_mask(family):
    from headprune.heads.surgery import scale_heads

    model = tiny(family)
    batch = inputs()
    layers, heads = len(HeadMask.for_model(model, attach=False).mask), model.config.num_attention_heads
    factors = torch.rand(layers, heads, generator=torch.Generator().manual_seed(0))
    factors[1, 2] = 0.0  # removed physically below
    mask = HeadMask.for_model(model)
    mask.mask.copy_(factors)
    with torch.no_grad():
        gated = model(**batch).logits
    mask.detach()
    prune_heads(model, {1: [2]})  # scaling follows the physical layout
    scale_heads(model, factors)
    with torch.no_grad():
        scaled = model(**batch).logits
    assert torch.allclose(gated, scaled, atol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        scale_heads(model, torch.ones(layers + 1, heads))
