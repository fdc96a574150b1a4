"""The quickstart's tables, from its committed raw files: rounds.md (table.py, from results.json)
and physical_timing.md (physical_timing.py, from physical_timing.json).

    python experiments/quickstart/collect.py     # rewrite rounds.md and physical_timing.md

`render(folder)` is what tests/test_experiment_results.py compares with the committed files.
"""
from __future__ import annotations

from pathlib import Path

from headprune.report import read_json, script, write

HERE = Path(__file__).resolve().parent


def render(folder: Path = HERE) -> dict[str, str]:
    return {"rounds.md": script(HERE / "table.py").table(read_json(folder / "results.json")),
            "physical_timing.md": script(HERE / "physical_timing.py").table(read_json(folder / "physical_timing.json"))}


if __name__ == "__main__":
    write(HERE, render())
