"""Physical head removal: the pruned model computes what the masked model computes, for every
supported family, with uneven heads per layer and a layer with no heads left."""
import copy
import os
import stat

import pytest
import torch
import transformers as tf
from transformers.pytorch_utils import Conv1D

from headprune import HeadMask, count_params, heads_of_kv_groups, kv_group_heads, load_pruned, prune_heads, save_pruned
from headprune.atomic import write_json_atomic
from headprune.heads.adapters import get_adapter

V, HIDDEN, HEADS, D = 100, 32, 4, 8
SMALL = dict(vocab_size=V, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=3,
             intermediate_size=64, max_position_embeddings=64)
GQA = dict(SMALL, num_key_value_heads=2)
FAMILIES = {  # name -> (config, task)
    "bert": (lambda: tf.BertConfig(**SMALL), "cls"),
    "roberta": (lambda: tf.RobertaConfig(**SMALL), "cls"),
    "distilbert": (lambda: tf.DistilBertConfig(vocab_size=V, dim=HIDDEN, n_heads=HEADS, n_layers=3, hidden_dim=64,
                                               max_position_embeddings=64), "cls"),
    "gpt2": (lambda: tf.GPT2Config(vocab_size=V, n_embd=HIDDEN, n_head=HEADS, n_layer=3, n_positions=64,
                                   bos_token_id=1, eos_token_id=2), "lm"),
    "llama": (lambda: tf.LlamaConfig(**GQA), "lm"),
    "mistral": (lambda: tf.MistralConfig(**GQA, sliding_window=4), "lm"),
    "qwen2": (lambda: tf.Qwen2Config(**GQA), "lm"),  # Q/K/V biases
}
DECODERS = [name for name, (_, task) in FAMILIES.items() if task == "lm"]
# Layer 0 loses every head (also the cache layer models read lengths from); layer 1 one head
# (for GQA: an uneven group, so its KV head stays); layer 2 two heads (for GQA: a whole group).
PRUNE = {0: [0, 1, 2, 3], 1: [1], 2: [2, 3]}


def tiny(family: str, attn: str = "sdpa", seed: int = 0):
    make_config, task = FAMILIES[family]
    auto = tf.AutoModelForSequenceClassification if task == "cls" else tf.AutoModelForCausalLM
    torch.manual_seed(seed)
    return auto.from_config(make_config(), attn_implementation=attn).eval()


def inputs(batch: int = 3, tokens: int = 9, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (batch, tokens), generator=g)  # (B, T)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # left padding for one row
    return {"input_ids": input_ids, "attention_mask": attention_mask}


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
    model = tf.AutoModelForCausalLM.from_config(tf.GPTNeoXConfig(
        vocab_size=V, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=1, intermediate_size=64))
    with pytest.raises(NotImplementedError, match=r"gpt_neox.*bert.*gpt2.*llama.*docs/adding_an_architecture.md"):
        prune_heads(model, {0: [0]})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_head_rows_partition_every_projection(family):
    """The adapter's head rows cover each Q/K/V/O feature of a layer exactly once (KV rows once per
    KV head, shared by the query heads of a GQA group), in the family's own weight layout."""
    model = tiny(family)
    prune_heads(model, {1: [1]})
    adapter = get_adapter(model)
    for layer in range(3):
        rows = adapter.head_rows(model, layer)
        covered: dict = {}
        for parts in rows.values():
            for r in parts.values():
                covered.setdefault((id(r.module), r.outputs), (r.module, r.outputs, set()))[2].update(r.index)
        for module, outputs, index in covered.values():
            conv = isinstance(module, Conv1D)  # weight (in, out); Linear (out, in)
            width = module.weight.shape[int(conv) if outputs else int(not conv)]
            assert sorted(index) == list(range(width)), (layer, outputs, width)
        group = adapter.group_size(model.config)
        for head, parts in rows.items():
            same_group = [h for h in rows if h // group == head // group]
            assert all(rows[h]["k"] == parts["k"] and rows[h]["v"] == parts["v"] for h in same_group)


def test_gpt2_head_rows_are_its_fused_qkv_slices():
    model = tiny("gpt2")
    attn = model.transformer.h[0].attn
    rows = get_adapter(model).head_rows(model, 0)
    x = torch.randn(1, 2, HIDDEN)
    full = attn.c_attn(x)  # (1, 2, 3E)
    for head in range(HEADS):
        for part, offset in (("q", 0), ("k", HIDDEN), ("v", 2 * HIDDEN)):
            r = rows[head][part]
            assert r.module is attn.c_attn and (r.start, r.stop) == (offset + head * D, offset + (head + 1) * D)
            torch.testing.assert_close(full[..., r.start:r.stop], x @ r.weight().t() + attn.c_attn.bias[r.start:r.stop])
        assert rows[head]["o"].weight().shape == (D, HIDDEN)


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


def test_save_pruned_refuses_a_folder_with_files_unless_told(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")  # an old tokenizer
    model = prune_heads(tiny("bert"), PRUNE)
    with pytest.raises(FileExistsError, match=r"is not empty.*overwrite=True"):
        save_pruned(model, tmp_path)
    save_pruned(model, tmp_path, overwrite=True)
    assert not (tmp_path / "tokenizer.json").exists() and (tmp_path / "headprune_layout.json").is_file()


def test_written_files_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "m")
        write_json_atomic(tmp_path / "results.json", {"a": 1})
    finally:
        os.umask(old)
    for path in (tmp_path / "m" / "headprune_layout.json", tmp_path / "results.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


@pytest.mark.parametrize("damage,pattern", [
    ("missing", r"holds weights of a pruned model but no headprune_layout\.json"),
    ("truncated", r"headprune_layout\.json is not valid JSON"),
    ("no_key", r"headprune_layout\.json has no 'layout' entry"),
])
def test_load_pruned_names_a_damaged_layout_file(damage, pattern, tmp_path):
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path)
    layout = tmp_path / "headprune_layout.json"
    if damage == "missing":
        layout.unlink()
    elif damage == "truncated":
        layout.write_text(layout.read_text()[:20])
    else:
        layout.write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match=pattern):
        load_pruned(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"holds no model \(no config\.json\)"):
        load_pruned(tmp_path / "nowhere")
