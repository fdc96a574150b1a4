"""experiments/llm_kv/layers/: the committed tables and plot are what layers.py makes of the committed
raw json, the raw json covers every layer, and the removals it analyses are those of the committed
llm_kv runs (no model is loaded)."""
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLM_KV = REPO / "experiments" / "llm_kv"
OUT = LLM_KV / "layers"


def _layers():
    spec = importlib.util.spec_from_file_location("llm_kv_layers", LLM_KV / "layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _raw():
    return (json.loads((OUT / "sensitivity.json").read_text()), json.loads((OUT / "heads.json").read_text()),
            json.loads((REPO / "experiments" / "layer_sensitivity" / "profile.json").read_text()))


def test_layers_markdown_matches_raw_json():
    layers = _layers()
    sens, heads, profile = _raw()
    assert layers.markdown(sens, heads, profile) == (OUT / "layers.md").read_text()


def test_sensitivity_covers_every_layer_with_every_head_masked():
    sens, _, _ = _raw()
    assert sorted(map(int, sens["layers"])) == list(range(30))
    seqs = [f"seq{s}" for s in sens["settings"]["seqs"]]
    assert sorted(sens["dense"]) == sorted(seqs)
    for row in sens["layers"].values():
        assert row["heads_masked"] == list(range(9)) and row["kv_groups_masked"] == [0, 1, 2]
        assert all(seq in row for seq in seqs)
    assert sens["torch_threads"] == 1


def test_removals_are_those_of_the_committed_runs():
    layers = _layers()
    _, heads, _ = _raw()
    now = layers.removals()
    fields = ("pruned", "heads_per_layer", "metric", "metric_seed", "rearrange", "budget_target")
    assert {stem: {f: run[f] for f in fields} for stem, run in heads["removals"].items()} == \
           {stem: {f: run[f] for f in fields} for stem, run in now.items()}
    for stem, run in heads["removals"].items():  # KV budgets: whole groups, so the group-level reading holds
        if not stem.endswith(("kv67", "kv34")):
            continue
        pruned = {tuple(h) for h in run["pruned"]}
        assert all((l, 3 * (h // 3) + k) in pruned for l, h in pruned for k in range(3))


def test_plot_is_drawn_from_raw_json(tmp_path):
    layers = _layers()
    sens, _, profile = _raw()
    layers.plot(sens, profile, tmp_path / "sensitivity.png")
    assert (tmp_path / "sensitivity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
