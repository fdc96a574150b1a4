"""experiments/llm_calibration: every committed raw file is a row of its tables, and each row's
calibration is the one its run name says (tests/test_experiment_results.py checks results.md and
best.md against collect.py's rendering of those files, and the README's quotes)."""
from tests.helpers import EXPERIMENTS, experiment_script

EXP = EXPERIMENTS / "llm_calibration"


def test_every_raw_file_is_a_row_calibrated_as_its_name_says():
    collect = experiment_script("llm_calibration/collect")
    runs = collect.load(EXP / "results")
    assert set(runs) >= {p.stem for p in (EXP / "results").glob("*.json")}  # every raw file is a table row
    for stem, res in runs.items():  # each row's calibration is the one its name says
        source = (res.get("calibration") or {"source": "corpus"})["source"]
        assert source == collect.split(stem)[2], stem
