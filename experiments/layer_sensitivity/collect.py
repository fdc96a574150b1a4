"""The layer_sensitivity experiment's tables, from its committed raw files (runs.json: the sweep's
runs as `headprune-collect` read them; profile.json: layer_profile.py's one-layer masking profile).

    python experiments/layer_sensitivity/collect.py     # rewrite curves.md, results.md, profile.md

`render(folder)` is what tests/test_experiment_results.py compares with the committed files.
"""
from __future__ import annotations

from pathlib import Path

from headprune.apps.collect import curve_table, final_table
from headprune.report import read_json, script, write

HERE = Path(__file__).resolve().parent


def render(folder: Path = HERE) -> dict[str, str]:
    """curves.md and results.md (accuracy per sparsity and final, per layer policy) from runs.json;
    profile.md from profile.json."""
    runs = read_json(folder / "runs.json")
    profile = read_json(folder / "profile.json")
    return {"curves.md": curve_table(runs, ["layer_policy"]), "results.md": final_table(runs, ["layer_policy"]),
            "profile.md": script(HERE / "layer_profile.py").table(profile["rows"], profile["shares"])}


if __name__ == "__main__":
    write(HERE, render())
