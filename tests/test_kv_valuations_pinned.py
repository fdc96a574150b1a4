"""The KV unit valuations (headprune.selection.valuations) choose bit for bit the layouts, and write
the reports, that the code before the registry did (selection.kv_modes at commit 54284a7, whose
`KVModes.choose` and `Pruner.run` wrote tests/kv_valuations_pinned.json from these same calls):
measured (with and without a retrieval block), attention_mass and retrieval (metric and uniform
unit values), removal any / last, unit and layer granularity, and one whole Pruner run whose round
record, budget and final entries are compared field by field. Tiny Llama built from a config."""
import json
from pathlib import Path

import pytest
import torch

from headprune.heads.mask import HeadMask
from headprune.selection.budgets import KVBudget
from headprune.selection.kv_modes import KVModes
from headprune.selection.layer_policies import GlobalPolicy
from tests.helpers import llama

SINK, WINDOW, SEQ = 2, 6, 64
PINNED = json.loads((Path(__file__).parent / "kv_valuations_pinned.json").read_text())
CASES = {
    "measured_any_50": (dict(choice="measured"), 0.5),
    "measured_retrieval_last_50": (dict(choice="measured", retrieval_blocks=1, removal="last"), 0.5),
    "measured_any_30": (dict(choice="measured"), 0.3),
    "attention_mass_any_50": (dict(choice="attention_mass"), 0.5),
    "attention_mass_uniform_last_50": (dict(choice="attention_mass", unit_value="uniform", removal="last"), 0.5),
    "attention_mass_layer_70": (dict(choice="attention_mass", granularity="layer"), 0.7),
    "retrieval_any_50": (dict(choice="retrieval"), 0.5),
    "retrieval_uniform_last_50": (dict(choice="retrieval", unit_value="uniform", removal="last"), 0.5),
}


def _model():
    """3 layers of 4 query / 2 KV heads, hidden 32, over 64 tokens (BOS 1, EOS 2, pad 0)."""
    return llama(seed=0, attn="sdpa", vocab_size=64, max_position_embeddings=256, num_hidden_layers=3,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _loader():
    return [{"input_ids": torch.randint(3, 64, (1, SEQ), generator=torch.Generator().manual_seed(s))} for s in (1, 2)]


def _json(data):
    return json.loads(json.dumps(data, default=str))


@pytest.mark.parametrize("case", list(CASES))
def test_each_valuation_chooses_the_pinned_layout_and_report(case):
    kw, share = CASES[case]
    model = _model()
    costs = KVBudget(target=share, batch=1, seq=SEQ).mode_table(model, sink=SINK, window=WINDOW)
    scores = torch.rand(3, 4, generator=torch.Generator().manual_seed(7))
    modes = KVModes(sink=SINK, window=WINDOW, samples=None, **kw)
    layout, report = modes.choose(model, HeadMask.for_model(model), scores, _loader(), costs, share,
                                  GlobalPolicy(min_heads_per_layer=0))
    assert report["kv_modes"].pop("seconds") >= 0
    assert [list(layer) for layer in layout.modes] == PINNED["choose"][case]["modes"]
    report, pinned = _json(report), PINNED["choose"][case]["report"]
    if kw["choice"] == "measured":  # since the pin, measured records which rises it measured
        probed = report["kv_modes"].pop("measured_modes")
        assert probed == (["window"] if kw.get("removal") == "last" else ["removed", "window"])
    if kw.get("removal") == "last" and kw["choice"] == "measured":
        window_only(report, pinned)
    assert report == pinned  # every value equal, not approximately


def window_only(report: dict, pinned: dict) -> None:
    """Removal=last with every unit windowed fitting: no option removes a unit, so only the window
    rises are measured (selection.measured_values). The same layout (checked above) from the same
    window rises, full worth the window rise and windowed 0 where the pin has the removal rise and
    the removal rise less the window rise (each layer's options differ by that layer's summed
    removal rises, a constant); the removal rises absent. Those fields are checked here and then
    set to the pin's, so every other value is compared exactly."""
    got, pin = report["kv_modes"], pinned["kv_modes"]
    assert got["window_rise"] == pin["window_rise"]
    assert got["full_value"] == pin["window_rise"]
    assert all(v == 0.0 for row in got["window_value"] for v in row)
    assert got["removed_rise"] is None and got["calibration"]["removed_rise"] is None
    assert got["retrieval"]["removed_rise"] is None
    for part in ("calibration", "retrieval"):
        assert got[part]["window_rise"] == pin[part]["window_rise"]
        got[part]["removed_rise"] = pin[part]["removed_rise"]
    for key in ("full_value", "window_value", "removed_rise"):
        got[key] = pin[key]
    report["retained_value"] = pinned["retained_value"]


def test_a_pruner_run_records_the_pinned_round_budget_and_final():
    from headprune import Loaders, Pruner
    from headprune.scoring import get_metric
    from headprune.selection.schedules import OneShot

    pruner = Pruner(_model(), get_metric("magnitude"), OneShot(target_sparsity=0.5, baseline_epochs=0,
                                                               epochs_per_round=0),
                    GlobalPolicy(min_heads_per_layer=0), KVBudget(target=0.5, seq=SEQ),
                    kv_modes=KVModes("retrieval", SINK, WINDOW, samples=None, removal="last"))
    data = _json(pruner.run(Loaders(score=_loader(), val=_loader())))
    for record in data["rounds"]:
        record.pop("score_seconds"), record["budget"]["kv_modes"].pop("seconds")
    data["budget"].pop("seconds")
    pinned = PINNED["run"]
    assert list(data) == list(pinned)
    for key in pinned:
        assert data[key] == pinned[key], key
    assert list(data["rounds"][0]) == list(pinned["rounds"][0])  # the same fields in the same order
