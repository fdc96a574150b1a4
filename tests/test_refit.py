"""The output-projection refit (`recovery=refit`): the ridge solve from streamed sums, the
layer-by-layer refit on the pruned model's own inputs (never above least squares' calibration
error on the same tokens), the export that stays a plain checkpoint, uneven and attention-free
layouts, the CLI, and the settings refused up front."""
import pytest
import torch

from headprune import HeadMask, fold, load_pruned, save_pruned
from headprune.heads.surgery import prune_heads
from headprune.recovery import RECOVERIES, LeastSquares, Refit
from headprune.recovery.least_squares import tune_scales
from headprune.recovery.normal_equations import NormalEquations
from headprune.recovery.refit import held_out, refit_layers
from headprune.recovery.ridge import RidgeSums, scales_equations
from headprune.selection.layer_policies import GlobalPolicy
from headprune.selection.retraining_free import prune_to_budget
from tests.helpers import PRUNE as EVERY_LAYOUT, inputs, tiny, tiny_batch, tiny_bert


# -- the solve -----------------------------------------------------------------------------------
def test_noise_free_targets_are_fit_exactly_from_streamed_batches():
    """Y = C W* + b*: added in uneven batches, the undamped solve gives W* and b* and error 0;
    without the bias the bias stays the reference and the fit is worse; heavy damping stays at W0."""
    g = torch.Generator().manual_seed(0)
    w_star, b_star, w0 = torch.randn(6, 5, generator=g), torch.randn(5, generator=g), torch.randn(6, 5, generator=g)
    sums = RidgeSums(6, 5)
    for n in (4, 30, 11):
        c = torch.randn(n, 6, generator=g)
        sums.add(c, c @ w_star + b_star)
    assert int(sums.tokens) == 45
    w, b, lam = sums.solve(w0, torch.zeros(5), damp=0.0)
    torch.testing.assert_close(w.float(), w_star, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.float(), b_star, atol=1e-5, rtol=0)
    assert lam == 0 and sums.error(w, b) / sums.baseline(torch.zeros(5)) < 1e-12
    w_nb, b_nb, _ = sums.solve(w0, torch.zeros(5), damp=0.0, fit_bias=False)
    assert not b_nb.any() and sums.error(w_nb, b_nb) / sums.baseline(torch.zeros(5)) > 1e-3
    w_damped, _, _ = sums.solve(w0, torch.zeros(5), damp=1e8)
    torch.testing.assert_close(w_damped.float(), w0, atol=1e-4, rtol=0)


def test_the_scales_problem_rebuilt_from_the_sums_is_least_squares_own():
    """scales_equations(sums) equals the NormalEquations least squares accumulates on the same tokens."""
    g = torch.Generator().manual_seed(1)
    heads, d, e = 3, 2, 4
    w0 = torch.randn(heads * d, e, generator=g, dtype=torch.float64)
    sums, direct = RidgeSums(heads * d, e), NormalEquations(heads, e)
    for n in (5, 9):
        c, y = torch.randn(n, heads * d, generator=g), torch.randn(n, e, generator=g)
        sums.add(c, y)
        direct.add(c.view(n, heads, d), w0.view(heads, d, e), y)
    rebuilt = scales_equations(sums, w0, heads)
    for name in ("gram", "cross", "head_sum", "target_sum", "target_sq", "tokens"):
        torch.testing.assert_close(getattr(rebuilt, name), getattr(direct, name), atol=1e-5, rtol=1e-5)


def test_a_layer_where_the_scales_reconstruct_better_keeps_them(tokenizer):
    """Damping so heavy that the refit stays at the current weights: every layer falls back to
    least squares' scales and bias, so its error is least squares' own (layer 0: same inputs)."""
    batches = calibration("gpt2", tokenizer)
    model, mask = model_and_mask("gpt2", PRUNE["gpt2"])
    report = refit_layers(model, mask, mask.unmasked_copy(model), batches, Refit(damps=[1e9], holdout=0.0))
    assert all(layer["kept_scales"] and layer["error_after"] == layer["error_scales"] for layer in report["layers"])
    ls_model, ls_mask = model_and_mask("gpt2", PRUNE["gpt2"])
    ls = tune_scales(ls_model, ls_mask, ls_mask.unmasked_copy(ls_model), batches, LeastSquares())
    assert report["layers"][0]["error_after"] == pytest.approx(ls["layers"][0]["error_tuned"], rel=1e-5)


def test_held_out_sequences_are_spread_evenly():
    assert held_out(8, 0.25) == [False, False, False, True] * 2
    assert sum(held_out(10, 0.5)) == 5 and not any(held_out(4, 0.0))


# -- the refit on a model ------------------------------------------------------------------------
PRUNE = {"bert": [(0, 1), (1, 0), (1, 3), (2, 2), (2, 3)],
         "gpt2": [(0, 0), (1, 1), (1, 2), (2, 3)],
         "llama": [(0, 2), (0, 3), (1, 0), (1, 1), (2, 2), (2, 3)]}  # Llama-GQA: whole KV groups


def model_and_mask(family: str, prune):
    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0) if family == "bert" else tiny(family)
    mask = HeadMask.for_model(model)
    mask.prune(prune)
    return model, mask


def calibration(family: str, tokenizer, n: int = 4) -> list[dict]:
    if family == "bert":
        return [tiny_batch(tokenizer, 8, seed=s) for s in range(n)]
    return [inputs(batch=4, tokens=12, seed=s) for s in range(n)]


@pytest.mark.parametrize("target", ["residual", "attention"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_the_calibration_error_is_never_above_least_squares_on_the_same_tokens(family, target, tokenizer):
    """Every layer's calibration error after the refit is at most least squares' on the same
    tokens and target (the scales rebuilt from the same sums), and at most the unrefit one; layer
    0, whose inputs are the same for both, also beats the least_squares recovery run on its own
    (with target=residual, its target). The refit moves the weights, not the gates."""
    batches = calibration(family, tokenizer)
    model, mask = model_and_mask(family, PRUNE[family])
    dense = mask.unmasked_copy(model)
    before = [p.detach().clone() for p in model.parameters()]
    report = refit_layers(model, mask, dense, batches, Refit(target=target))
    layers = report["layers"]
    assert report["tokens"]["fit"] > 0 and report["tokens"]["heldout"] > 0 and len(layers) == 3
    for layer in layers:
        assert layer["error_after"] <= layer["error_scales"] + 1e-9
        assert layer["error_after"] <= layer["error_before"] + 1e-9
        assert layer["damp"] in Refit().damps and set(layer["heldout"]) == {str(d) for d in Refit().damps}
    assert any(layer["error_after"] < 0.9 * layer["error_scales"] for layer in layers)  # more than scales can do
    assert set(mask.mask.unique().tolist()) <= {0.0, 1.0}
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    if target == "residual":
        ls_model, ls_mask = model_and_mask(family, PRUNE[family])
        ls = tune_scales(ls_model, ls_mask, ls_mask.unmasked_copy(ls_model), batches, LeastSquares())
        first = ls["layers"][0]
        least = min(first["error_tuned"], first["error_ones"])
        assert layers[0]["error_before"] == pytest.approx(first["error_ones"], rel=1e-4)
        assert layers[0]["error_after"] <= least + 1e-9


@torch.no_grad()
def block_values(model, batches: list[dict]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer over the batches' real tokens, from plain full forwards: (block inputs (N, E),
    attention output-projection outputs (N, E))."""
    from headprune.heads.adapters import get_adapter

    adapter = get_adapter(model)
    ins: list[list] = [[] for _ in adapter.blocks(model)]
    outs: list[list] = [[] for _ in adapter.blocks(model)]
    real: dict = {}
    handles = []
    for layer, block in enumerate(adapter.blocks(model)):
        handles.append(block.register_forward_pre_hook(lambda m, args, kwargs, layer=layer: ins[layer].append(
            (args[0] if args else kwargs["hidden_states"])[real["mask"]]), with_kwargs=True))
        handles.append(adapter.out_proj(block).register_forward_hook(
            lambda m, args, out, layer=layer: outs[layer].append(out[real["mask"]])))
    for batch in batches:
        real["mask"] = batch["attention_mask"].bool()
        model(**{k: v for k, v in batch.items() if k != "labels"})
    for handle in handles:
        handle.remove()
    return [torch.cat(v) for v in ins], [torch.cat(v) for v in outs]


@pytest.mark.parametrize("target", ["residual", "attention"])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_the_reported_errors_are_what_the_refit_model_computes(family, target, tokenizer):
    """Full forwards of the refit model measure every layer's reported calibration error against
    its target: residual || (x_p + o_p) - (x_d + o_d) ||^2 / || x_d + o_d - x_p - b ||^2 (x_p from
    the refit layers before), attention || o_p - o_d ||^2 / || o_d - b ||^2 (b: O's bias before)."""
    batches = calibration(family, tokenizer)
    model, mask = model_and_mask(family, PRUNE[family])
    dense = mask.unmasked_copy(model)
    report = refit_layers(model, mask, dense, batches, Refit(target=target))
    (x_p, o_p), (x_d, o_d) = block_values(model, batches), block_values(dense, batches)
    from headprune.heads.adapters import get_adapter

    adapter = get_adapter(dense)
    for layer in report["layers"]:
        l = layer["layer"]
        o = adapter.out_proj(adapter.blocks(dense)[l])
        b = o.bias.detach() if o.bias is not None else torch.zeros(o.weight.shape[0])
        if target == "residual":
            measured = (x_p[l] + o_p[l] - x_d[l] - o_d[l]).pow(2).sum() / (x_d[l] + o_d[l] - x_p[l] - b).pow(2).sum()
        else:
            measured = (o_p[l] - o_d[l]).pow(2).sum() / (o_d[l] - b).pow(2).sum()
        assert float(measured) == pytest.approx(layer["error_after"], rel=1e-3, abs=1e-6)
    assert report["layers"][1]["error_after"] < report["layers"][1]["error_before"]


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_the_export_after_a_refit_is_a_plain_checkpoint_with_the_same_logits(family, tokenizer, tmp_path):
    """Heads of every layer pruned uniformly (Llama: one KV group of two per layer): after the
    refit, fold + save_pruned write a checkpoint whose logits are the refit
    masked model's (Llama: attention_bias=true, zero Q/K/V biases, O's bias fitted)."""
    uniform = {"bert": [(l, h) for l in range(3) for h in (1, 2)], "gpt2": [(l, 3) for l in range(3)],
               "llama": [(l, h) for l in range(3) for h in (2, 3)]}[family]
    model, mask = model_and_mask(family, uniform)
    dense = mask.unmasked_copy(model)
    refit_layers(model, mask, dense, calibration(family, tokenizer), Refit())
    batch = calibration(family, tokenizer, 1)[0] if family == "bert" else inputs(seed=9)
    batch = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        refit = model(**batch).logits
        assert not torch.allclose(refit, dense(**batch).logits, atol=1e-6, rtol=0)
    fold(model, mask)
    saved = save_pruned(model, tmp_path / "export")
    with torch.no_grad():
        torch.testing.assert_close(load_pruned(tmp_path / "export").eval()(**batch).logits, refit, atol=1e-5, rtol=0)
    # fewer heads fit a plain config only where the config has its own head_dim (Llama)
    assert saved.plain_hf == (family == "llama")
    if family == "llama":
        import transformers as tf

        plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(**batch).logits, refit, atol=1e-5, rtol=0)
        attn = plain.model.layers[1].self_attn
        assert plain.config.attention_bias and attn.o_proj.bias.detach().any()
        assert all(not p.bias.detach().any() for p in (attn.q_proj, attn.k_proj, attn.v_proj))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_uneven_physically_pruned_layouts_and_a_layer_without_heads(family):
    """Heads physically removed unevenly (layer 0 has none left, layer 1 an uneven KV group), then
    more masked: the attention-free layer is skipped without a bias and gets its mean target with one, the
    others refit and reconstruct better."""
    model = tiny(family)
    prune_heads(model, [(l, h) for l, hs in EVERY_LAYOUT.items() for h in hs])
    if family == "gpt2":  # the headless layer outputs its bias: make it one the fit has to find
        torch.nn.init.normal_(model.transformer.h[0].attn.c_proj.bias)
    mask = HeadMask.for_model(model)
    mask.prune([(1, 0)])
    dense = mask.unmasked_copy(model)
    report = refit_layers(model, mask, dense, [inputs(batch=4, tokens=12, seed=s) for s in range(4)],
                          Refit(bias=family == "gpt2"))
    zero, one, two = report["layers"]
    if family == "gpt2":  # with a bias, the layer without heads fits its mean target; the "dense" model lost
        # the same heads physically, so that is the bias it has already
        assert zero["heads"] == [] and zero["bias_only"] and zero["bias_norm"] < 1e-6
    else:
        assert zero == {"layer": 0, "heads": [], "skipped": "no heads"}
    assert one["heads"] == [2, 3] and two["heads"] == [0, 1]
    assert all(layer["error_after"] < layer["error_before"] for layer in (one, two))
    assert all(layer["error_after"] <= layer["error_scales"] + 1e-9 for layer in (one, two))


def test_a_layer_without_heads_gets_bias_compensations_bias_on_the_attention_target():
    """All of layer 0's heads masked (attention drop's layout): on the attention target the refit's
    only fit there is the mean dense attention output, which is bias compensation's bias (both see
    the dense inputs at layer 0); later layers then refit on what that bias leaves."""
    from headprune.recovery.bias_compensation import compensate

    batches = [inputs(batch=4, tokens=12, seed=s) for s in range(3)]
    fitted = []
    for repair in ("refit", "bias_compensation"):
        model = tiny("llama")
        mask = HeadMask.for_model(model)
        mask.prune([(0, h) for h in range(mask.mask.shape[1])])
        dense = mask.unmasked_copy(model)
        if repair == "refit":
            report = refit_layers(model, mask, dense, batches, Refit(target="attention", damps=[0.01], bias=True))
            assert report["layers"][0]["bias_only"] and report["layers"][0]["error_after"] < 1.0
        else:
            compensate(model, mask, dense, batches)
        fitted.append(model.model.layers[0].self_attn.o_proj.bias.detach().clone())
    assert fitted[0].abs().max() > 0
    torch.testing.assert_close(fitted[0], fitted[1], rtol=1e-4, atol=1e-6)


def test_prune_to_budget_takes_it_and_records_the_report():
    """The Python API: prune_to_budget(..., recovery="refit") on a KV budget (Llama-GQA)."""
    model = tiny("llama")
    mask = HeadMask.for_model(model)
    report = prune_to_budget(model, [inputs(batch=4, tokens=12, seed=s) for s in range(4)],
                             {"kind": "kv", "target": 0.5, "batch": 1, "seq": 16}, recovery="refit", mask=mask,
                             layer_policy=GlobalPolicy(min_heads_per_layer=0), eval_loader=[inputs(seed=7)])
    record = report["round"]
    assert RECOVERIES["refit"] is Refit and Refit.needs_dense
    assert [layer["layer"] for layer in record["refit"]["layers"]] == [0, 1, 2] and record["refit"]["seconds"] >= 0


# -- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, pattern", [
    (dict(target="dense"), r"recovery.target='dense' is not allowed; allowed: residual, attention"),
    (dict(damps=[]), r"recovery.damps=\[\] must be a non-empty list of numbers >= 0"),
    (dict(damps=[0.01, -1.0]), r"recovery.damps=.* must be a non-empty list of numbers >= 0"),
    (dict(holdout=1.0), r"recovery.holdout=1.0 must be in \[0, 1\)"),
    (dict(holdout=0.0), r"recovery.holdout=0 leaves nothing to choose .*allowed: holdout in \(0, 1\), or a single damp"),
    (dict(bias="yes"), r"recovery.bias='yes' must be true or false"),
])
def test_bad_settings_are_refused_with_the_allowed_values(settings, pattern):
    with pytest.raises(ValueError, match=pattern):
        Refit(**settings)
    Refit(holdout=0.0, damps=[0.01])


def test_a_model_that_cannot_carry_a_bias_and_too_little_data_are_refused():
    with pytest.raises(ValueError, match="recovery=refit with recovery.bias=true .*model_type='qwen2'.*"
                                         "or set recovery.bias=false"):
        Refit().check_model(tiny("qwen2"))
    Refit(bias=False).check_model(tiny("qwen2"))
    model, mask = model_and_mask("llama", PRUNE["llama"])
    with pytest.raises(ValueError, match="splits the 3 calibration sequences into .* 0 held-out tokens"):
        refit_layers(model, mask, mask.unmasked_copy(model), [inputs(batch=3, tokens=12)], Refit(holdout=0.2))
    with pytest.raises(ValueError, match="a resumed run no longer has"):
        Refit().resume(None)


def test_the_config_group_composes_and_a_misspelt_option_fails(tmp_path, data_dir):
    from headprune.runs.components import build
    from headprune.apps.config_schema import register_schemas
    from tests.helpers import compose_train

    register_schemas()
    refit = build(compose_train(tmp_path, data_dir, "recovery=refit", "recovery.target=attention").recovery)
    assert isinstance(refit, Refit) and refit.target == "attention" and refit.damps == Refit().damps
    with pytest.raises(Exception, match="damp"):
        compose_train(tmp_path, data_dir, "recovery=refit", "recovery.damp=0.1")


@pytest.mark.slow
def test_the_app_runs_recovery_refit_on_a_tiny_model(tmp_path, data_dir):
    """The headprune-train app (its `run`, in process): experiment=retraining_free model=tiny_bert
    recovery=refit prunes one round, records the refit's report and the validation after it, and
    writes the export."""
    import headprune.apps.train as train_app
    from tests.helpers import compose_train

    cfg = compose_train(tmp_path, data_dir, "experiment=retraining_free", "model=tiny_bert",
                        "model.pretrained=sentence-transformers/all-MiniLM-L6-v2", "recovery=refit",
                        "data.score_samples=32", "data.max_validation_samples=32", "budget=flops",
                        "budget.target=0.6", "budget.batch=4", "budget.seq=16")
    res = train_app.run(cfg)
    (round1,) = res["rounds"]
    assert len(round1["refit"]["layers"]) == 3 and round1["refit"]["target"] == "residual"
    assert round1["refit"]["tokens"]["heldout"] > 0 and (tmp_path / "export").is_dir()


@pytest.mark.parametrize("recovery", ["recovery=refit", "recovery=chain"])
def test_a_calibration_set_the_holdout_cannot_split_is_refused_before_any_work(recovery, tmp_path, data_dir):
    """data.score_samples=1 with recovery.holdout=0.25 and four damps: no sequence is held out to
    choose the damp on. Refused by the app before the model loads or anything is written (it used
    to fail after the round's scoring); the chain's refit stage too."""
    import headprune.apps.train as train_app
    from tests.helpers import compose_train

    cfg = compose_train(tmp_path, data_dir, "experiment=retraining_free", "model=tiny_bert",
                        "model.pretrained=sentence-transformers/all-MiniLM-L6-v2", recovery,
                        "data.score_samples=1", "budget=flops", "budget.target=0.6")
    with pytest.raises(ValueError, match=r"recovery.holdout=0.25 splits data.score_samples=1 calibration sequences "
                                         r"into 1 to fit on and 0 held out; .*allowed: more data.score_samples"):
        train_app.run(cfg)
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "train.log").exists()
    Refit().check_calibration(4)  # one of four held out: fits
    Refit(damps=[0.01]).check_calibration(1)  # one damp needs no held-out sequence


# -- removal ranked by the refit's leftover error (metric=refit_error) ---------------------------
def test_greedy_errors_are_the_errors_of_brute_force_refits():
    """Blocks of columns removed greedily: each step's error is min ||C_kept W' - C W||^2 over the
    kept columns' W' (least squares refit), the cheapest block first; a score is the running
    maximum of those step errors."""
    from headprune.scoring.refit_error import greedy_errors

    g = torch.Generator().manual_seed(3)
    c = torch.randn(200, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, 5, generator=g, dtype=torch.float64)
    blocks = [[0, 1], [2, 3], [4, 5], [6, 7]]
    scores = greedy_errors(c.T @ c, w, blocks, damp=0.0)

    def left(removed):  # error of the best refit without the `removed` blocks
        cols = [i for b in range(4) if b not in removed for i in blocks[b]]
        if not cols:
            return float((c @ w).pow(2).sum())
        fit = torch.linalg.lstsq(c[:, cols], c @ w).solution
        return float((c[:, cols] @ fit - c @ w).pow(2).sum())

    removed, worst, expected = [], 0.0, [0.0] * 4
    while len(removed) < 4:
        base = left(removed)
        step = {b: left(removed + [b]) - base for b in range(4) if b not in removed}
        b = min(step, key=step.get)
        worst = max(worst, step[b])
        expected[b] = worst
        removed.append(b)
    assert scores == pytest.approx(expected, rel=1e-6)
    assert sorted(scores) == pytest.approx([expected[b] for b in removed], rel=1e-6)  # rising along the order


def test_a_head_the_others_can_replace_goes_first():
    """GPT-2 layer 1 with head 1 a copy of head 0 (same Q/K/V rows): the refit can give head 0
    head 1's output columns, so removing one of them leaves no error (undamped) and it ranks lowest."""
    from headprune.heads.adapters import get_adapter
    from headprune.scoring import score_heads

    model = tiny("gpt2")
    rows = get_adapter(model).head_rows(model, 1)
    with torch.no_grad():
        for part in ("q", "k", "v"):
            rows[1][part].weight().copy_(rows[0][part].weight())
            r0, r1 = rows[0][part], rows[1][part]
            model.transformer.h[1].attn.c_attn.bias[r1.start:r1.stop] = model.transformer.h[1].attn.c_attn.bias[r0.start:r0.stop]
    scores = score_heads(model, [inputs(batch=4, tokens=12, seed=s) for s in range(3)], metric="refit_error",
                         unit="head", damp=0.0)
    layer = scores[1]
    assert int(layer.argmin()) in (0, 1) and float(layer.min()) < 1e-6 * float(layer.max())
    assert float(scores[0].min()) > 1e-3 * float(scores[0].max())  # no such head elsewhere


def test_kv_groups_go_whole_under_any_budget_and_policy():
    """Llama-GQA: unit=kv_group gives a group's heads one equal share each; the selection consumes
    the scores under a KV budget (uniform policy) and a heads budget (global policy), with the refit."""
    from headprune.scoring import score_heads
    from headprune.selection.layer_policies import UniformPolicy

    batches = [inputs(batch=4, tokens=12, seed=s) for s in range(4)]
    scores = score_heads(tiny("llama"), batches, metric="refit_error")
    assert torch.equal(scores[:, 0], scores[:, 1]) and torch.equal(scores[:, 2], scores[:, 3])
    per_head = score_heads(tiny("llama"), batches, metric="refit_error", unit="head")
    assert not torch.equal(per_head[:, 0], per_head[:, 1])
    model = tiny("llama")
    mask = HeadMask.for_model(model)
    prune_to_budget(model, batches, {"kind": "kv", "target": 0.5, "batch": 1, "seq": 16},
                             metric="refit_error", recovery="refit", mask=mask, layer_policy=UniformPolicy(),
                             rearrange=False)
    lowest = [(l, int(scores[l].argmin())) for l in range(3)]
    removed = set(map(tuple, mask.pruned()))
    assert all((l, h) in removed and (l, h ^ 1) in removed for l, h in lowest)  # the cheaper group, whole
    assert mask.heads_per_layer() == [2, 2, 2]
    model = tiny("llama")
    mask = HeadMask.for_model(model)
    prune_to_budget(model, batches, {"kind": "heads", "target": 0.5}, metric="refit_error", recovery="none", mask=mask,
                    layer_policy=GlobalPolicy(min_heads_per_layer=0), rearrange=False)
    assert sum(mask.heads_per_layer()) == 6


def test_bad_metric_options_are_refused_with_the_allowed_values():
    from headprune.scoring import score_heads

    with pytest.raises(ValueError, match="metric.unit='group' is not allowed; allowed: kv_group, head"):
        score_heads(tiny("llama"), [inputs()], metric="refit_error", unit="group")
    with pytest.raises(ValueError, match="metric.damp=-1 must be a number >= 0"):
        score_heads(tiny("llama"), [inputs()], metric="refit_error", damp=-1)
