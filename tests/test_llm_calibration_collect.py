"""experiments/llm_calibration: results.md and best.md are what collect.py makes of the committed
result files, and the README quotes both, so its tables cannot drift from the runs behind them."""
import importlib.util
import shutil
import sys
from pathlib import Path

EXP = Path(__file__).resolve().parent.parent / "experiments" / "llm_calibration"


def _collect():
    spec = importlib.util.spec_from_file_location("llm_calibration_collect", EXP / "collect.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llm_calibration_tables_match_results(tmp_path, monkeypatch):
    collect = _collect()
    shutil.copytree(EXP / "results", tmp_path / "results")
    monkeypatch.setattr(sys, "argv", ["collect.py", "--out", str(tmp_path)])
    collect.main()
    readme = (EXP / "README.md").read_text()
    for name in ("results.md", "best.md"):
        assert (tmp_path / name).read_text() == (EXP / name).read_text(), name
        assert (tmp_path / name).read_text() in readme, name
    runs = collect.load(EXP / "results")
    assert set(runs) >= {p.stem for p in (EXP / "results").glob("*.json")}  # every raw file is a table row
    for stem, res in runs.items():  # each row's calibration is the one its name says
        source = (res.get("calibration") or {"source": "corpus"})["source"]
        assert source == collect.split(stem)[2], stem
