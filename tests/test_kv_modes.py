"""Per-unit KV modes (heads/windows.py): windowed KV groups see only their sinks and recent window,
under eager and sdpa attention, equal to attention computed by hand."""
import json
import re

import pytest
import torch
import transformers as tf

from headprune.heads.surgery import prune_heads
from headprune.heads.windows import KVLayout, KVWindows, apply_kv_layout, window_allowed
from tests.helpers import llama  # the tiny GQA Llama: 2 layers x 4 query heads, 2 KV groups, head_dim 8

SEQ = 12


def ids(batch: int = 2, tokens: int = SEQ, seed: int = 1):
    return torch.randint(3, 100, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def capture(model, layer: int):
    """Hooks recording layer `layer`'s attention input, q/k/v outputs and output-projection input."""
    attn = model.model.layers[layer].self_attn
    seen = {}
    handles = [attn.register_forward_pre_hook(lambda m, a, k: seen.__setitem__("hidden", k["hidden_states"]),
                                              with_kwargs=True),
               attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("context", a[0]))]
    for name in ("q_proj", "k_proj", "v_proj"):
        handles.append(getattr(attn, name).register_forward_hook(
            lambda m, a, out, name=name: seen.__setitem__(name, out)))
    return seen, handles


def by_hand(model, seen, modes, sink, window, kept_groups=(0, 1)):
    """Layer contexts (B, T, H*D) computed with explicit loops: each query of a windowed group
    softmaxes over the keys {j <= i: j < sink or j > i - window}, a full group over {j <= i}."""
    d = 8
    hidden = seen["hidden"]
    b, t, _ = hidden.shape
    q = seen["q_proj"].view(b, t, -1, d).transpose(1, 2)  # (B, H, T, D)
    k = seen["k_proj"].view(b, t, -1, d).transpose(1, 2)  # (B, G, T, D)
    v = seen["v_proj"].view(b, t, -1, d).transpose(1, 2)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(t)[None].expand(b, t))
    q, k = tf.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    per_group = q.shape[1] // k.shape[1]
    out = torch.zeros(b, t, q.shape[1], d)
    for h in range(q.shape[1]):
        g = h // per_group
        windowed = modes[kept_groups[g]] == "window"
        for i in range(t):
            keys = [j for j in range(i + 1) if not windowed or j < sink or j > i - window]
            scores = (q[:, h, i:i + 1] @ k[:, g, keys].transpose(-1, -2)) / d ** 0.5  # (B, 1, n)
            out[:, i, h] = (scores.softmax(-1) @ v[:, g, keys])[:, 0]
    return out.reshape(b, t, -1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_windowed_group_equals_attention_by_hand(attn):
    """Layer 1: group 0 windowed (2 sinks + 3 recent tokens of 12), group 1 full; both match the
    explicit loops, and the windowed group's context differs from the full model's."""
    model = llama(attn=attn)
    layout = KVLayout(((("full", "full")), ("window", "full")), sink=2, window=3)
    seen, handles = capture(model, 1)
    with torch.no_grad():
        dense_context = (model(ids()), seen["context"].clone())[1]
        KVWindows(layout).attach(model)
        model(ids())
    for handle in handles:
        handle.remove()
    expected = by_hand(model, seen, layout.modes[1], 2, 3)
    assert torch.allclose(seen["context"], expected, atol=1e-5)
    assert not torch.allclose(seen["context"][..., :16], dense_context[..., :16], atol=1e-3)  # group 0 changed
    assert torch.equal(seen["context"][..., 16:], dense_context[..., 16:])  # group 1: full


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_all_full_layers_unchanged_bit_for_bit(attn):
    """A layer whose groups are all full keeps its exact output next to a windowed layer; a
    layout with no window changes no logit."""
    model = llama(attn=attn)
    seen, handles = capture(model, 0)
    with torch.no_grad():
        dense = model(ids()).logits
        dense_context = seen["context"].clone()
        windows = KVWindows(KVLayout((("full", "full"), ("window", "window")), sink=1, window=2)).attach(model)
        model(ids())
        assert torch.equal(seen["context"], dense_context)
        windows.detach()
        KVWindows(KVLayout.uniform(model, "full", sink=1, window=2)).attach(model)
        assert torch.equal(model(ids()).logits, dense)
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_window_covering_the_sequence_equals_full(attn):
    model = llama(attn=attn)
    with torch.no_grad():
        dense = model(ids()).logits
        KVWindows(KVLayout.uniform(model, "window", sink=4, window=SEQ - 4)).attach(model)
        covered = model(ids()).logits
    assert torch.allclose(covered, dense, atol=1e-6)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_padded_batch_keeps_each_rows_windows(attn):
    """Right padding (the model's own mask: additive for eager, boolean for sdpa, widened per
    head here): a padded row's real positions get the logits the row gets alone."""
    model = llama(attn=attn)
    KVWindows(KVLayout((("window", "full"), ("full", "window")), sink=1, window=3)).attach(model)
    batch = ids(batch=2)
    padding = torch.ones_like(batch)
    padding[1, -4:] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=padding).logits
        alone = model(batch[1:, :-4]).logits
    assert torch.allclose(padded[1, :-4], alone[0], atol=1e-5)


def test_window_after_physical_removal_follows_the_kept_groups():
    """Layer 1 loses group 0 physically: its one kept group (original id 1) is the windowed one."""
    model = llama(attn="eager")
    prune_heads(model, {1: [0, 1]})
    layout = KVLayout((("full", "full"), ("removed", "window")), sink=1, window=4)
    seen, handles = capture(model, 1)
    with torch.no_grad():
        KVWindows(layout).attach(model)
        model(ids())
    for handle in handles:
        handle.remove()
    expected = by_hand(model, seen, layout.modes[1], 1, 4, kept_groups=(1,))
    assert torch.allclose(seen["context"], expected, atol=1e-5)


def test_a_deep_copy_does_not_run_the_originals_windows():
    """Hooks survive copy.deepcopy but still name the original model: the copy refuses to run
    them rather than follow the original's head layout; a copy made after detach runs dense."""
    import copy

    model = llama(attn="sdpa")
    windows = KVWindows(KVLayout((("window", "full"), ("full", "full")), sink=1, window=2)).attach(model)
    with pytest.raises(ValueError, match="attached to another model"):
        copy.deepcopy(model)(ids())
    windows.detach()
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(model)(ids()).logits, llama(attn="sdpa")(ids()).logits)


def test_window_allowed_keys():
    allowed = window_allowed(torch.arange(6), torch.arange(6), sink=1, window=2)
    assert allowed[5].tolist() == [True, False, False, False, True, True]
    assert allowed[2].tolist() == [True, True, True, False, False, False]


def test_bad_layouts_refused_by_name():
    model = llama(attn="sdpa")
    with pytest.raises(ValueError, match="mode 'streaming' is not allowed; allowed: full, window, removed"):
        KVLayout((("full", "streaming"),), sink=1, window=2)
    with pytest.raises(ValueError, match="kv_modes.window=0 must be an integer >= 1"):
        KVLayout((("full",),), sink=1, window=0)
    with pytest.raises(ValueError, match="the model has 2 layers of 2 units"):
        KVWindows(KVLayout((("full", "window"),), sink=1, window=2)).attach(model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="allowed: eager, sdpa"):
        KVWindows(KVLayout.uniform(model, "window", sink=1, window=2)).attach(model)


@pytest.mark.parametrize("field,value,allowed", [("sink", "2", ">= 0"), ("window", 0, ">= 1"), ("sink", True, ">= 0")])
def test_a_layout_files_bad_field_is_refused_naming_the_file_and_field(field, value, allowed, tmp_path):
    """The values are the file's, not the user's settings: the refusal names the file and the field."""
    from headprune.selection.kv_modes import read_kv_layout

    path = tmp_path / "layout.json"
    path.write_text(json.dumps({"modes": [["full", "window"], ["full", "full"]], "sink": 2, "window": 4, field: value}))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: field '{field}' is {re.escape(repr(value))}; "
                                         rf"allowed: an integer {allowed}"):
        read_kv_layout(str(path))
    path.write_text(json.dumps({"modes": [["full", "sliding"]], "sink": 2, "window": 4}))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: kv_modes layer 0 unit 1: mode 'sliding'"):
        read_kv_layout(str(path))


# -- costs at a stated context, and the knapsack over (full, windowed) options ---------------------
def test_a_windowed_unit_costs_its_kept_tokens_over_the_context():
    """KV bytes at seq 64 (2 layers x 2 groups x head_dim 8, float32): a windowed group holds
    4 + 12 = 16 of 64 tokens; a window longer than the context costs what full does; the count
    table without windows is the (k, 0) column; the table survives its JSON round trip."""
    from headprune.costs.tables import LayerCosts, kv_costs
    from headprune.selection.budgets import KVBudget

    model = llama(attn="sdpa")
    table = KVBudget(target=0.5, batch=2, seq=64).mode_table(model, sink=4, window=12)
    full_unit = 2 * 8 * 64 * 2 * 4  # K and V x head_dim x seq x batch x bytes
    assert table.cost[0][(1, 0)] == full_unit and table.cost[1][(0, 1)] == full_unit * 16 / 64
    assert table.cost[0][(1, 1)] == full_unit * (1 + 16 / 64) and table.dense == 2 * 2 * full_unit
    assert set(table.cost[0]) == {(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2)}
    counts = kv_costs(model, 2, 64)
    assert all(table.cost[l][(k, 0)] == counts.cost[l][k] for l in range(2) for k in range(3))
    assert KVBudget(batch=2, seq=10).mode_table(model, sink=4, window=12).cost[0][(0, 2)] == \
        KVBudget(batch=2, seq=10).mode_table(model, sink=4, window=12).cost[0][(2, 0)]
    assert LayerCosts.from_json(table.to_json()) == table


def test_windowed_flops_scale_the_scores_only():
    from headprune.costs.flops import attention_flops
    from headprune.selection.budgets import FlopsBudget

    table = FlopsBudget(batch=1, seq=64).mode_table(llama(attn="sdpa"), sink=4, window=12)
    projections = attention_flops(1, 64, 0, 2, 1, 8, 32)  # one group: 2 query heads, 1 KV head
    scores = attention_flops(1, 64, 64, 2, 1, 8, 32) - projections
    assert table.cost[0][(0, 1)] == pytest.approx(projections + scores * 16 / 64)


def test_mode_values_assign_units_by_both_values():
    """Unit 0 is worth most full, unit 1 loses least when windowed: one full and one windowed
    puts unit 0 full (10 + 7), not the order of either ranking alone."""
    from headprune.costs.knapsack import mode_values

    values = mode_values([10.0, 8.0, 1.0], [2.0, 7.0, 0.5])
    assert values[(1, 1)] == (17.0, ("full", "window", "removed"))
    assert values[(0, 1)] == (7.0, ("removed", "window", "removed"))
    assert values[(3, 0)][1] == ("full",) * 3 and values[(0, 0)] == (0.0, ("removed",) * 3)


def test_the_knapsack_chooses_among_full_window_and_removed():
    """Two layers of two groups at seq 64, window 16 tokens (1/4 of a full unit), budget 0.5 of
    dense (2 full units' worth): the best layout windows cheap-to-window groups, keeps the one
    that loses most windowed full, and matches brute force over all 3^4 layouts."""
    import itertools

    from headprune.costs.knapsack import best_modes
    from headprune.selection.budgets import KVBudget

    model = llama(attn="sdpa")
    table = KVBudget(target=0.5, batch=1, seq=64).mode_table(model, sink=4, window=12)
    full = [[5.0, 4.0], [3.0, 6.0]]
    window = [[1.0, 3.5], [2.5, 5.9]]
    limit = 0.5 * table.dense
    modes, value, cost = best_modes(full, window, table.cost, limit)

    def worth(layout):
        return sum({"full": full[l][u], "window": window[l][u], "removed": 0.0}[m]
                   for l, layer in enumerate(layout) for u, m in enumerate(layer))

    def price(layout):
        return sum(table.cost[l][(layer.count("full"), layer.count("window"))] for l, layer in enumerate(layout))

    layouts = [(a, b) for a in itertools.product(("full", "window", "removed"), repeat=2)
               for b in itertools.product(("full", "window", "removed"), repeat=2)]
    best = max((x for x in layouts if price(x) <= limit), key=worth)
    assert value == pytest.approx(worth(best)) and cost == price(modes) <= limit
    assert [m for layer in modes for m in layer].count("window") >= 2  # windows are what fit


# -- generation with a cache that keeps only sinks + window -----------------------------------------
def greedy_by_full_forwards(model, prompt, steps: int):
    """Greedy tokens from the masked model re-run on the whole sequence at each step (no cache)."""
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_generate_with_the_windowed_cache_equals_full_forwards(attn):
    """Layer 0: group 0 windowed, group 1 full; layer 1: both windowed (sink 2, window 3) over a
    6-token prompt and 10 new tokens: generate()'s tokens equal the masked full-sequence model's,
    windowed heads hold 2 + 3 tokens, full heads all 15, and the logits differ from the
    unwindowed model's (the windows dropped tokens that mattered)."""
    from transformers.cache_utils import DynamicCache

    from headprune.heads.windows import WindowedCacheLayer

    model = llama(attn=attn)
    prompt = ids(batch=2, tokens=6)
    with torch.no_grad():
        dense = model(ids(batch=2, tokens=16)).logits
    KVWindows(KVLayout((("window", "full"), ("window", "window")), sink=2, window=3)).attach(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=10, do_sample=False, cache=cache, pad_token_id=0)
        masked = model(ids(batch=2, tokens=16)).logits
    assert torch.equal(out, greedy_by_full_forwards(model, prompt, 10))
    with torch.no_grad():  # generate()'s own cache gets the windowed layers too
        assert torch.equal(model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0), out)
    assert all(isinstance(layer, WindowedCacheLayer) for layer in cache.layers)
    assert cache.layers[0].held_tokens() == (15, 5) and cache.layers[1].held_tokens() == (0, 5)
    assert cache.layers[0].window_slots.tolist() == [[0, 1, 12, 13, 14]] * 2  # per row
    assert cache.get_seq_length() == 15
    assert not torch.allclose(masked[:, 5:], dense[:, 5:], atol=1e-4)


def test_beam_search_with_the_windowed_cache_equals_no_cache():
    """Beam search expands and reorders the cache's rows (batch_repeat_interleave, reorder /
    select): its sequences equal beam search without a cache (full forwards, masks only)."""
    model = llama(attn="eager")
    KVWindows(KVLayout((("window", "full"), ("window", "window")), sink=1, window=3)).attach(model)
    settings = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids(batch=2, tokens=5), **settings)
        uncached = model.generate(ids(batch=2, tokens=5), use_cache=False, **settings)
    assert torch.equal(cached, uncached)


def test_the_windowed_cache_holds_what_the_cost_table_counts():
    """After a prefill of 12 tokens (batch 2): the cache's bytes are the KV mode table's at batch
    2 x seq 12 for the layout's (full, windowed) counts; a full layer holds 12 tokens per head,
    a windowed head sink + window = 3."""
    from transformers.cache_utils import DynamicCache

    from headprune.costs.kv_bytes import cache_bytes, cache_layer_bytes
    from headprune.selection.budgets import KVBudget

    model = llama(attn="sdpa")
    layout = KVLayout((("window", "full"), ("window", "window")), sink=1, window=2)
    KVWindows(layout).attach(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids(batch=2, tokens=12), cache=cache, use_cache=True)
    table = KVBudget(batch=2, seq=12).mode_table(model, sink=1, window=2)
    options = [(layout.count(l, "full"), layout.count(l, "window")) for l in range(2)]
    assert cache_bytes(cache) == table.total(options) < table.dense
    per_token = 2 * 2 * 8 * 4  # batch x K and V x head_dim x float32, one head
    assert cache_layer_bytes(cache.layers[0]) == per_token * (12 + 3)


def test_the_windowed_cache_refuses_cropping_and_filled_caches():
    from transformers.cache_utils import DynamicCache

    model = llama(attn="sdpa")
    KVWindows(KVLayout((("window", "full"), ("full", "full")), sink=1, window=2)).attach(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids(batch=1, tokens=12), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
    filled = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model.layers[0].self_attn._forward_pre_hooks.clear()
        model(ids(batch=1, tokens=4), cache=filled, use_cache=True)
    KVWindows(KVLayout((("window", "full"), ("full", "full")), sink=1, window=2)).attach(model)
    with pytest.raises(ValueError, match="cache layer is DynamicLayer holding tokens"):
        model(ids(batch=1, tokens=1), cache=filled, use_cache=True)


def test_save_and_load_pruned_keep_the_modes(tmp_path):
    """Layer 1's group 0 removed (physically), its group 1 and layer 0's group 0 windowed: the
    folder is not a plain checkpoint, and load_pruned's model computes the same logits and
    generate() tokens, its windows attached (a windowed cache at generation)."""
    from headprune.deploy.hf import load_pruned, save_pruned

    model = llama(attn="sdpa")
    layout = KVLayout((("window", "full"), ("removed", "window")), sink=1, window=3)
    apply_kv_layout(model, layout)
    assert [len(a.self_attn.o_proj.weight[0]) for a in model.model.layers] == [32, 16]  # layer 1: one group left
    saved = save_pruned(model, tmp_path / "export")
    assert not saved.plain_hf and "windowed KV units" in saved.why
    loaded = load_pruned(tmp_path / "export").eval()
    prompt = ids(batch=1, tokens=5)
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, model(ids()).logits)
        want = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(loaded.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), want)
    assert loaded.headprune_kv_layout == layout


def test_exports_that_cannot_window_refuse_by_name():
    """llama.cpp's GGUF (per-head windows: tests/test_llamacpp_windows.py serves whole windowed
    layers) and vLLM's DeciLM attend every kept KV head to the whole context: a model
    with windowed units is refused, with every unit full it is not refused for windows (both ONNX
    graphs export them: tests below)."""
    from headprune.deploy.gguf_export import gguf_refusal
    from headprune.deploy.vllm_deci import deci_refusal

    model = llama(attn="sdpa")
    windows = KVWindows(KVLayout((("window", "full"), ("full", "full")), sink=1, window=4)).attach(model)
    assert "both windowed and full KV units" in gguf_refusal(model) and "llama.cpp" in gguf_refusal(model)
    assert "windowed KV units" in deci_refusal(model) and "DeciLM" in deci_refusal(model)
    windows.detach()
    KVWindows(KVLayout.uniform(model, "full", sink=1, window=4)).attach(model)
    assert gguf_refusal(model) is None and "windowed" not in deci_refusal(model)  # (DeciLM: the tiny FFN width)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_onnx_forward_graph_computes_the_windows(tmp_path, attn):
    """export_onnx of a model with windowed units: ONNX Runtime's logits equal the windowed PyTorch
    model's (its banded kernel) at another batch and a longer sequence than the export's, left
    padding included, and differ from the model without windows (the windows are in the graph).
    Seen failing without `per_head_masks` (torch.export stops in the banded chunks)."""
    from headprune.deploy.onnx import check_onnx, export_onnx, judge, onnx_session

    model = llama(attn=attn).eval()
    windows = KVWindows(KVLayout((("full", "window"), ("window", "full")), sink=2, window=3)).attach(model)
    path = export_onnx(model, tmp_path / "model.onnx", batch=2, seq=16)
    figures = check_onnx(model, path, batch=3, seq=40)
    assert judge(figures) == [] and figures["max_abs_diff"] < 1e-4, figures
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(3))  # (B, T), T > sink + window
    mask = torch.ones_like(ids)
    got = torch.from_numpy(onnx_session(path).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0])
    windows.detach()
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=mask).logits
    assert (got - dense).abs().max() > 1e-2  # positions past sink + window see fewer keys


@pytest.mark.slow  # two ONNX decode exports, ~15 s each
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_onnx_decode_graph_keeps_windowed_units_in_fixed_rings(tmp_path, attn):
    """export_onnx_decode of a model with a removed, two windowed and one full unit: the windowed
    units' past is a ring of sink + window entries (a static axis) beside the full units' growing
    past, its slots per row (a left-padded row keeps its own first tokens as sinks: seen failing,
    decode logits off by 0.5, with the ring counting sinks from slot 0); a prefill past the ring's
    size and 7 greedy steps in ONNX Runtime give PyTorch's
    generation tokens and logits (its WindowedCacheLayer); the same prompt fed in chunks of 4 after
    a past gives the one-call prefill's logits, which differ from the model's without windows (the
    windows are in the graph)."""
    from headprune.deploy.onnx import onnx_session
    from headprune.deploy.onnx_decode import (_feed, check_onnx_decode, empty_past, export_onnx_decode, judge_decode,
                                              positions)

    model = llama(attn=attn).eval()
    windows = apply_kv_layout(model, KVLayout((("removed", "window"), ("window", "full")), sink=1, window=4))
    path = export_onnx_decode(model, tmp_path / "decode.onnx")
    report = check_onnx_decode(model, path, steps=7)
    assert judge_decode(report) == [], report
    assert report["kv_heads"] == [0, 1] and report["window_kv_heads"] == [1, 1] and report["prompt"] == 8
    assert report["ring_bytes"] == 2 * 2 * 5 * 8 * 4  # keys + values, 2 windowed KV heads x 5 entries x 8 float32
    session = onnx_session(path)
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert shapes["past_key_values.0.window_key"] == ["batch", 1, 5, 8] and shapes["past_window_slots"] == ["batch", 5]
    assert shapes["past_key_values.1.key"] == ["batch", 1, "past_len", 8]
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(5))  # (B, T), T > sink + window
    mask = torch.ones_like(ids)
    got = torch.from_numpy(session.run(None, _feed(session, ids, mask, positions(mask, 12), empty_past(model, 1)))[0])
    past = empty_past(model, 1)
    for end in (4, 8, 12):  # the same tokens in chunks of 4 after a past (several new tokens, rings full)
        chunk = session.run(None, _feed(session, ids[:, end - 4:end], mask[:, :end], positions(mask[:, :end], 4), past))
        past = chunk[1:]
        torch.testing.assert_close(torch.from_numpy(chunk[0]), got[:, end - 4:end], atol=1e-5, rtol=0)
    windows.detach()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    assert (got - plain).abs().max() > 1e-2
    tampered = {**report, "window_kv_heads": [2, 2]}
    assert any("windowed KV heads per layer differ" in line for line in judge_decode(tampered))


def test_per_head_masks_holds_for_its_model_only_and_nests():
    """per_head_masks(model) marks that model alone, an inner use does not end an outer one, and
    nothing is left on the model after (a process-wide flag failed the first two)."""
    from headprune.heads.windowed_attention import mask_only, per_head_masks

    a, b = llama(), llama()
    with per_head_masks(a):
        assert mask_only(a) and not mask_only(b)
        with per_head_masks(a):
            pass
        assert mask_only(a)
    assert not mask_only(a) and "headprune_mask_only" not in a.__dict__


def test_allocate_modes_gives_a_layout_within_the_share():
    """Two layers of two groups, windows 1/4 of a full unit at seq 64: within 0.6 of the dense
    bytes the layout keeps the group that loses most when windowed full and windows the rest;
    it attaches to the model and its options price at the predicted share. Too small a share,
    or a count table, is refused."""
    from headprune.selection.budgets import KVBudget, allocate_modes

    model = llama(attn="sdpa")
    budget = KVBudget(target=0.6, batch=1, seq=64)
    table = budget.mode_table(model, sink=4, window=12)
    full, window = [[5.0, 4.0], [3.0, 6.0]], [[4.9, 3.9], [2.9, 1.0]]
    layout, report = allocate_modes(full, window, table, 0.6, sink=4, window_tokens=12)
    assert layout.modes == (("window", "window"), ("window", "full"))  # 1 + 3 x 1/4 = 1.75 of 4 full units
    assert report["predicted_share"] == 1.75 / 4 and report["options"] == [[0, 2], [1, 1]]
    assert report["predicted_cost"] == table.total(layout.options())
    KVWindows(layout).attach(model)
    with pytest.raises(ValueError, match="only a layout without any unit fits 0.0100"):
        allocate_modes(full, window, table, 0.01, sink=4, window_tokens=12)
    with pytest.raises(ValueError, match="needs a KV mode cost table"):
        allocate_modes(full, window, budget.table(model), 0.6, sink=4, window_tokens=12)


@pytest.mark.parametrize("removed", [False, True])
def test_a_plain_load_of_a_windowed_export_is_refused_naming_load_pruned(removed, tmp_path):
    """Issue 56.3: transformers' own loaders (AutoConfig, AutoModelForCausalLM, the pipeline's
    path) and the model class's own from_pretrained refuse a windowed export with a message naming
    headprune.load_pruned, instead of loading it without its windows (every head attending to every
    token); load_pruned still gives the windowed model's logits, and a removal-only export keeps
    loading plainly. Seen failing on 1b3b166: from_pretrained loaded the windowed export (logits off
    by ~0.1); LlamaForCausalLM.from_pretrained only warned until the config's head count named load_pruned."""
    from headprune.deploy.hf import load_pruned, save_pruned

    model = llama(attn="sdpa")
    layout = KVLayout((("window", "full"), ("full", "removed" if removed else "window")), sink=1, window=3)
    apply_kv_layout(model, layout)
    save_pruned(model, tmp_path / "windowed")
    for load in (tf.AutoConfig.from_pretrained, tf.AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=r"headprune\.load_pruned"):
            load(tmp_path / "windowed")
    with pytest.raises(Exception, match=r"headprune\.load_pruned"):  # only a warning from model_type
        type(model).from_pretrained(tmp_path / "windowed")
    loaded = load_pruned(tmp_path / "windowed").eval()
    assert type(loaded) is type(model) and loaded.config.model_type == "llama"
    assert loaded.config.num_attention_heads == model.config.num_attention_heads  # back from headprune_marked
    assert tf.PreTrainedConfig.from_pretrained(tmp_path / "windowed")  # AutoTokenizer's fallback still reads it
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, model(ids()).logits)
    plain = llama(attn="sdpa")
    apply_kv_layout(plain, KVLayout((("full", "removed"), ("full", "removed")), sink=1, window=3))
    assert save_pruned(plain, tmp_path / "removal").plain_hf
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "removal").eval()
    with torch.no_grad():
        assert torch.equal(again(ids()).logits, plain(ids()).logits)
