"""Least-squares mask tuning (Kwon et al. 2022): the solver with and without the bias term, the
layer-by-layer fit on the pruned model's own inputs toward what enters each next norm, the
export that folds scales and bias in, and that the tuning streams (blocks run and tensors held
do not grow with layers x layers or layers x tokens)."""
import gc
import warnings

import pytest
import torch

from headprune import HeadMask, fold, load_pruned, save_pruned
from headprune.heads.adapters import get_adapter
from headprune.recovery import LeastSquares
from headprune.recovery.least_squares import solve_scales, tune_scales
from headprune.recovery.normal_equations import NormalEquations
from tests.helpers import inputs, tiny, tiny_batch, tiny_bert, tiny_gqa_llama


# -- the solver --------------------------------------------------------------------------------------
def test_solver_recovers_planted_scales():
    """A linear layer whose best scales are known: y = A m*, so with no damping and a wide range
    the solver returns m* exactly and the reconstruction error is 0."""
    g = torch.Generator().manual_seed(0)
    contributions = torch.randn(500, 4, generator=g, dtype=torch.float64)  # (tokens x units, heads)
    planted = torch.tensor([0.7, 1.3, 1.0, 0.9], dtype=torch.float64)
    y = contributions @ planted
    gram, cross = contributions.T @ contributions, contributions.T @ y
    m, info = solve_scales(gram, cross, float(y @ y), scale_range=(0.1, 10.0), damp=0.0)
    torch.testing.assert_close(m, planted)
    assert info["error_tuned"] < 1e-20 < info["error_ones"] and not info["kept_ones"]
    clamped, _ = solve_scales(gram, cross, float(y @ y), scale_range=(0.8, 1.2), damp=0.0)
    assert float(clamped.min()) == 0.8 and float(clamped.max()) == 1.2
    damped, _ = solve_scales(gram, cross, float(y @ y), scale_range=(0.1, 10.0), damp=1e6)
    assert float((damped - 1).abs().max()) < 1e-3  # heavy damping stays at 1


def test_clamped_scales_that_reconstruct_worse_keep_one():
    contributions = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([3.0, 1.0], dtype=torch.float64)  # best: m = (3, 1); clamped to 0.5..0.6 is worse than 1
    m, info = solve_scales(contributions.T @ contributions, contributions.T @ y, float(y @ y), (0.5, 0.6), 0.0)
    assert info["kept_ones"] and torch.equal(m, torch.ones(2, dtype=torch.float64))


def test_normal_equations_recover_planted_scales_and_bias_from_streamed_chunks(monkeypatch):
    """y_n = sum_h m*_h W_h x_nh + b*: added in uneven batches (and chunks of 7 tokens), the sums
    give m* and b* exactly; without the bias term the fit is worse and the bias stays the reference."""
    import headprune.recovery.normal_equations as ne

    monkeypatch.setattr(ne, "CHUNK", 7 * 3 * 6)  # 7 tokens x 3 heads x 6 features per chunk
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(3, 2, 6, generator=g)  # (h, D, E)
    m_star, b_star = torch.tensor([0.6, 1.4, 1.1]), torch.randn(6, generator=g)
    eq = NormalEquations(3, 6)
    for n in (5, 40, 13):
        x = torch.randn(n, 3, 2, generator=g)  # (N, h, D)
        y = torch.einsum("nhd,hde,h->ne", x, weights, m_star) + b_star  # (N, E)
        eq.add(x, weights, y)
    assert int(eq.tokens) == 58
    m, b, info = eq.solve(torch.zeros(6), scale_range=(0.1, 10.0), damp=0.0)
    torch.testing.assert_close(m.float(), m_star, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.float(), b_star, atol=1e-5, rtol=0)
    assert info["error_tuned"] < 1e-6 < info["error_ones"]
    m_only, b_only, info_only = eq.solve(torch.zeros(6), scale_range=(0.1, 10.0), damp=0.0, fit_bias=False)
    assert torch.equal(b_only, torch.zeros(6, dtype=torch.float64)) and info_only["error_tuned"] > 1e-3


# -- the fit on a model ------------------------------------------------------------------------------
def model_and_mask(family: str, prune):
    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0) if family == "bert" else tiny(family)
    mask = HeadMask.for_model(model)
    mask.prune(prune)
    return model, mask


def calibration(family: str, tokenizer, n: int = 3) -> list[dict]:
    if family == "bert":
        return [tiny_batch(tokenizer, 8, seed=s) for s in range(n)]
    return [inputs(batch=4, tokens=12, seed=s) for s in range(n)]


PRUNE = {"bert": [(0, 1), (1, 0), (1, 3), (2, 2), (2, 3)],
         "gpt2": [(0, 0), (1, 1), (1, 2), (2, 3)],
         "llama": [(0, 2), (0, 3), (1, 0), (1, 1), (2, 2), (2, 3)]}  # Llama-GQA: whole KV groups


@torch.no_grad()
def pre_norm_values(model, batches: list[dict]) -> list[torch.Tensor]:
    """Per layer, over the batches' real tokens: block input + attention output-projection output
    (what enters the next norm), (N, E), computed by plain full forwards."""
    adapter = get_adapter(model)
    per_layer: list[list] = [[] for _ in adapter.blocks(model)]
    seen: dict = {}
    handles = []
    for layer, block in enumerate(adapter.blocks(model)):
        handles.append(block.register_forward_pre_hook(
            lambda m, args, kwargs, layer=layer: seen.__setitem__(layer, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
        handles.append(adapter.out_proj(block).register_forward_hook(
            lambda m, args, out, layer=layer: per_layer[layer].append((seen[layer] + out)[seen["real"]])))
    for batch in batches:
        seen["real"] = batch["attention_mask"].bool()
        model(**{k: v for k, v in batch.items() if k != "labels"})
    for handle in handles:
        handle.remove()
    return [torch.cat(values) for values in per_layer]


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_each_layer_fits_what_enters_the_next_norm_on_the_pruned_models_own_inputs(family, tokenizer):
    """The reported tuned error of every layer is what full forwards of the tuned model measure:
    || (x_p + o_p) - (x_d + o_d) ||^2 / || x_d + o_d - x_p - b_dense ||^2, x_p coming from the
    tuned layers before it. So the target includes the residual and the inputs are the pruned
    model's own; scales and bias both move, and every layer reconstructs at least as well as ones."""
    model, mask = model_and_mask(family, PRUNE[family])
    dense = mask.unmasked_copy(model)
    batches = calibration(family, tokenizer)
    report = tune_scales(model, mask, dense, batches, LeastSquares(scale_range=[0.1, 5.0], damp=0.0))
    tuned, target = pre_norm_values(model, batches), pre_norm_values(dense, batches)
    pruned_inputs = block_inputs(model, batches)
    adapter = get_adapter(dense)
    for layer in report["layers"]:
        l = layer["layer"]
        o = adapter.out_proj(adapter.blocks(dense)[l])
        dense_bias = o.bias.detach() if o.bias is not None else torch.zeros(o.weight.shape[0])
        scale = (target[l] - pruned_inputs[l] - dense_bias).pow(2).sum()
        measured = float((tuned[l] - target[l]).pow(2).sum() / scale)
        assert measured == pytest.approx(layer["error_tuned"], rel=1e-3, abs=1e-6)
        assert layer["error_tuned"] <= layer["error_ones"] + 1e-12 and layer["bias_norm"] > 0
    assert any(not layer["kept_ones"] for layer in report["layers"])
    assert ((mask.mask != 0) & (mask.mask != 1)).any()


@torch.no_grad()
def block_inputs(model, batches: list[dict]) -> list[torch.Tensor]:
    """Per layer, the block inputs on the batches' real tokens, (N, E), from full forwards."""
    adapter = get_adapter(model)
    per_layer: list[list] = [[] for _ in adapter.blocks(model)]
    real: dict = {}
    handles = [block.register_forward_pre_hook(
        lambda m, args, kwargs, layer=layer: per_layer[layer].append(
            (args[0] if args else kwargs["hidden_states"])[real["mask"]]), with_kwargs=True)
        for layer, block in enumerate(adapter.blocks(model))]
    for batch in batches:
        real["mask"] = batch["attention_mask"].bool()
        model(**{k: v for k, v in batch.items() if k != "labels"})
    for handle in handles:
        handle.remove()
    return [torch.cat(values) for values in per_layer]


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_the_export_computes_the_masked_and_tuned_model(family, tokenizer, tmp_path):
    """Scales fold into O, the bias is O's own: fold, save_pruned and load give the logits of the
    masked and tuned model (Llama: attention_bias=true, zero Q/K/V biases)."""
    model, mask = model_and_mask(family, PRUNE[family])
    dense = mask.unmasked_copy(model)
    tune_scales(model, mask, dense, calibration(family, tokenizer), LeastSquares(scale_range=[0.1, 5.0]))
    batch = calibration(family, tokenizer, 1)[0] if family == "bert" else inputs(seed=9)
    batch = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        tuned = model(**batch).logits
        untuned = dense(**batch).logits
    assert not torch.allclose(tuned, untuned, atol=1e-6, rtol=0)  # tuning changed the model
    fold(model, mask)
    saved = save_pruned(model, tmp_path / "export")
    loaded = load_pruned(tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, tuned, atol=1e-5, rtol=0)
        torch.testing.assert_close(loaded(**batch).logits, tuned, atol=1e-5, rtol=0)
    if family == "llama":
        assert saved.plain_hf and loaded.config.attention_bias
        attn = loaded.model.layers[0].self_attn
        assert all(not p.bias.detach().any() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        assert attn.o_proj.bias.detach().any()


def test_bias_false_fits_scales_only_and_qwen2_needs_it(tokenizer):
    model, mask = model_and_mask("llama", PRUNE["llama"])
    report = tune_scales(model, mask, mask.unmasked_copy(model), calibration("llama", tokenizer),
                         LeastSquares(bias=False))
    assert not model.config.attention_bias and model.model.layers[0].self_attn.o_proj.bias is None
    assert all("bias_norm" not in layer for layer in report["layers"])
    qwen = tiny("qwen2")
    with pytest.raises(ValueError, match="model_type='qwen2'.*allowed: .*or set recovery.bias=false"):
        LeastSquares().check_model(qwen)
    LeastSquares(bias=False).check_model(qwen)
    with pytest.raises(ValueError, match="recovery.bias=1 must be true or false"):
        LeastSquares(bias=1)


# -- streaming ---------------------------------------------------------------------------------------
def held_tensor_bytes(exclude: set[int]) -> int:
    """Bytes of the distinct tensor storages alive now, except those in `exclude` (the models')."""
    storages = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type != "cpu":
            continue
        try:  # fake tensors left behind by an earlier torch.export in this process have no storage
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        if ptr not in exclude:
            storages[ptr] = storage.nbytes()
    return sum(storages.values())


def run_counted(layers: int, batches: list[dict], monkeypatch) -> dict:
    """Tune a Llama of `layers` layers, counting attention and MLP runs (both models) and the peak
    of tensor bytes held whenever a layer's normal equations take a batch, beyond those held before."""
    import headprune.recovery.normal_equations as ne

    model = tiny_gqa_llama(layers)
    mask = HeadMask.for_model(model)
    mask.prune([(l, h) for l in range(layers) for h in (2, 3)])
    dense = mask.unmasked_copy(model)
    counts = {"attention": 0, "mlp": 0}
    handles = []
    for m in (model, dense):
        for block in m.model.layers:
            handles.append(block.self_attn.o_proj.register_forward_pre_hook(
                lambda *a: counts.__setitem__("attention", counts["attention"] + 1)))
            handles.append(block.mlp.register_forward_pre_hook(lambda *a: counts.__setitem__("mlp", counts["mlp"] + 1)))
    params = {t.untyped_storage().data_ptr() for m in (model, dense) for t in [*m.parameters(), *m.buffers()]}
    params |= {mask.mask.untyped_storage().data_ptr()}
    gc.collect()
    before = held_tensor_bytes(params)  # what the process held already (an earlier run's leftovers): not this run's
    peak = {"bytes": 0}
    add = ne.NormalEquations.add

    def add_and_measure(self, *args):
        add(self, *args)
        peak["bytes"] = max(peak["bytes"], held_tensor_bytes(params) - before)

    monkeypatch.setattr(ne.NormalEquations, "add", add_and_measure)
    report = tune_scales(model, mask, dense, batches, LeastSquares())
    for handle in handles:
        handle.remove()
    return {**counts, "peak": peak["bytes"], "report": report}


@pytest.mark.slow
def test_tuning_streams_blocks_once_per_layer_and_holds_one_layer(monkeypatch, unfrozen_gc):  # get_objects(): all
    """Per batch and layer: the dense block once, the pruned block once up to its output
    projection and once whole (the last layer's whole runs are not needed): 2 passes' worth of
    MLPs and 3 of attention, linear in the layers (a forward per layer would be quadratic). The
    tensors held while fitting a layer do not grow with the number of layers."""
    batches = [inputs(batch=4, tokens=48, seed=s) for s in range(2)]  # each add() scans every live object: 2 batches, not 4
    small, large = run_counted(2, batches, monkeypatch), run_counted(8, batches, monkeypatch)
    for layers, run in ((2, small), (8, large)):
        assert run["mlp"] == len(batches) * 2 * (layers - 1)  # dense and pruned, all layers but the last
        assert run["attention"] == len(batches) * (3 * layers - 1)
        assert run["report"]["block_runs"] == {"dense": layers, "pruned": layers - 1, "pruned_to_out_proj": layers}
    hidden_bytes = sum(b["input_ids"].numel() for b in batches) * 32 * 4  # one layer's (B, T, E) float32, all batches
    assert small["peak"] > 2 * hidden_bytes  # both models' carried states at least
    assert large["peak"] < 1.25 * small["peak"], (small["peak"], large["peak"])
