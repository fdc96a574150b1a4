"""headprune-collect: sweep folders -> CSV, tables and plots."""
import json
import re
import statistics

import pytest

from headprune.apps.collect import collect, main


def _run(folder, overrides, base, accs):
    rounds = [{"round": i + 1, "sparsity": 0.1 * (i + 1), "val": {"acc": a, "loss": 1 - a}, "scores": [[a, 1.0]]}
              for i, a in enumerate(accs)]
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (folder / "results.json").write_text(json.dumps({
        "baseline": {"val": {"acc": base, "loss": 1 - base}}, "rounds": rounds, "model": {},
        "final": {"sparsity": 0.1 * len(accs), "val": rounds[-1]["val"], "stop_reason": "target"}}))


def test_mean_over_seeds_merges_runs_into_one_curve(tmp_path, capsys):
    for seed, accs in enumerate([[0.80, 0.70], [0.82, 0.60], [0.84, 0.65]]):
        _run(tmp_path / "sweep" / str(seed), ["metric=random", f"metric.seed={seed}", "layer_policy=global"], 0.9, accs)
    _run(tmp_path / "sweep" / "3", ["metric=taylor", "layer_policy=global"], 0.9, [0.88])
    main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out"), "--label", "metric", "metric.seed",
          "--mean-over", "metric.seed"])
    table = (tmp_path / "out" / "curves.md").read_text().splitlines()
    assert table[0] == "| run (accuracy (%) at heads pruned) | 0% | 10% | 20% |"
    sd = 100 * statistics.stdev([0.80, 0.82, 0.84])
    assert table[2] == f"| metric=random | 90.00 ± 0.00 (n=3) | 82.00 ± {sd:.2f} (n=3) | 65.00 ± 5.00 (n=3) |"
    assert table[3] == "| metric=taylor | 90.00 | 88.00 |  |"
    assert (tmp_path / "out" / "accuracy_vs_sparsity.png").stat().st_size > 1000
    assert "metric=random" in capsys.readouterr().out
    # without --mean-over every seed is its own row
    collect([tmp_path / "sweep"], tmp_path / "out2", keys=["metric", "metric.seed"])
    assert len((tmp_path / "out2" / "curves.md").read_text().splitlines()) == 6
    assert not list((tmp_path / "out").glob(".*tmp"))
    saved = json.loads((tmp_path / "out" / "runs.json").read_text())
    assert [["scores" in r for r in run["rounds"]] for run in saved][0] == [True, False]


def test_unreadable_runs_are_skipped_and_listed(tmp_path, capsys):
    """One truncated results.json (a run killed while writing, or still running) does not stop
    the others; the skipped runs are named."""
    _run(tmp_path / "sweep" / "0", ["metric=taylor"], 0.9, [0.88])
    _run(tmp_path / "sweep" / "1", ["metric=random"], 0.9, [0.70])
    broken = tmp_path / "sweep" / "1" / "results.json"
    broken.write_text(broken.read_text()[:50])
    _run(tmp_path / "sweep" / "2", ["metric=entropy"], 0.9, [0.80])
    (tmp_path / "sweep" / "2" / "results.json").write_text("[]")
    runs = main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert "collected 1 runs" in captured.out
    assert str(broken) in captured.err and str(tmp_path / "sweep" / "2" / "results.json") in captured.err
    assert runs == 0
    assert "metric=taylor" in (tmp_path / "out" / "results.md").read_text()


def test_nothing_collected_exits_non_zero(tmp_path, capsys):
    _run(tmp_path / "sweep" / "0", ["metric=taylor"], 0.9, [0.88])
    (tmp_path / "sweep" / "0" / "results.json").write_text("{")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")])
    assert exit_.value.code not in (0, None)
    assert str(tmp_path / "sweep" / "0" / "results.json") in capsys.readouterr().err + str(exit_.value.code)


def test_null_values_render_as_a_dash(tmp_path):
    """results.json writes null for a non-finite accuracy, baseline or perplexity."""
    _run(tmp_path / "sweep" / "0", ["metric=taylor"], 0.9, [0.88, 0.80])
    path = tmp_path / "sweep" / "0" / "results.json"
    saved = json.loads(path.read_text())
    saved["baseline"]["val"]["acc"] = None
    saved["rounds"][0]["val"]["acc"] = None
    saved["final"]["val"]["acc"] = None
    path.write_text(json.dumps(saved))
    _run(tmp_path / "sweep" / "1", ["metric=random"], 0.9, [0.70])
    collect([tmp_path / "sweep"], tmp_path / "out")
    results = (tmp_path / "out" / "results.md").read_text()
    assert "| metric=taylor | – | 0.200 | – | – | target |" in results
    curves = (tmp_path / "out" / "curves.md").read_text()
    assert "| metric=taylor | – | – | 80.00 |" in curves
    lm = tmp_path / "lm" / "0"
    _run(lm, ["model=tiny_gpt2"], 0.9, [0.88])
    saved = json.loads((lm / "results.json").read_text())
    saved["baseline"]["val"] = {"loss": 3.0, "ppl": None}
    saved["rounds"][0]["val"] = {"loss": 3.0, "ppl": 20.0}
    saved["final"]["val"] = {"loss": 3.0, "ppl": None}
    (lm / "results.json").write_text(json.dumps(saved))
    collect([tmp_path / "lm"], tmp_path / "out_lm")
    assert "| model=tiny_gpt2 | – | 0.100 | – | – | target |" in (tmp_path / "out_lm" / "results.md").read_text()


def _fake_run(folder, val_before, vals):
    rounds = [{"round": i + 1, "sparsity": 0.25 * (i + 1), "val_before_finetune": v, "val": v}
              for i, v in enumerate(vals)]
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"baseline": {"val": val_before}, "rounds": rounds, "model": {},
                                                     "final": {"sparsity": 0.5, "val": vals[-1], "stop_reason": "x"}}))


def test_collect_reports_perplexity_for_lm_runs_and_accuracy_otherwise(tmp_path):
    from headprune.apps.collect import collect

    _fake_run(tmp_path / "lm" / "0", {"loss": 1.0, "ppl": 2.72}, [{"loss": 1.1, "ppl": 3.0}, {"loss": 1.2, "ppl": 3.32}])
    collect([tmp_path / "lm"], tmp_path / "out_lm")
    assert "| 2.720 | 0.500 | 3.320 | 1.221 |" in (tmp_path / "out_lm" / "results.md").read_text()
    assert "ppl_before_finetune" in (tmp_path / "out_lm" / "runs.csv").read_text()
    assert (tmp_path / "out_lm" / "perplexity_vs_sparsity.png").is_file()

    _fake_run(tmp_path / "cls" / "0", {"acc": 0.9, "loss": 0.3}, [{"acc": 0.88, "loss": 0.35}])
    collect([tmp_path / "cls"], tmp_path / "out_cls")
    assert "ppl" not in (tmp_path / "out_cls" / "runs.csv").read_text().splitlines()[0]
    assert (tmp_path / "out_cls" / "accuracy_vs_sparsity.png").is_file()


def test_encoder_and_lm_runs_collected_together_get_one_table_per_task(tmp_path):
    """An encoder's accuracy is not shown as "–" under perplexity columns (it was: the whole table
    switched to perplexity): each task has its table, under a heading, and its plot."""
    _run(tmp_path / "sweep" / "cls", ["model=minilm"], 0.9, [0.85])
    _fake_run(tmp_path / "sweep" / "lm", {"loss": 1.0, "ppl": 2.72}, [{"loss": 1.1, "ppl": 3.0}])
    collect([tmp_path / "sweep"], tmp_path / "out")
    results = (tmp_path / "out" / "results.md").read_text()
    assert results.startswith("Runs of 2 tasks: one table per task")
    cls, lm = results.split("## classification (accuracy): 1 run(s)")[1].split("## causal LM (perplexity): 1 run(s)")
    assert "| model=minilm | 90.00 | 0.100 | 85.00 | 5.00 | target |" in cls and "ppl" not in cls
    assert "| lm | 2.720 | 0.500 | 3.000 | 1.103 | x |" in lm
    curves = (tmp_path / "out" / "curves.md").read_text()
    assert "| model=minilm | 90.00 | 85.00 |" in curves and "| lm | 2.72 | 3.00 |" in curves
    assert (tmp_path / "out" / "accuracy_vs_sparsity.png").is_file()
    assert (tmp_path / "out" / "perplexity_vs_sparsity.png").is_file()


def test_an_unfinished_run_shows_as_unfinished(tmp_path):
    """A run killed after its rounds (no final results yet) is not "final sparsity 0.000" with a
    blank stop reason."""
    _run(tmp_path / "sweep" / "0", ["metric=taylor"], 0.9, [0.88, 0.80])
    path = tmp_path / "sweep" / "0" / "results.json"
    saved = json.loads(path.read_text())
    saved["final"] = {}
    path.write_text(json.dumps(saved))
    collect([tmp_path / "sweep"], tmp_path / "out")
    assert ("| metric=taylor | 90.00 | – | – | – | unfinished (killed or still running): 2 round(s) recorded, the "
            "last at sparsity 0.200 |") in (tmp_path / "out" / "results.md").read_text()


def test_a_folder_of_symlinked_run_dirs_is_collected(tmp_path, capsys):
    _run(tmp_path / "runs" / "a", ["metric=taylor"], 0.9, [0.88])
    _run(tmp_path / "runs" / "b", ["metric=random"], 0.9, [0.70])
    links = tmp_path / "picked"
    links.mkdir()
    (links / "a").symlink_to(tmp_path / "runs" / "a")
    (links / "b").symlink_to(tmp_path / "runs" / "b")
    (links / "loop").symlink_to(links)  # a cycle ends
    assert main([str(links), "--out", str(tmp_path / "out")]) == 0
    assert "collected 2 runs" in capsys.readouterr().out
    results = (tmp_path / "out" / "results.md").read_text()
    assert "metric=taylor" in results and "metric=random" in results


@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_an_out_that_is_a_file_is_refused_before_collecting(where, tmp_path, capsys):
    """--out names the folder the tables go to: an existing file there (or on its path) exits 2
    saying so, instead of a FileExistsError traceback; the file is left as it was."""
    _run(tmp_path / "sweep" / "0", ["metric=taylor"], 0.9, [0.88])
    (tmp_path / "notes.md").write_text("mine")
    out = tmp_path / "notes.md" if where == "a_file" else tmp_path / "notes.md" / "out"
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "sweep"), "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and f"{tmp_path / 'notes.md'} is a file" in err and "allowed: a folder" in err
    assert (tmp_path / "notes.md").read_text() == "mine"


def _lm_run(folder, final_ppl, base_ppl=20.0):
    _fake_run(folder, {"ppl": base_ppl, "loss": 3.0}, [{"ppl": 25.0, "loss": 3.2}, {"ppl": final_ppl, "loss": 3.3}])


def test_a_run_with_an_unreadable_value_is_skipped_and_the_rest_collected(tmp_path, capsys):
    """`final.val.ppl` = "abc": that run is skipped, named with the field, as the help promises;
    the good run is collected (issue 56)."""
    _lm_run(tmp_path / "runs" / "good", 30.0)
    bad = tmp_path / "runs" / "bad" / "results.json"
    _lm_run(bad.parent, 31.0)
    data = json.loads(bad.read_text())
    data["final"]["val"]["ppl"] = "abc"
    bad.write_text(json.dumps(data))
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "collected 1 runs" in captured.out
    assert str(bad) in captured.err and "final.val.ppl" in captured.err
    assert str(tmp_path / "runs" / "good") in (tmp_path / "out" / "runs.csv").read_text()
    assert "bad" not in (tmp_path / "out" / "runs.csv").read_text()


def test_a_nan_run_is_skipped_and_the_out_folder_is_published_whole(tmp_path, capsys):
    """Into an earlier output, with one run's results.json edited to NaN: that run is skipped
    (strict JSON has no NaN), every output file is the new collection's, and none holds a NaN."""
    _lm_run(tmp_path / "runs" / "a", 30.0)
    _lm_run(tmp_path / "runs" / "b", 31.0)
    out = tmp_path / "out"
    main([str(tmp_path / "runs"), "--out", str(out)])
    nan = tmp_path / "runs" / "b" / "results.json"
    nan.write_text(nan.read_text().replace("31.0", "NaN"))
    assert main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert "NaN" in capsys.readouterr().err
    for name in ("runs.csv", "results.md", "curves.md", "runs.json"):
        text = (out / name).read_text()
        assert not re.search(r"\bnan\b", text, re.IGNORECASE) and str(tmp_path / "runs" / "b") not in text, name
    assert len(json.loads((out / "runs.json").read_text())) == 1


def test_outputs_are_published_together_or_not_at_all(tmp_path, monkeypatch):
    """A failure while the outputs are being made (here: the plot) leaves the earlier output folder
    exactly as it was: no file of the new collection beside the old ones."""
    import headprune.apps.collect as collect_module

    _lm_run(tmp_path / "runs" / "a", 30.0)
    out = tmp_path / "out"
    main([str(tmp_path / "runs"), "--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _lm_run(tmp_path / "runs" / "b", 40.0)

    def broken_plot(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(collect_module, "plot", broken_plot)
    with pytest.raises(OSError):
        main([str(tmp_path / "runs"), "--out", str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_final_table_rows_each_run_by_label_with_its_drop_and_stop_reason(tmp_path):
    """The final table through headprune.report: left-aligned cells, the drop in points, DASH for
    a missing figure, the stop reason last."""
    from headprune.apps.collect import final_table, load_runs

    _run(tmp_path / "sweep" / "b", ["metric=taylor"], 0.9, [0.85, 0.8125])
    _run(tmp_path / "sweep" / "a", ["metric=random"], 0.9, [0.7])
    runs = load_runs([tmp_path / "sweep"])
    runs[0]["final"]["val"]["acc"] = None
    assert final_table(runs, ["metric"]).splitlines() == [
        "| run | baseline acc | final sparsity | final acc | drop (points) | stop reason |",
        "|---|---|---|---|---|---|",
        "| metric=random | 90.00 | 0.100 | – | – | target |",
        "| metric=taylor | 90.00 | 0.200 | 81.25 | 8.75 | target |"]
