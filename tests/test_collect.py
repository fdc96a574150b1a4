"""headprune-collect: sweep folders -> CSV, tables and plots."""
import json
import statistics

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
