"""scoring/: every head-importance metric: the shared contract, then each metric against a direct computation."""
import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from headprune.apps.config_paths import config_dir
from headprune.heads.adapters import get_adapter
from headprune.heads.hard_concrete import HardConcreteGates
from headprune.heads.mask import HeadMask
from headprune.lightning.module import HeadPruneModule
from headprune.tasks import forward_logits, task_of
from headprune.scoring import METRIC_INFO, METRICS, metric_name, score_heads
from headprune.scoring.attention import confidence_importance, entropy_importance
from headprune.scoring.fisher import fisher_importance
from headprune.scoring.l0 import l0_gates_importance
from headprune.scoring.lrp import conservative_backward, head_relevance, lrp_importance
from headprune.scoring.magnitude import magnitude_importance
from tests.helpers import tiny_batch, tiny_bert, tiny_gpt2_classifier, tiny_llama_classifier

from headprune.heads.surgery import prune_heads

FAST = {"l0_gates": {"steps": 5}, "confidence": {"eos_token_ids": [102]}}  # quick; [SEP] of the tiny BERT
PRUNED = [(0, 1), (2, 0), (2, 3)]


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def _two_batches(tokenizer):
    """Two batches padded to different lengths (padding inside each)."""
    full = tiny_batch(tokenizer, n=8)
    first = tokenizer(["a gripping , funny film", "dull", "the plot makes no sense at all"],
                      padding=True, return_tensors="pt")
    first["labels"] = full["labels"][:3]
    return [dict(first), {k: v[3:] for k, v in full.items()}]


def random_batch(n=3, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, 64, (n, t), generator=g), "attention_mask": torch.ones(n, t, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,), generator=g)}


# -- registry and config ---------------------------------------------------------------------------
def test_every_metric_is_registered_with_info_and_a_config():
    from headprune.apps.config_schema import register_schemas

    register_schemas()  # as headprune-train does on import: the test must not depend on another's import
    assert set(METRICS) == {p.stem for p in (config_dir() / "metric").glob("*.yaml")}  # each with its yaml
    page = (config_dir().parent / "docs" / "metrics.md").read_text()  # and its row in the metrics table
    assert {name for name in METRICS if f"| `{name}` |" not in page} == set()
    for name, info in METRIC_INFO.items():
        assert info.raw_high in ("keep", "prune", "neither") and info.raw and info.uses
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose("train", overrides=[f"metric={name}"]).metric  # _target_ and _partial_ from the schema
        GlobalHydra.instance().clear()
        assert cfg["_partial_"] is True
        assert cfg["_target_"] == f"{info.fn.__module__}.{info.fn.__name__}"
        assert metric_name(info.fn) == name
        assert "high" in __import__(info.fn.__module__, fromlist=["x"]).__doc__.lower()


# -- the contract ----------------------------------------------------------------------------------
def _model_state(model):
    """Attention implementation, training flag and our hooks (transformers installs its own, inactive
    output-capturing hooks the first time attention maps are requested)."""
    hooks = [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    ours = [h for h in hooks if getattr(h, "__name__", "") != "output_capturing_hook"]
    return model.config._attn_implementation, model.training, len(ours)


@pytest.mark.parametrize("variant", ["full", "masked", "physical"])
@pytest.mark.parametrize("name", sorted(METRICS))
def test_metric_contract(name, variant, tokenizer):
    """Shape, finite, deterministic, pruned heads 0 and alive heads not, model left as found; on a
    physically pruned model the scores equal those of the masked model."""
    model = tiny_bert()
    batches = _two_batches(tokenizer)
    options = FAST.get(name, {})
    mask = HeadMask.for_model(model)
    if variant != "full":
        mask.prune(PRUNED)
    if variant == "physical":
        masked_scores = METRICS[name](model, mask, batches, **options)
        mask.detach()
        prune_heads(model, PRUNED)
        mask = HeadMask.for_model(model)
        mask.prune(PRUNED)
    with torch.no_grad():
        before = model(**_inputs(batches[0])).logits
    state = _model_state(model)

    scores = METRICS[name](model, mask, batches, **options)
    again = METRICS[name](model, mask, batches, **options)

    assert scores.shape == (3, 4) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    assert torch.equal(scores, again)
    alive = mask.alive()
    assert (scores[~alive] == 0).all() and (scores[alive] != 0).all()
    assert _model_state(model) == state
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(**_inputs(batches[0])).logits, before, rtol=0, atol=0)
    if variant == "physical":
        torch.testing.assert_close(scores, masked_scores, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(METRICS))
def test_score_heads_accepts_every_metric_name(name, tokenizer):
    model = tiny_bert()
    scores = score_heads(model, _two_batches(tokenizer), metric=name, **FAST.get(name, {}))
    assert scores.shape == (3, 4) and torch.isfinite(scores).all()
    assert _model_state(model)[2] == 0  # the temporary mask's hooks are gone


@pytest.mark.parametrize("name,options,field", [
    ("magnitude", {"parts": ["q", "x"]}, "metric.parts"),
    ("lrp", {"target": "label"}, "metric.target"),
    ("l0_gates", {"steps": 0}, "metric.steps"),
])
def test_bad_option_values_name_the_field_and_the_choices(name, options, field, tokenizer):
    model = tiny_bert()
    with pytest.raises(ValueError, match=rf"{field}=.*(allowed|must)"):
        score_heads(model, [tiny_batch(tokenizer)], metric=name, **options)


# -- entropy and confidence --------------------------------------------------------------------------
def test_entropy_and_confidence_match_a_hand_computation_with_padding(tokenizer):
    batches = _two_batches(tokenizer)
    assert all((b["attention_mask"] == 0).any() for b in batches)
    reference = tiny_bert("eager")  # same seed, same weights
    entropy = torch.zeros(3, 4, dtype=torch.float64)
    confidence = torch.zeros(3, 4, dtype=torch.float64)
    without_sep = torch.zeros(3, 4, dtype=torch.float64)  # Voita et al.: the end-of-sentence key excluded
    n = 0
    with torch.no_grad():
        for batch in batches:
            maps = reference(**_inputs(batch), output_attentions=True).attentions
            for b in range(batch["input_ids"].shape[0]):
                length = int(batch["attention_mask"][b].sum())  # right padding
                assert int(batch["input_ids"][b, length - 1]) == tokenizer.sep_token_id
                for layer, a in enumerate(maps):
                    for head in range(4):
                        rows = a[b, head, :length, :length].double()  # real queries x real keys
                        entropy[layer, head] += -(rows * rows.log()).sum(-1).mean()
                        confidence[layer, head] += rows.max(-1).values.mean()
                        without_sep[layer, head] += rows[:, :length - 1].max(-1).values.mean()
                n += 1

    model = tiny_bert("sdpa")
    mask = HeadMask.for_model(model)
    torch.testing.assert_close(entropy_importance(model, mask, batches), (-entropy / n).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(confidence_importance(model, mask, batches, exclude_eos=False),
                               (confidence / n).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(confidence_importance(model, mask, batches, eos_token_ids=[tokenizer.sep_token_id]),
                               (without_sep / n).float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"names none .*metric\.eos_token_ids"):
        confidence_importance(model, mask, batches)  # MiniLM's config has no sep_token_id
    assert model.config._attn_implementation == "sdpa"
    assert all(m.config._attn_implementation == "sdpa" for m in model.modules() if hasattr(m, "config"))


# -- fisher ----------------------------------------------------------------------------------------
def test_fisher_matches_direct_per_example_gradients(tokenizer):
    model = tiny_bert("eager")
    batches = _two_batches(tokenizer)
    adapter = get_adapter(model)
    expected = torch.zeros(3, 4, dtype=torch.float64)
    n = 0
    for batch in batches:
        for b in range(batch["input_ids"].shape[0]):
            one = {k: v[b:b + 1] for k, v in batch.items()}
            contexts = []
            hooks = [adapter.out_proj(block).register_forward_pre_hook(lambda m, args: contexts.append(args[0]))
                     for block in adapter.blocks(model)]
            loss = task_of(model).loss(forward_logits(model, one), one).sum()
            for h in hooks:
                h.remove()
            for layer, (c, g) in enumerate(zip(contexts, torch.autograd.grad(loss, contexts))):
                expected[layer] += (c * g).view(-1, 4, 8).sum(dim=(0, 2)).double().pow(2)  # (T, H, D) -> (H,)
            n += 1
    got = fisher_importance(model, HeadMask.for_model(model), batches)
    torch.testing.assert_close(got, (expected / n).float(), rtol=1e-4, atol=1e-12)


# -- magnitude -------------------------------------------------------------------------------------
def _direct_magnitude(model) -> torch.Tensor:
    """Per-head weight norms from reshaped full weights (no slicing helpers)."""
    adapter = get_adapter(model)
    cfg = model.config
    n, d = adapter.num_heads(cfg), adapter.head_dim(cfg)
    n_kv = adapter.num_kv_heads(cfg)
    rows = []
    for block in adapter.blocks(model):
        attn = adapter.attention(block)
        if adapter.name == "gpt2":
            qkv = attn.c_attn.weight.view(-1, 3, n, d)  # (E, 3, H, D)
            sq = qkv.pow(2).sum(dim=(0, 3)).sum(0)  # (H,)
            o = attn.c_proj.weight.view(n, d, -1).pow(2).sum(dim=(1, 2))  # (H,)
            rows.append((sq + o).sqrt())
            continue
        q = attn.get_submodule(adapter.q).weight.view(n, d, -1).pow(2).sum(dim=(1, 2))
        k = attn.get_submodule(adapter.k).weight.view(n_kv, d, -1).pow(2).sum(dim=(1, 2))
        v = attn.get_submodule(adapter.v).weight.view(n_kv, d, -1).pow(2).sum(dim=(1, 2))
        o = attn.get_submodule(adapter.o).weight.view(-1, n, d).pow(2).sum(dim=(0, 2))
        group = n // n_kv
        rows.append((q + k.repeat_interleave(group) + v.repeat_interleave(group) + o).sqrt())
    return torch.stack(rows).detach()


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_magnitude_matches_direct_slice_norms_and_survives_physical_pruning(arch):
    model = {"bert": tiny_bert, "gpt2": tiny_gpt2_classifier, "llama": tiny_llama_classifier}[arch]()
    expected = _direct_magnitude(model)
    got = magnitude_importance(model, HeadMask.for_model(model, attach=False))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    only_o = magnitude_importance(model, HeadMask.for_model(model, attach=False), parts=["o"])
    assert (only_o < got).all()
    pruned = [(0, 0), (0, 1), (1, 2)]  # llama: layer 0 loses a whole KV group, layer 1 half of one
    prune_heads(model, pruned)
    mask = HeadMask.for_model(model, attach=False)
    mask.prune(pruned)
    after = magnitude_importance(model, mask)
    torch.testing.assert_close(after, torch.where(mask.alive(), expected, torch.zeros(())), rtol=1e-5, atol=1e-7)


# -- LRP -------------------------------------------------------------------------------------------
def _bias_params(module: torch.nn.Module) -> list:
    return [p for n, p in module.named_parameters() if n.endswith("bias")]


def _head_biases(model) -> list:
    """Bias parameters after the last block: pooler, final norm, classifier."""
    adapter = get_adapter(model)
    inside = {id(p) for block in adapter.blocks(model) for p in block.parameters()}
    embeddings = {id(p) for p in model.get_input_embeddings().parameters()}
    embeddings |= {id(p) for n, p in model.base_model.named_parameters() if n.startswith(("embeddings.", "wpe."))}
    return [p for n, p in model.named_parameters() if n.endswith("bias") and id(p) not in inside | embeddings]


def _conservation_terms(model, batch, rules: bool = True):
    """z (summed target logits) and, for each block l, sum(h_l * dz/dh_l) + sum over biases after h_l
    of sum(b * dz/db), where h_l is the block's input (the residual stream)."""
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    inputs = []
    hooks = [b.register_forward_pre_hook(
        lambda m, args, kwargs: inputs.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        for b in blocks]
    try:
        if rules:
            with conservative_backward(model):
                logits = forward_logits(model, batch)
        else:
            logits = forward_logits(model, batch)
    finally:
        for h in hooks:
            h.remove()
    z = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
    biases = [_bias_params(b) for b in blocks] + [_head_biases(model)]
    flat = [p for group in biases for p in group]
    grads = torch.autograd.grad(z, inputs + flat, allow_unused=True)
    h_terms = [(h * g).sum() for h, g in zip(inputs, grads[:len(inputs)])]
    b_terms = [(p * g).sum() if g is not None else torch.zeros((), dtype=p.dtype)
               for p, g in zip(flat, grads[len(inputs):])]
    sizes = [len(group) for group in biases]
    per_group = torch.stack([torch.stack(b_terms[sum(sizes[:i]):sum(sizes[:i + 1])]).sum() if sizes[i] else
                             torch.zeros((), dtype=z.dtype) for i in range(len(sizes))])
    totals = [h_terms[l] + per_group[l:].sum() for l in range(len(blocks))]
    return z.detach(), torch.stack(totals).detach()


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_lrp_conserves_the_logit_at_every_layer_boundary(arch, tokenizer):
    """Conserved quantity: z = sum(h_l * dz/dh_l) + sum_{biases b after h_l} sum(b * dz/db) for the input
    h_l of every block, z the summed predicted-class logits; float64, relative tolerance 1e-9 (1e-7 for
    Llama)."""
    model = {"bert": tiny_bert, "gpt2": tiny_gpt2_classifier, "llama": tiny_llama_classifier}[arch]().double()
    batch = tiny_batch(tokenizer) if arch == "bert" else random_batch()
    z, totals = _conservation_terms(model, batch)
    tolerance = 1e-7 if arch == "llama" else 1e-9  # LlamaRMSNorm computes in float32 even in float64 models
    torch.testing.assert_close(totals, z.expand_as(totals), rtol=tolerance, atol=tolerance)
    if arch == "bert":  # plain gradient x input is not conservative: the rules matter
        z, totals = _conservation_terms(model, batch, rules=False)
        assert ((totals - z).abs() / z.abs()).max() > 1e-3


def test_lrp_head_relevance_adds_up_to_the_attention_output(tokenizer):
    """Per layer and example: sum_h R_h + sum(b_o * dz/db_o) = sum(a * dz/da), the relevance of the
    attention output projection's output a = W_o c + b_o (float64 model; the float32 head gates give
    relative tolerance 1e-6)."""
    model = tiny_bert().double()
    batch = tiny_batch(tokenizer)
    mask = HeadMask.for_model(model)
    relevance = head_relevance(model, mask, batch)  # (B, L, H)
    adapter = get_adapter(model)
    outs = []
    hooks = [adapter.out_proj(b).register_forward_hook(lambda m, a, out: outs.append(out)) for b in adapter.blocks(model)]
    with conservative_backward(model):
        logits = forward_logits(model, batch)
    for h in hooks:
        h.remove()
    z = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
    grads = torch.autograd.grad(z, outs)
    for layer, (a, g) in enumerate(zip(outs, grads)):
        bias = adapter.out_proj(adapter.blocks(model)[layer]).bias
        per_example = (a * g).sum(dim=(1, 2)) - (bias * g).sum(dim=(1, 2))  # (B,): relevance minus bias share
        torch.testing.assert_close(relevance[:, layer].sum(-1).double(), per_example.detach(), rtol=1e-6, atol=1e-8)


def test_lrp_scores_are_per_layer_shares(tokenizer):
    model = tiny_bert()
    batches = _two_batches(tokenizer)
    mask = HeadMask.for_model(model)
    mask.prune([(1, 1)])
    scores = lrp_importance(model, mask, batches)
    torch.testing.assert_close(scores.sum(1), torch.ones(3), rtol=1e-5, atol=1e-6)
    signed = lrp_importance(model, mask, batches, signed=True)
    relevance = torch.cat([head_relevance(model, mask, b).double() for b in batches])  # (N, L, H)
    share = relevance / relevance.abs().sum(-1, keepdim=True)  # R_h / sum |R|, sign kept
    expected = torch.where(mask.alive(), share.mean(0), torch.zeros(())).float()
    torch.testing.assert_close(signed, expected, rtol=1e-5, atol=1e-7)
    assert (signed < 0).any() and not torch.equal(signed, scores)  # some heads argue against the logit
    gold = lrp_importance(model, mask, batches, target="gold")
    assert gold.shape == (3, 4) and not torch.equal(gold, scores)


# -- L0 gates --------------------------------------------------------------------------------------
def test_hard_concrete_open_probability_matches_sampling():
    gates = HardConcreteGates(1, 3)
    with torch.no_grad():
        gates.log_alpha.copy_(torch.tensor([[-2.0, 0.0, 1.5]]))
    g = torch.Generator().manual_seed(0)
    with gates.sampling(g), torch.no_grad():
        samples = torch.stack([gates.gate(0, [0, 1, 2], sample=False) for _ in range(20000)])  # (N, 3)
    assert ((samples >= 0) & (samples <= 1)).all()
    torch.testing.assert_close((samples > 0).float().mean(0), gates.open_probability()[0].detach(), atol=0.015, rtol=0)
    assert (samples == 0).any() and (samples == 1).any()  # hard zeros and ones
    expected = torch.sigmoid(torch.tensor([-2.0, 0.0, 1.5]) - 2 / 3 * math.log(0.1 / 1.1))
    torch.testing.assert_close(gates.open_probability()[0].detach(), expected)


def test_l0_penalty_in_the_lightning_module(tokenizer):
    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # only the gates are random
    batch = tiny_batch(tokenizer)
    with torch.no_grad():
        plain = model(**_inputs(batch)).logits
    module = HeadPruneModule(model, num_labels=2, l0_penalty=0.05, l0_lr=0.2)
    gates = module.head_mask.stochastic
    assert isinstance(gates, HardConcreteGates)
    assert "head_mask.stochastic.log_alpha" in module.state_dict()
    module.eval()
    with torch.no_grad():  # deterministic gates start fully open: the model is unchanged
        torch.testing.assert_close(module(batch), plain)
    module.train()
    torch.manual_seed(0)
    loss = module.training_step(batch, 0)
    torch.manual_seed(0)  # the same dropout and gate noise
    ce = module.task.loss(module(batch), batch).mean()
    torch.testing.assert_close(loss, ce + 0.05 * gates.expected_l0())
    with torch.no_grad():  # in training the gates are sampled
        torch.manual_seed(1)
        assert not torch.equal(module.model(**_inputs(batch)).logits, module.model(**_inputs(batch)).logits)
    loss.backward()
    assert gates.log_alpha.grad is not None and gates.log_alpha.grad.abs().sum() > 0
    optimizer = module.configure_optimizers()
    assert [g["lr"] for g in optimizer.param_groups] == [5e-5, 0.2]
    assert optimizer.param_groups[1]["params"] == [gates.log_alpha]
    # the metric reads the learned gates instead of training new ones
    with torch.no_grad():
        gates.log_alpha[0, 1] = -3.0
    scores = l0_gates_importance(module.model, module.head_mask, [batch], steps=1)
    p_open = torch.sigmoid(gates.log_alpha.detach() - 2 / 3 * math.log(0.1 / 1.1))  # P(z != 0), Louizos et al.
    torch.testing.assert_close(scores, p_open)
    assert scores[0, 1] < 0.2 < scores[0, 0]


def test_l0_metric_trains_gates_on_a_frozen_model(tokenizer):
    model = tiny_bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mask = HeadMask.for_model(model)
    scores = l0_gates_importance(model, mask, _two_batches(tokenizer), steps=15, lr=0.1, penalty=0.05, seed=1)
    assert mask.stochastic is None
    assert ((scores > 0) & (scores < 1)).all() and scores.max() < 0.99  # the penalty closed gates
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="metric.penalty=-1"):
        HeadPruneModule(model, num_labels=2, l0_penalty=-1)
