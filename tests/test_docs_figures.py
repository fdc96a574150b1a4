"""Figures the docs quote, read again from the committed raw files they come from: a stale figure
fails here (the guide said twice `measured`'s choice time for `measured_retrieval` while its raw
files said 1.4x)."""
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "llm_kv_modes" / "results"
# where the ratio is quoted: the guide, the preset's header, the arms file (and its generated page)
QUOTED = ["docs/guide_kv_modes.md", "conf/kv_modes/measured_retrieval.yaml", "conf/experiment/llm_kv_modes/arms.yaml",
          "docs/arms/llm_kv_modes.md"]


def choice_seconds(arm: str) -> float:
    """The seconds the KV-mode choice took in an arm's committed run (rounds[0].budget.kv_modes.seconds)."""
    return json.loads((RESULTS / f"{arm}.json").read_text())["rounds"][0]["budget"]["kv_modes"]["seconds"]


def test_measured_retrieval_choice_time_against_measured_is_quoted_from_the_raw_files():
    """kv_modes=measured_retrieval measured end to end (arm measured_retrieval_last) against kv_modes=measured,
    both on 2 CPU threads (an arm on a GPU would not compare)."""
    for arm in ("measured_retrieval_last", "measured"):
        raw = json.loads((RESULTS / f"{arm}.json").read_text())
        assert raw["runtime"]["device"] == "cpu" and raw["wall"]["threads"] == 2, arm
    slow, base = choice_seconds("measured_retrieval_last"), choice_seconds("measured")
    ratio = f"{slow / base:.1f}x"
    assert ratio == "1.4x"
    for path in QUOTED:
        text = " ".join((REPO / path).read_text().split())
        assert f"{ratio} `measured`'s choice time" in text or f"{ratio} measured's choice time" in text \
            or f"{ratio} kv_modes=measured's choice time" in text, path
        assert "twice measured" not in text and "twice `measured`" not in text and "twice kv_modes=measured" not in text, path
    guide = " ".join((REPO / "docs/guide_kv_modes.md").read_text().split())
    assert f"{slow:,.0f} s, {slow / 60:.0f} minutes, against {base:,.0f} s" in guide
