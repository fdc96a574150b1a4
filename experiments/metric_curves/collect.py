"""The metric_curves experiment's tables, from its committed raw files (<policy>/runs.json: the
sweep's runs as `headprune-collect` read them, run.sh).

    python experiments/metric_curves/collect.py     # rewrite global/ and uniform/ curves.md, results.md

`render(folder)` is what tests/test_experiment_results.py compares with the committed files.
"""
from __future__ import annotations

from pathlib import Path

from headprune.apps.collect import curve_table, final_table
from headprune.report import read_json, write

HERE = Path(__file__).resolve().parent
POLICIES = ("global", "uniform")
KEYS = ["metric", "metric.seed"]  # a run's label; the random metric's seeds are averaged


def render(folder: Path = HERE) -> dict[str, str]:
    """<policy>/curves.md (accuracy per sparsity, mean over the random seeds) and <policy>/results.md."""
    files = {}
    for policy in POLICIES:
        runs = read_json(folder / policy / "runs.json")
        files[f"{policy}/curves.md"] = curve_table(runs, KEYS, mean_over=["metric.seed"])
        files[f"{policy}/results.md"] = final_table(runs, KEYS)
    return files


if __name__ == "__main__":
    write(HERE, render())
