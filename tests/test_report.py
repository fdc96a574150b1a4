"""headprune.report on synthetic runs: the cells, the column-spec table, the CSV, loading and
gathering raw files, and the check that finds a committed table that is not what its raw files give."""
import json

import pytest

from headprune.report import (DASH, Column, change, column, dense_evaluation, gather, load_results, markdown, number,
                              spread, stale, text, to_csv, write)


def _run(acc, wall=None, finished=True, dense=None):
    return {"final": {"val": {"acc": acc}} if finished else {},
            "evaluation": {"dense": dense} if dense else {}}


def test_cells_format_scale_and_mark_what_is_missing():
    assert number(0.81254, ".2f", 100) == "81.25" and number(None) == DASH and number(None, missing="-") == "-"
    assert number(1234567, ",") == "1,234,567" and number(7, "d") == "7"  # an int stays an int at scale 1
    assert change(12.0, 10.0) == "+20.0%" and change(9.0, 10.0, 2) == "-10.00%" and change(None, 1.0) == DASH
    assert spread([0.5]) == "0.50" and spread([0.5, None]) == "0.50" and spread([None]) == DASH
    assert spread([0.8, 0.9], scale=100) == "85.00 ± 7.07"  # sample standard deviation
    assert spread([0.8, 0.9], scale=100, count=True) == "85.00 ± 7.07 (n=2)" and spread([0.5], count=True) == "0.50"


def test_a_table_is_its_columns_applied_to_each_row():
    rows = [{"arm": "iterative", "acc": 0.8125, "kv": 0.5, "n": 1200}, {"arm": "one_shot", "acc": None, "kv": 1.0, "n": 3}]
    columns = [text("arm"), column("final acc", "acc", scale=100, bold=True), column("KV", "kv", ".0f", 100, unit="%"),
               column("tokens", "n", ","), text("note", lambda r: r["arm"][:3], right=True)]
    assert markdown(columns, rows) == ["| arm | final acc | KV | tokens | note |", "|---|---:|---:|---:|---:|",
                                       "| iterative | **81.25** | 50% | 1,200 | ite |",
                                       "| one_shot | – | 100% | 3 | one |"]
    assert markdown([Column("x", lambda r: "y", right=False)], []) == ["| x |", "|---|"]
    with pytest.raises(KeyError):
        markdown([column("ppl", "ppl")], rows)  # a column's key every row must have


def test_csv_has_every_key_of_every_row_in_first_seen_order():
    assert to_csv([{"a": 1, "b": None}, {"c": "x", "a": 2}]) == "a,b,c\r\n1,,\r\n2,,x\r\n"


def test_load_gather_and_the_dense_model(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    for name, data in {"b": _run(0.7, dense={"ppl": 10.0}), "a": _run(0.8), "late": _run(None, finished=False)}.items():
        (runs / name).mkdir(parents=True)
        (runs / name / "results.json").write_text(json.dumps(data))
    (runs / "a" / "wall.json").write_text(json.dumps({"wall_seconds": 12}))
    (runs / "empty").mkdir()
    assert gather(runs, results, lambda d: bool(d["final"])) == ["a", "b"]  # the unfinished run is not copied
    assert load_results(results)["a"]["wall"] == {"wall_seconds": 12} and "wall" not in load_results(results)["b"]
    assert list(load_results(results, ["b", "zz", "a"])) == ["b", "a"]  # the names asked, in their order
    assert gather(runs, tmp_path / "r2", lambda d: True, names=["late", "missing"]) == ["late"]
    assert dense_evaluation(load_results(results)) == {"ppl": 10.0}
    with pytest.raises(ValueError, match="evaluation.dense=true"):
        dense_evaluation({"a": _run(0.8)})


def test_stale_names_each_rendered_file_the_committed_copy_differs_from(tmp_path):
    files = {"results.md": "| a |\n", "runs.csv": to_csv([{"a": 1}])}
    write(tmp_path, files)
    assert stale(tmp_path, files) == []
    assert (tmp_path / "runs.csv").read_bytes() == b"a\r\n1\r\n"  # written as rendered: \r\n kept
    (tmp_path / "runs.csv").write_bytes(b"a\n1\n")  # the same text with other line ends is not the same file
    assert stale(tmp_path, files) == ["runs.csv"]
    assert stale(tmp_path, {**files, "new.md": "x"}) == ["runs.csv", "new.md"]
