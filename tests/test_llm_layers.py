"""experiments/llm_kv/layers/: the committed plot is what layers_report.py makes of the committed raw
json (layers.md: tests/test_experiment_results.py), the raw json covers every layer of the model (its shape read from
experiments/llm_kv/model.json, which matches the model's config), the removals it analyses are
those of the committed llm_kv runs, and the table functions compute what they say on small
synthetic raw files (no model is loaded, except by the one real_model test)."""
import json
from pathlib import Path

import pytest

from tests.helpers import experiment_script

REPO = Path(__file__).resolve().parent.parent
LLM_KV = REPO / "experiments" / "llm_kv"
OUT = LLM_KV / "layers"


def _script(name: str):
    return experiment_script(f"llm_kv/{name}")


def _raw():
    return (json.loads((OUT / "sensitivity.json").read_text()), json.loads((OUT / "heads.json").read_text()),
            json.loads((REPO / "experiments" / "layer_sensitivity" / "profile.json").read_text()))


def _shape() -> dict:
    return json.loads((LLM_KV / "model.json").read_text())


def test_sensitivity_covers_every_layer_with_every_head_masked():
    sens, heads, _ = _raw()
    shape = _shape()
    assert sorted(map(int, sens["layers"])) == list(range(shape["layers"]))
    seqs = [f"seq{s}" for s in sens["settings"]["seqs"]]
    assert sorted(sens["dense"]) == sorted(seqs)
    for row in sens["layers"].values():
        assert row["heads_masked"] == list(range(shape["heads"]))
        assert row["kv_groups_masked"] == list(range(shape["kv_heads"]))
        assert all(seq in row for seq in seqs)
    assert sens["torch_threads"] == 1
    assert heads["group_size"] == shape["heads"] // shape["kv_heads"]
    assert [len(row) for row in heads["first_token_share"]] == [shape["heads"]] * shape["layers"]


def test_removals_are_those_of_the_committed_runs():
    layers = _script("layers")
    _, heads, _ = _raw()
    group = _shape()["heads"] // _shape()["kv_heads"]
    now = layers.removals()
    fields = ("pruned", "heads_per_layer", "metric", "metric_seed", "rearrange", "budget_target")
    assert {stem: {f: run[f] for f in fields} for stem, run in heads["removals"].items()} == \
           {stem: {f: run[f] for f in fields} for stem, run in now.items()}
    for stem, run in heads["removals"].items():  # KV budgets: whole groups, so the group-level reading holds
        if not stem.endswith(("kv67", "kv34")):
            continue
        pruned = {tuple(h) for h in run["pruned"]}
        assert all((l, group * (h // group) + k) in pruned for l, h in pruned for k in range(group))


def test_plot_is_drawn_from_raw_json(tmp_path):
    report = _script("layers_report")
    sens, _, profile = _raw()
    report.plot(sens, profile, _shape(), tmp_path / "sensitivity.png")
    assert (tmp_path / "sensitivity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.real_model
def test_model_json_is_the_models_shape(smollm2_folder):
    """model.json, which the tables read, says what SmolLM2's config says."""
    from transformers import AutoConfig

    layers = _script("layers")
    written = _shape()
    assert written["model"] == layers.MODEL == "smollm2"
    assert {k: written[k] for k in ("layers", "heads", "kv_heads")} == \
        layers.model_shape(AutoConfig.from_pretrained(smollm2_folder))


# -- the table functions on synthetic raw files: 3 layers x 4 query heads in 2 KV groups ----------------
SHAPE = {"layers": 3, "heads": 4, "kv_heads": 2}


def _sensitivity() -> dict:
    """Layers 0 and 2 of 3 measured (a partial profile: depth must still follow the model's 3 layers)."""
    return {"settings": {"seqs": [8], "tokens": [64]}, "dense": {"seq8": {"ppl": 10.0, "loss": 2.0, "windows": 8}},
            "layers": {"0": {"layer": 0, "seq8": {"ppl": 20.0, "loss": 2.5}},
                       "2": {"layer": 2, "seq8": {"ppl": 11.0, "loss": 2.125}}}}


def _profile() -> dict:
    return {"rows": [{"layer": None, "share": 0.0, "loss_change": 0.0, "acc_change": 0.0},
                     {"layer": 0, "share": 1.0, "loss_change": 0.25, "acc_change": -0.01},
                     {"layer": 1, "share": 1.0, "loss_change": 0.5, "acc_change": -0.02},
                     {"layer": 1, "share": 0.5, "loss_change": 9.0, "acc_change": -0.5}]}


def _heads() -> dict:
    share = [[0.9, 0.6, 0.1, 0.0], [0.1, 0.2, 0.55, 0.0], [0.0, 0.0, 0.0, 0.0]]
    js = [[[0.0 if i == j else 0.5 for j in range(4)] for i in range(4)] for _ in range(3)]
    js[1][0][3] = js[1][3][0] = 0.1  # layer 1: heads 0 and 3 (groups 0 and 1) near-duplicates
    return {"group_size": 2, "sink_thresholds": [0.8, 0.5], "duplicate_threshold": 0.2,
            "calibration": {"blocks": 2, "block_size": 8}, "first_token_share": share,
            "diagnostics": {"redundancy": {"js_distance": js, "near_duplicates": [{"layer": 1, "heads": [0, 3]}]}},
            "diagnostics_bos": {"special_tokens": {"share": share}},
            "removals": {}}


def test_sensitivity_rows_and_table_follow_the_models_layers():
    report = _script("layers_report")
    rows = report.sensitivity_rows(_sensitivity(), SHAPE["layers"])
    assert [(r["layer"], r["depth"], r["seq8"], r["seq8_loss_rise"]) for r in rows] == [(0, 0.0, 20.0, 0.5),
                                                                                        (2, 1.0, 11.0, 0.125)]
    text = report.sensitivity_md(_sensitivity(), _profile(), SHAPE)
    assert "Dense: perplexity 10.00 at seq 8 (64 held-out tokens, 8 windows)." in text
    assert "| 0 | 0.00 | 20.00 | +100.0% | +0.500 |" in text and "| 2 | 1.00 | 11.00 | +10.0% | +0.125 |" in text
    assert "| 0 | 0.00 | +0.2500 | -1.00 |" in text and "| 1 | 1.00 | +0.5000 | -2.00 |" in text  # share 1.0 only


def test_sink_and_duplicate_sets_and_removal_shares():
    report = _script("layers_report")
    sets = report.head_sets(_heads())
    assert sets["sinks_calib_0.8"] == {(0, 0)} and sets["sinks_calib_0.5"] == {(0, 0), (0, 1), (1, 2)}
    assert sets["sink_groups_0.5"] == {(0, 0)}  # both heads of layer 0's group 0; (1, 1) has one of two
    assert sets["sink_groups_any_0.5"] == {(0, 0), (1, 1)}
    assert sets["pairs_cross"] == [(1, 0, 3)] and sets["dup_groups"] == {(1, 0), (1, 1)}
    assert sets["cross_js"][1][0] == 0.1 and sets["cross_js"][0][0] == 0.5
    stats = report.removal_stats({(0, 0), (0, 1)}, sets, 2)  # layer 0's group 0 removed
    assert stats["removed"] == 2 and stats["sinks_calib_0.8"] == 1.0 and stats["sinks_calib_0.5"] == 2 / 3
    assert stats["sink_groups_0.5"] == 1.0 and stats["dup_heads"] == 0.0
    assert stats["sink_removed"] == pytest.approx(0.75) and stats["sink_kept"] == pytest.approx(0.095)


def test_heads_table_reads_the_group_size_and_refuses_one_that_is_not_the_models(monkeypatch):
    report = _script("layers_report")
    heads = _heads()
    heads["removals"] = {"r0": {"pruned": [[0, 0], [0, 1]]}, "r1": {"pruned": [[2, 0], [2, 1]]},
                         "fisher": {"pruned": [[0, 0], [0, 1]]}}
    monkeypatch.setattr(report, "ARMS", [("random (2 seeds)", ["r0", "r1"]), ("Fisher", ["fisher"])])
    text = report.heads_md(heads, SHAPE)
    assert ("| Fisher | 17% (2 of 12) | 100% (1 of 1) | 67% (2 of 3) | 67% (2 of 3) | 100% (1 of 1) | 50% (1 of 2) "
            "| 0% (0 of 2) | 0% (0 of 2) | 0.750 / 0.095 | 0.500 / 0.420 |") in text
    assert "| random (2 seeds) | 17% (2 of 12) | 50% | 33% |" in text  # the mean of the seeds, no counts
    assert "| share >= 0.5 | 3 | 3 | 1 | 2 |" in text and "KV group = head // 2" in text
    assert "Sink heads (share >= 0.5) per layer 0-2: 2 1 0." in text
    assert "1 of 2 groups per layer at 2 of 2 kept" in text
    with pytest.raises(ValueError, match=r"heads\.json: group_size 2 is not the model's 9 // 3"):
        report.markdown(_sensitivity(), heads, _profile(), {"layers": 3, "heads": 9, "kv_heads": 3})
