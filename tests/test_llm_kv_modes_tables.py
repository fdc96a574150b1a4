"""experiments/llm_kv_modes: the committed results.md is what collect.py renders of the committed
raw files (results/<arm>.json), so the table cannot drift from the runs behind it."""
import importlib.util
from pathlib import Path

EXP = Path(__file__).resolve().parent.parent / "experiments" / "llm_kv_modes"


def test_llm_kv_modes_table_matches_results():
    spec = importlib.util.spec_from_file_location("llm_kv_modes_collect", EXP / "collect.py")
    collect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(collect)
    rendered = collect.render(EXP)
    assert set(rendered) == {"results.md"}
    for name, text in rendered.items():
        assert (EXP / name).read_text() == text, name
