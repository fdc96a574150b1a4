"""recovery/out_bias.py: whether a model can carry an attention output-projection bias is asked once
per run, before any work (the recovery's check_model), and every round then trusts it."""
import pytest

from headprune import prune_to_budget
from headprune.heads.mask import HeadMask
from headprune.recovery import out_bias
from headprune.selection.layer_policies import GlobalPolicy
from tests.helpers import inputs, tiny

BUDGET = {"kind": "heads", "target": 0.5}


def _count_calls(monkeypatch) -> list:
    calls = []
    real = out_bias.bias_refusal

    def counted(model, who):
        calls.append(who)
        return real(model, who)

    for module in ("out_bias", "least_squares", "bias_compensation", "refit"):
        monkeypatch.setattr(f"headprune.recovery.{module}.bias_refusal", counted)
    return calls


@pytest.mark.parametrize("recovery", ["least_squares", "bias_compensation", "refit"])
def test_a_run_asks_once_whether_the_model_can_carry_the_bias(recovery, monkeypatch):
    """A Llama has no output bias: the first round adds one (zeros on Q/K/V), yet the refusal is
    computed once for the run, in check_model."""
    calls = _count_calls(monkeypatch)
    model = tiny("llama")
    loader = [inputs(batch=4, tokens=12, seed=s) for s in range(2)]
    report = prune_to_budget(model, loader, BUDGET, recovery=recovery, mask=HeadMask.for_model(model),
                             layer_policy=GlobalPolicy(min_heads_per_layer=1), rearrange=False)
    assert report["round"] is not None and model.config.attention_bias
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert len(calls) == 1, calls


@pytest.mark.parametrize("recovery", ["least_squares", "bias_compensation", "refit"])
def test_a_model_that_cannot_carry_it_is_refused_before_any_work(recovery, monkeypatch):
    """Qwen2's config cannot declare an output bias: prune_to_budget refuses it before scoring."""
    scored = []
    monkeypatch.setattr("headprune.selection.retraining_free.get_metric",
                        lambda name: lambda *a, **k: scored.append(name))
    model = tiny("qwen2")
    with pytest.raises(ValueError, match="model_type='qwen2'.*allowed: "):
        prune_to_budget(model, [inputs()], BUDGET, recovery=recovery, rearrange=False)
    assert scored == [] and model.model.layers[0].self_attn.o_proj.bias is None


def test_output_bias_never_adds_a_bias_the_config_cannot_declare():
    model = tiny("qwen2")
    with pytest.raises(RuntimeError, match="ask bias_refusal"):
        out_bias.output_bias(model, 0)
    assert model.model.layers[0].self_attn.o_proj.bias is None
