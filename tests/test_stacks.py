"""Models with several attention stacks (heads/stacks.py): Whisper (encoder self-attention, decoder
self- and cross-attention), T5 (the same three, plus a per-head relative position bias the first
layer of each stack computes for every layer) and UMT5 (a position bias of its own in every
self-attention layer). Heads are named {"encoder": {layer: heads},
"decoder": ..., "cross": ...}; masks, scores and layouts have one row per site in that order. Each
family: removal equals masking (eager and sdpa; uneven heads, a layer left without heads in every
stack), generate() with the KV cache equals the masked model's and the uncached one's, save_pruned /
load_pruned reload equal, magnitude / Taylor / Fisher score every site."""
import copy
import json

import pytest
import torch
import transformers as tf

from headprune import HeadMask, count_params, load_pruned, prune_heads, save_pruned
from headprune.heads.adapters import get_adapter
from headprune.heads.stacks import (StackHeadless, mask_sites, named_heads, site_names, site_record, stack_rows,
                                    to_rows)
from tests.helpers import llama as tiny_llama_lm

LAYERS, HEADS, D_MODEL = 3, 4, 32
SITES = [f"{stack}.{i}" for stack in ("encoder", "decoder", "cross") for i in range(LAYERS)]
# every stack: its first layer loses every head, the others keep uneven numbers; T5's encoder loses
# head 3 in every layer (its position-bias column goes), its decoder keeps every head somewhere
SPEC = {"encoder": {0: [0, 1, 2, 3], 1: [1, 3], 2: [3]},
        "decoder": {0: [0, 1, 2, 3], 1: [2], 2: [0, 3]},
        "cross": {0: [0, 1, 2, 3], 1: [1, 2], 2: [3]}}


def tiny_whisper(attn: str = "eager", seed: int = 0):
    torch.manual_seed(seed)
    config = tf.WhisperConfig(vocab_size=64, d_model=D_MODEL, encoder_layers=LAYERS, decoder_layers=LAYERS,
                              encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=32,
                              decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                              init_std=0.3)  # large weights: greedy decoding then picks varied tokens
    return tf.WhisperForConditionalGeneration._from_config(config, attn_implementation=attn).eval()


def tiny_t5(attn: str = "eager", seed: int = 0):
    torch.manual_seed(seed)
    config = tf.T5Config(vocab_size=64, d_model=D_MODEL, d_kv=8, d_ff=32, num_layers=LAYERS,
                         num_decoder_layers=LAYERS, num_heads=HEADS, decoder_start_token_id=0, pad_token_id=0,
                         eos_token_id=1, relative_attention_num_buckets=8, initializer_factor=2.0,
                         tie_word_embeddings=False)  # large, untied weights: greedy decoding picks varied tokens
    model = tf.T5ForConditionalGeneration._from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # position biases that decide where heads look (with the wrong head's map, outputs move)
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(3.0)
        model.lm_head.weight.mul_(0.1)  # logits of ~10, not ~100 (float32's rounding below 1e-5); same argmax
    return model


def tiny_umt5(attn: str = "eager", seed: int = 0):
    torch.manual_seed(seed)
    config = tf.UMT5Config(vocab_size=64, d_model=D_MODEL, d_kv=8, d_ff=32, num_layers=LAYERS,
                           num_decoder_layers=LAYERS, num_heads=HEADS, decoder_start_token_id=0, pad_token_id=0,
                           eos_token_id=1, relative_attention_num_buckets=8, initializer_factor=2.0,
                           tie_word_embeddings=False)
    model = tf.UMT5ForConditionalGeneration._from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # position biases that decide where heads look; logits of ~10 (as tiny_t5)
        for stack in (model.encoder, model.decoder):
            for block in stack.block:
                block.layer[0].SelfAttention.relative_attention_bias.weight.mul_(3.0)
        model.lm_head.weight.mul_(0.1)
    return model


BUILD = {"whisper": tiny_whisper, "t5": tiny_t5, "umt5": tiny_umt5}


def batch_for(family: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    decoder = torch.randint(3, 64, (2, 4), generator=g)
    if family == "whisper":
        return {"input_features": torch.randn(2, 8, 16, generator=g), "decoder_input_ids": decoder}
    ids = torch.randint(3, 64, (2, 7), generator=g)
    return {"input_ids": ids, "attention_mask": torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]]),
            "decoder_input_ids": decoder}


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def assert_same_sums(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to 1e-5 of the outputs' scale (their largest magnitude, at least 1): the same sums in
    another order differ by a few float32 ulps of the values' size (mT5's logits reach 45 under
    transformers 5.25's initialisation, 1.1e-5 apart)."""
    torch.testing.assert_close(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=0)


def masked_and_pruned(family: str, attn: str, spec=SPEC):
    model = BUILD[family](attn)
    masked = copy.deepcopy(model)
    HeadMask.for_model(masked).prune(spec)
    return masked, prune_heads(model, spec)


# -- naming --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(BUILD))
def test_sites_are_the_stacks_end_to_end(family):
    model = BUILD[family]()
    assert site_names(model) == SITES
    assert HeadMask.for_model(model, attach=False).mask.shape == (3 * LAYERS, HEADS)
    assert stack_rows(model) == {"encoder": range(0, 3), "decoder": range(3, 6), "cross": range(6, 9)}
    attns = get_adapter(model).blocks(model)
    if family == "whisper":
        assert attns[4] is model.model.decoder.layers[1].self_attn
        assert attns[7] is model.model.decoder.layers[1].encoder_attn
    else:
        assert attns[4] is model.decoder.block[1].layer[0].SelfAttention
        assert attns[7] is model.decoder.block[1].layer[1].EncDecAttention


def test_named_requests_become_rows():
    model = tiny_whisper()
    rows = {0: [0, 1, 2, 3], 1: [1, 3], 2: [3], 3: [0, 1, 2, 3], 4: [2], 5: [0, 3], 6: [0, 1, 2, 3], 7: [1, 2], 8: [3]}
    assert to_rows(model, SPEC) == rows
    assert to_rows(model, {"cross.1": [1, 2], "encoder": {2: [3]}}) == {7: [1, 2], 2: [3]}
    assert to_rows(model, [("cross", 1, 1), ("cross", 1, 2)]) == {7: [1, 2]}
    assert to_rows(model, {4: [2]}) == {4: [2]}  # rows as they are
    assert named_heads(model, [(r, h) for r, heads in rows.items() for h in heads]) == SPEC
    with pytest.raises(ValueError, match=r"stack 'decoders'; this model's stacks are \['encoder', 'decoder', 'cro"):
        to_rows(model, {"decoders": {0: [1]}})
    with pytest.raises(ValueError, match=r"layer 3 is out of range: stack 'cross' has layers 0..2"):
        to_rows(model, {"cross": {3: [1]}})
    with pytest.raises(ValueError, match="give {layer: \\[heads\\]} for a stack"):
        to_rows(model, {"cross": [1]})
    llama = tiny_llama_lm(vocab_size=64, intermediate_size=32)  # one attention stack: 2 layers x 4 query / 2 KV heads
    with pytest.raises(ValueError, match="has one attention stack: name heads by layer"):
        prune_heads(llama, {"encoder": {0: [1]}})
    assert site_names(llama) == ["0", "1"] and site_record(llama, HeadMask.for_model(llama)) == {}


def test_stacks_with_different_head_counts_are_refused():
    config = tf.WhisperConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                              decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
                              max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, decoder_start_token_id=1)
    model = tf.WhisperForConditionalGeneration(config)
    with pytest.raises(NotImplementedError, match=r"encoder: 4 \(encoder_attention_heads\), decoder: 2"):
        HeadMask.for_model(model)


# -- exactness -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(BUILD))
def test_removal_equals_masking(family, attn):
    masked, model = masked_and_pruned(family, attn)
    batch = batch_for(family)
    assert_same_sums(logits(model, batch), logits(masked, batch))
    dense = BUILD[family](attn)
    assert (logits(dense, batch) - logits(model, batch)).abs().max() > 1e-2  # the heads did matter
    attns = get_adapter(model).blocks(model)
    assert [isinstance(a, StackHeadless) for a in attns] == [i % 3 == 0 for i in range(9)]
    q = get_adapter(model).q
    assert [a.get_submodule(q).weight.shape[0] for a in attns] == [0, 16, 24, 0, 24, 16, 0, 16, 24]
    kept = 9 * HEADS - sum(len(h) for stack in SPEC.values() for h in stack.values())
    assert count_params(dense)["attention"] - count_params(model)["attention"] == \
        (9 * HEADS - kept) * 8 * 4 * D_MODEL + (0 if "t5" in family else (9 * HEADS - kept) * 8 * 2)  # q, v biases


def test_t5_position_bias_columns_go_with_the_stack_heads():
    """The encoder's first layer computes the bias every encoder layer adds, one map per head: head 3
    is gone from every encoder layer, so its column goes; the decoder keeps every head in some layer,
    so every column stays; each layer adds its own heads' maps, and the headless first layers still
    compute the bias for the rest."""
    from headprune.heads.surgery import Sliced

    dense = tiny_t5()
    sliced: list[Sliced] = []
    model = prune_heads(copy.deepcopy(dense), SPEC, sliced=sliced)
    enc = model.encoder.block[0].layer[0].SelfAttention
    dec = model.decoder.block[0].layer[0].SelfAttention
    assert isinstance(enc, StackHeadless) and enc.relative_attention_bias.weight.shape == (8, 3)
    torch.testing.assert_close(enc.relative_attention_bias.weight,
                               dense.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight[:, :3])
    assert dec.relative_attention_bias.weight.shape == (8, 4)
    assert model.encoder.block[1].layer[0].SelfAttention.headprune_bias_heads == [0, 2]  # keeps heads 0, 2
    assert model.decoder.block[2].layer[0].SelfAttention.headprune_bias_heads == [1, 2]  # keeps heads 1, 2
    assert [s.index.tolist() for s in sliced if s.new is enc.relative_attention_bias.weight] == [[0, 1, 2]]
    attn = model.encoder.block[1].layer[0].SelfAttention
    assert (attn.n_heads, attn.inner_dim, attn.key_value_proj_dim) == (2, 16, 8)
    # removing one more head from one layer leaves the column (layer 2 still has it), the model exact
    prune_heads(model, {"encoder": {2: [0]}})
    assert enc.relative_attention_bias.weight.shape == (8, 3)
    reference = copy.deepcopy(dense)
    mask = HeadMask.for_model(reference)
    mask.prune(SPEC)  # the named form on a mask
    mask.prune({"encoder": {2: [0]}})
    assert mask.heads_per_layer() == [0, 2, 2, 0, 3, 2, 0, 2, 3]
    batch = batch_for("t5")
    assert_same_sums(logits(model, batch), logits(reference, batch))


def test_umt5_position_bias_columns_go_with_each_layers_heads():
    """UMT5's self-attention layers each own an Embedding(num_buckets, heads): a layer keeps its kept
    heads' columns (a layer left without heads keeps them all; cross-attention has none); a second
    request slices by position, not by id."""
    from headprune.heads.surgery import Sliced

    dense = tiny_umt5()
    sliced: list[Sliced] = []
    model = prune_heads(copy.deepcopy(dense), SPEC, sliced=sliced)
    for stack in ("encoder", "decoder"):
        for layer, gone in SPEC[stack].items():
            kept = [h for h in range(HEADS) if h not in gone] or list(range(HEADS))  # a headless layer keeps all
            new = getattr(model, stack).block[layer].layer[0].SelfAttention.relative_attention_bias
            old = getattr(dense, stack).block[layer].layer[0].SelfAttention.relative_attention_bias
            assert new.embedding_dim == len(kept)
            torch.testing.assert_close(new.weight, old.weight[:, kept], atol=0, rtol=0)
    assert [s.index.tolist() for s in sliced
            if s.new is model.encoder.block[1].layer[0].SelfAttention.relative_attention_bias.weight] == [[0, 2]]
    prune_heads(model, {"encoder": {1: [0]}})  # layer 1 keeps 0, 2 -> 2: the second of its two columns
    bias = model.encoder.block[1].layer[0].SelfAttention.relative_attention_bias.weight
    before = dense.encoder.block[1].layer[0].SelfAttention.relative_attention_bias.weight
    torch.testing.assert_close(bias, before[:, [2]])
    reference = copy.deepcopy(dense)
    mask = HeadMask.for_model(reference)
    mask.prune(SPEC)
    mask.prune({"encoder": {1: [0]}})
    batch = batch_for("umt5")
    assert_same_sums(logits(model, batch), logits(reference, batch))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(BUILD))
def test_generate_with_the_kv_cache_equals_masking(family, attn):
    """Greedy decoding with the self- and cross-attention caches of the pruned model: the masked
    model's tokens and scores, and the pruned model's own without a cache."""
    from transformers import GenerationMixin

    masked, model = masked_and_pruned(family, attn)
    inputs = {k: v for k, v in batch_for(family).items() if k != "decoder_input_ids"}
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    generate = GenerationMixin.generate  # Whisper's own adds its task / language prompts
    got, want = generate(model, **inputs, **kwargs), generate(masked, **inputs, **kwargs)
    uncached = generate(model, **inputs, **kwargs, use_cache=False)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.sequences, uncached.sequences)
    assert len(set(got.sequences[:, 1:].flatten().tolist())) > 2  # not one token repeated
    for a, b, c in zip(got.scores, want.scores, uncached.scores):
        assert_same_sums(a, b)
        assert_same_sums(a, c)


@pytest.mark.parametrize("family", sorted(BUILD))
def test_save_and_load_pruned(family, tmp_path):
    _, model = masked_and_pruned(family, "eager")
    saved = save_pruned(model, tmp_path / "m")
    assert not saved.plain_hf
    written = json.loads((tmp_path / "m" / "headprune_layout.json").read_text())
    assert written["sites"] == SITES
    assert written["layout_by_stack"]["cross"] == [[], [0, 3], [0, 1, 2]]
    batch = batch_for(family)
    for attn in ("eager", "sdpa"):
        loaded = load_pruned(tmp_path / "m", attn_implementation=attn).eval()
        assert_same_sums(logits(loaded, batch), logits(model, batch))
    written["sites"] = SITES[3:] + SITES[:3]  # rows of other sites: refused before the weights load
    (tmp_path / "m" / "headprune_layout.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match="its sites .* are not this model's"):
        load_pruned(tmp_path / "m")


# -- scores, results, plots, exports ----------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(BUILD))
def test_metrics_score_every_site(family):
    from headprune.scoring import score_heads

    model = prune_heads(BUILD[family](), {"encoder": {1: [1]}, "cross": {2: [0, 1, 2, 3]}})
    batch = {k: v for k, v in batch_for(family).items() if k != "decoder_input_ids"}
    batch["labels"] = torch.tensor([[5, 6, 7, -100], [7, 8, 9, 10]])
    for metric in ("magnitude", "taylor", "fisher", "lrp"):
        scores = score_heads(model, [batch], metric=metric)
        assert scores.shape == (9, HEADS) and torch.isfinite(scores).all(), metric
        alive = torch.ones(9, HEADS, dtype=torch.bool)
        alive[1, 1], alive[8] = False, False
        assert (scores[~alive] == 0).all() and (scores[alive] != 0).all(), (metric, scores)
    with pytest.raises(ValueError, match="not done for a model with several attention stacks .* allowed for it: "
                                         "taylor, fisher, lrp, magnitude, random"):
        score_heads(model, [batch], metric="entropy")


def test_taylor_of_a_whole_site_is_the_loss_change_of_masking_it():
    """Taylor's gate gradient is d loss / d gate: on the cross-attention site it matches the finite
    difference of masking that site's head a little (the gates reach the cross-attention)."""
    from headprune.heads.mask import HeadMask as Mask
    from headprune.tasks import SEQ2SEQ_LM, forward_logits, task_of

    model = tiny_t5().double()
    assert task_of(model) is SEQ2SEQ_LM
    batch = {"input_ids": batch_for("t5")["input_ids"], "labels": torch.tensor([[5, 6, 7, 8], [7, 8, 9, 10]])}
    mask = Mask.for_model(model)
    with mask.differentiable_gates(2) as gates:
        loss = SEQ2SEQ_LM.loss(forward_logits(model, batch), batch).sum()
        (grad,) = torch.autograd.grad(loss, gates)
    eps = 1e-3
    with torch.no_grad():
        mask.mask[7, 2] = 1 - eps
        lower = SEQ2SEQ_LM.loss(forward_logits(model, batch), batch).sum()
        mask.mask[7, 2] = 1.0
    slope, change = float(grad[:, 7, 2].sum()), float(loss.detach() - lower) / eps
    assert abs(slope) > 1e-3 and abs(slope - change) < 1e-2 * abs(slope), (slope, change)


def test_results_and_heatmaps_name_the_sites(tmp_path):
    from headprune.plots import close, head_heatmap

    model = tiny_whisper()
    mask = HeadMask.for_model(model)
    mask.prune(SPEC)
    record = site_record(model, mask)
    assert record["sites"] == SITES and record["pruned_by_stack"] == SPEC
    assert record["heads_per_stack"] == {"encoder": [0, 2, 3], "decoder": [0, 3, 2], "cross": [0, 2, 3]}
    assert mask_sites(mask) == SITES
    fig = head_heatmap(mask.mask, "kept", tmp_path / "mask.png", rows=mask_sites(mask))
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == SITES and (tmp_path / "mask.png").is_file()
    close(fig)
    with pytest.raises(ValueError, match="8 row names for 9 rows"):
        head_heatmap(mask.mask, "kept", rows=SITES[:8])


@pytest.mark.parametrize("family", sorted(BUILD))
def test_exports_are_refused_with_the_reason(family, tmp_path):
    from headprune.deploy.gguf_export import gguf_refusal
    from headprune.deploy.onnx import export_onnx

    model = BUILD[family]()
    with pytest.raises(ValueError, match="encoder-decoder .* needs an encoder graph and a decoder graph"):
        export_onnx(model, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    assert "no Llama-style decoder" in gguf_refusal(model)


@pytest.mark.parametrize("model_type", ["whisper", "t5", "mt5", "bart", "umt5", "switch_transformers"])
def test_the_coverage_check_passes(model_type):
    """The coverage table's check (coverage.check_model_type): its own tiny config, every stack pruned
    (a layer without heads, one head, the last group), eager and sdpa, generate, reload. BART's family
    shares Whisper's layout; Switch Transformers T5's (transformers offers it eager attention only)."""
    from tools.coverage import check_model_type, model_types

    row = check_model_type(model_type, model_types()[model_type])
    assert row["status"] == "passes", row
    assert row["task"] in ("seq2seq_lm", "speech_seq2seq")
    checks = row["checks"]
    if model_type == "switch_transformers":
        assert checks.pop("sdpa").startswith("not offered") and "generate (sdpa)" not in checks
        checks |= {"sdpa": "passes", "generate (sdpa)": "passes"}
    assert checks["eager"] == checks["sdpa"] == checks["reload"] == "passes"
    assert checks["generate (eager)"] == checks["generate (sdpa)"] == "passes"
    assert checks["plain"].startswith("layout file")


def test_coverage_rows_are_updated_in_place():
    """`--update`: the rows of the types checked again replace theirs, the others stay; a table of
    another transformers version is refused (the table names one)."""
    from tools.coverage import updated

    old = {"transformers_version": "5.24.0", "torch_version": "2.13.0", "atol": 1e-5,
           "rows": [{"model_type": "a", "status": "passes"}, {"model_type": "t5", "status": "refused"}]}
    new = {**old, "rows": [{"model_type": "t5", "status": "passes"}]}
    assert updated(old, new)["rows"] == [{"model_type": "a", "status": "passes"},
                                         {"model_type": "t5", "status": "passes"}]
    with pytest.raises(ValueError, match="transformers_version is '5.24.0', this run's '5.25.0'"):
        updated(old, {**new, "transformers_version": "5.25.0"})


def test_a_pruner_run_names_the_sites_in_results_json(tmp_path):
    """A trainer-free one-shot run on T5 (Taylor scores over every site, the decoder's loss against
    labels): results.json `final` names the rows' sites and the pruned heads by stack, and the run
    writes the kept-heads heatmap."""
    from headprune import Loaders, Pruner, get_metric
    from headprune.recovery import NoRecovery
    from headprune.results import RunResults
    from headprune.selection.layer_policies import GlobalPolicy
    from headprune.selection.schedules import OneShot

    batch = {"input_ids": batch_for("t5")["input_ids"], "labels": torch.tensor([[5, 6, 7, -100], [7, 8, 9, 10]])}
    model = tiny_t5()
    pruner = Pruner(model, get_metric("taylor"), OneShot(target_sparsity=0.5, epochs_per_round=0), GlobalPolicy(),
                    recovery=NoRecovery(), results=RunResults(tmp_path))
    pruner.run(Loaders(score=[batch], val=[batch]))
    final = json.loads((tmp_path / "results.json").read_text())["final"]
    assert final["sites"] == SITES and set(final["pruned_by_stack"]) <= {"encoder", "decoder", "cross"}
    pruned = [h for heads in final["pruned_by_stack"].values() for ids in heads.values() for h in ids]
    assert len(pruned) == 18 == len(final["pruned"])
    assert sum(sum(n) for n in final["heads_per_stack"].values()) == 18 and final["val"]["ppl"] > 1
    assert (tmp_path / "head_mask.png").is_file()


def test_a_model_holding_one_of_the_stacks_has_its_sites():
    """T5's encoder model holds the encoder stack only: its sites are the encoder's, named as in the
    whole model; KV groups can be named by stack as well."""
    from headprune.heads.surgery import heads_of_kv_groups

    torch.manual_seed(0)
    model = tf.T5EncoderModel(tf.T5Config(vocab_size=64, d_model=D_MODEL, d_kv=8, d_ff=32, num_layers=2,
                                          num_heads=HEADS)).eval()
    assert site_names(model) == ["encoder.0", "encoder.1"]
    spec = heads_of_kv_groups(model, {"encoder": {0: [0, 1, 2, 3], 1: [1]}})
    assert spec == {0: [0, 1, 2, 3], 1: [1]}
    masked = copy.deepcopy(model)
    HeadMask.for_model(masked).prune(spec)
    prune_heads(model, spec)
    ids = batch_for("t5")["input_ids"]
    with torch.no_grad():
        assert_same_sums(model(input_ids=ids).last_hidden_state, masked(input_ids=ids).last_hidden_state)
    with pytest.raises(ValueError, match=r"stack 'decoder'; this model's stacks are \['encoder'\]"):
        prune_heads(model, {"decoder": {0: [1]}})
