"""costs/latency.py's cache: a bad cache file is named and measured again, never used as is."""
import json

import pytest

from headprune.costs.latency import latency_table
from tests.helpers import tiny_bert


def _bad(saved: dict, kind: str) -> str:
    """The text of a cache file broken in the way `kind` says, from a good one `saved`."""
    if kind == "truncated":
        return json.dumps(saved)[:40]
    if kind == "empty_list":
        return "[]"
    if kind == "string":
        return json.dumps("a table")
    broken = json.loads(json.dumps(saved))
    if kind == "missing_count":
        del broken["layer_ms"]["4"]
    elif kind == "negative":
        broken["layer_ms"]["2"] = -1.0
    elif kind == "non_numeric":
        broken["layer_ms"]["2"] = "fast"
    elif kind == "no_forward":
        del broken["forward_ms"]
    elif kind == "layer_ms_list":
        broken["layer_ms"] = [1, 2]
    return json.dumps(broken)


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory):
    """(model, cache file name, its text): one measured table that every case breaks in its own way."""
    model, folder = tiny_bert(), tmp_path_factory.mktemp("latency")
    first = latency_table(model, batch=2, seq=8, cache_dir=folder, warmup=0, repeats=1)
    assert not first["cached"]
    name = first["path"].rsplit("/", 1)[-1]
    return model, name, (folder / name).read_text()


@pytest.mark.parametrize("kind", ["truncated", "empty_list", "string", "missing_count", "negative", "non_numeric",
                                  "no_forward", "layer_ms_list"])
def test_a_bad_cache_file_is_named_and_measured_again(kind, good_cache, tmp_path, caplog):
    model, name, text = good_cache
    path = tmp_path / name
    path.write_text(_bad(json.loads(text), kind))
    with caplog.at_level("WARNING"):
        again = latency_table(model, batch=2, seq=8, cache_dir=tmp_path, warmup=0, repeats=1)
    assert not again["cached"] and set(again["layer_ms"]) == {0, 1, 2, 3, 4}
    assert all(v >= 0 for v in again["layer_ms"].values()) and again["forward_ms"] > 0
    assert any(str(path) in r.getMessage() and "measuring again" in r.getMessage() for r in caplog.records)
    assert latency_table(model, batch=2, seq=8, cache_dir=tmp_path, warmup=0, repeats=1)["cached"]  # rewritten
