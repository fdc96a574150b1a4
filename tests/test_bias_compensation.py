"""FLAP-style bias compensation (`recovery=bias_compensation`): the removed heads' mean output
goes into the output projection's bias, so each layer keeps its mean output; on a Llama-GQA model
with whole KV groups removed the checkpoint stays plain transformers (attention_bias=true, zero
Q/K/V biases) and computes what was evaluated."""
import pytest
import torch
import transformers as tf

from headprune import HeadMask, fold, prune_to_budget, save_pruned
from headprune.heads.adapters import get_adapter
from headprune.recovery import RECOVERIES, BiasCompensation
from headprune.recovery.bias_compensation import compensate
from headprune.selection.layer_policies import GlobalPolicy
from tests.helpers import inputs, tiny

GROUP_1 = [(layer, h) for layer in range(3) for h in (2, 3)]  # KV group 1 of every layer (heads 2, 3)


def calibration(n: int = 4, seed: int = 0) -> list[dict]:
    return [inputs(batch=4, tokens=16, seed=seed + s) for s in range(n)]


def llama_pruned():
    model = tiny("llama")
    mask = HeadMask.for_model(model)
    mask.prune(GROUP_1)
    return model, mask, mask.unmasked_copy(model)


@torch.no_grad()
def out_proj_io(model, batches: list[dict]) -> list[tuple[list, list]]:
    """Per layer: the output projection's inputs and outputs on the real tokens of every batch."""
    adapter = get_adapter(model)
    seen = [([], []) for _ in adapter.blocks(model)]
    real: dict = {}

    def keep(layer):
        def hook(module, args, out):
            seen[layer][0].append(args[0][real["mask"]])
            seen[layer][1].append(out[real["mask"]])
        return hook

    handles = [adapter.out_proj(block).register_forward_hook(keep(layer))
               for layer, block in enumerate(adapter.blocks(model))]
    for batch in batches:
        real["mask"] = batch["attention_mask"].bool()
        model(**batch)
    for handle in handles:
        handle.remove()
    return seen


def test_each_layer_keeps_its_mean_output_over_the_calibration_set():
    """On the dense model's contexts (the inputs the means were taken on), every compensated layer's
    output projection, gated by the mask, gives the dense layer's mean output over the
    calibration tokens; without compensation it does not."""
    model, mask, dense = llama_pruned()
    batches = calibration()
    report = compensate(model, mask, dense, batches)
    assert [layer["removed"] for layer in report["layers"]] == [[2, 3]] * 3
    assert all(layer["bias_norm"] > 0 for layer in report["layers"])
    adapter = get_adapter(model)
    for layer, (contexts, outputs) in enumerate(out_proj_io(dense, batches)):
        o = adapter.out_proj(adapter.blocks(model)[layer])
        with torch.no_grad():
            compensated = o(torch.cat(contexts)).mean(0)  # the HeadMask hook zeroes heads 2, 3
            uncompensated = compensated - o.bias
        dense_mean = torch.cat(outputs).mean(0)
        torch.testing.assert_close(compensated, dense_mean, atol=1e-5, rtol=0)
        assert float((uncompensated - dense_mean).abs().max()) > 1e-3


@torch.no_grad()
def held_out_error(model, dense, batches: list[dict]) -> float:
    return sum(float((model(**b).logits - dense(**b).logits).pow(2).sum()) for b in batches)


def test_held_out_reconstruction_improves_and_the_checkpoint_is_plain_transformers(tmp_path):
    model, mask, dense = llama_pruned()
    held_out = calibration(3, seed=100)
    before = held_out_error(model, dense, held_out)
    compensate(model, mask, dense, calibration())
    after = held_out_error(model, dense, held_out)
    assert after < before, (before, after)
    batch = inputs(seed=9)
    with torch.no_grad():
        evaluated = model(**batch).logits
    fold(model, mask)
    saved = save_pruned(model, tmp_path / "export")
    assert saved.plain_hf
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert loaded.config.attention_bias and loaded.config.num_key_value_heads == 1
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, evaluated, atol=1e-5, rtol=0)
    for layer in loaded.model.layers:
        attn = layer.self_attn
        assert all(not p.bias.detach().any() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        assert attn.o_proj.bias.detach().any()


def test_it_is_a_recovery_of_the_pruner_and_refuses_what_cannot_hold_a_bias():
    assert RECOVERIES["bias_compensation"] is BiasCompensation and BiasCompensation.needs_dense
    model = tiny("llama")
    mask = HeadMask.for_model(model)
    loader = [inputs(batch=4, tokens=12, seed=s) for s in range(2)]
    report = prune_to_budget(model, loader, {"kind": "kv", "target": 0.5, "batch": 1, "seq": 16}, mask=mask,
                             recovery="bias_compensation", layer_policy=GlobalPolicy(min_heads_per_layer=0),
                             eval_loader=[inputs(seed=7)])
    record = report["round"]
    assert len(record["bias_compensation"]["layers"]) == 3 and record["val"] == record["val_after_recovery"]
    with pytest.raises(ValueError, match="recovery=bias_compensation fits .*model_type='qwen2'.*allowed: "):
        BiasCompensation().check_model(tiny("qwen2"))
    with pytest.raises(ValueError, match="a resumed run no longer has"):
        BiasCompensation().resume(None)


def test_the_config_group_composes(tmp_path, data_dir):
    from headprune.runs.components import build
    from headprune.apps.config_schema import register_schemas
    from tests.helpers import compose_train

    register_schemas()
    assert isinstance(build(compose_train(tmp_path, data_dir, "recovery=bias_compensation").recovery), BiasCompensation)
    least_squares = build(compose_train(tmp_path, data_dir, "recovery=least_squares", "recovery.bias=false").recovery)
    assert least_squares.bias is False and least_squares.damp == 0.01
    with pytest.raises(Exception, match="bias"):  # typed schema: a misspelt option fails at compose
        compose_train(tmp_path, data_dir, "recovery=bias_compensation", "recovery.bias=true")
