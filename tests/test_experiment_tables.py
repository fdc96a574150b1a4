"""The experiments' table scripts on small synthetic result files: what each row says follows from
the runs given (tests/test_experiment_results.py checks the committed tables are what these scripts
make of the committed results; these check the scripts compute what their tables claim)."""
import json
from pathlib import Path

from tests.helpers import EXPERIMENTS as EXP
from tests.helpers import experiment_script


def _script(path: Path):
    return experiment_script(str(path.relative_to(EXP).with_suffix("")))


def _round(n, pruned_total, before, after, heads):
    return {"round": n, "n_pruned": pruned_total, "sparsity": pruned_total / 72, "heads_per_layer": heads,
            "val_before_finetune": {"acc": before}, "val": {"acc": after}, "train_samples_per_s": 100.0 + n,
            "score_seconds": 1.25 * n}


def test_quickstart_rounds_table_counts_heads_and_finds_the_largest_drop():
    table = _script(EXP / "quickstart" / "table.py")
    res = {"baseline": {"val": {"acc": 0.9}, "train_samples_per_s": 80.0},
           "rounds": [_round(1, 7, 0.85, 0.89, [11, 11, 12, 12, 12, 7]),
                      _round(2, 7, 0.70, 0.88, [10, 10, 11, 11, 12, 4])]}
    text = table.table(res)
    assert "| baseline (2 epochs) | 0 | 0.000 | 12 12 12 12 12 12 | – | 90.00 | 80.0 | – |" in text
    assert "| 1 | 7 | 0.097 | 11 11 12 12 12 7 | 85.00 | 89.00 | 101.0 | 1.2 |" in text
    assert "| 2 | 14 | 0.097 | 10 10 11 11 12 4 | 70.00 | 88.00 | 102.0 | 2.5 |" in text  # heads pruned: cumulative
    rnd, points = table.largest_drop(res)  # round 2: from round 1's 0.89 to 0.70, not from the baseline
    assert rnd == 2 and abs(points - 19.0) < 1e-9


def _run(target_acc, rounds, baseline_epochs=2, per_round=1, recover=0, heads=(6, 6)):
    return {"config": {"schedule": {"baseline_epochs": baseline_epochs, "epochs_per_round": per_round,
                                    "recover_epochs": recover}},
            "baseline": {"val": {"acc": 0.8}},
            "rounds": [{"val_before_finetune": {"acc": a}} for a in rounds],
            "final": {"heads_per_layer": list(heads), "val": {"acc": target_acc}}}


def test_iterative_vs_one_shot_rows_and_table(tmp_path):
    collect = _script(EXP / "iterative_vs_one_shot" / "collect.py")
    results = tmp_path / "results"
    results.mkdir()
    runs = {"iterative_0.5": _run(0.82, [0.79, 0.7, 0.75]), "one_shot_0.5": _run(0.78, [0.6], per_round=2, recover=1),
            "dense_7_epochs": _run(0.85, [], baseline_epochs=7, heads=(12, 12)), "notes_x": _run(0.1, [0.1])}
    for stem, res in runs.items():
        (results / f"{stem}.json").write_text(json.dumps(res))
    rows = collect.table_rows(results)  # the arms only: neither the dense control nor other files
    assert [(r["arm"], r["target"], r["epochs"], r["rounds"], r["heads_kept"]) for r in rows] == \
        [("iterative", 0.5, 5, 3, 12), ("one_shot", 0.5, 5, 1, 12)]
    assert [(r["acc_worst_after_prune"], r["acc_after_last_prune"]) for r in rows] == [(0.7, 0.75), (0.6, 0.6)]
    text = collect.markdown(rows, runs["dense_7_epochs"])
    assert "| 50% | iterative | 5 | 12 (6 6) | 80.00 | 70.00 | **82.00** | +2.00 |" in text
    assert "| 50% | one_shot | 5 | 12 (6 6) | 80.00 | 60.00 | **78.00** | -2.00 |" in text
    assert "| 0% | dense control | 7 | 72 | – | – | **85.00** | – |" in text


def _llm_run(ppl: dict, kept: list[float], steps: list[int], dense: dict | None = None) -> dict:
    def block(values):
        return {"perplexity": {s: {"ppl": values[("ts", s)]} for s in ("seq128", "seq2048")},
                "perplexity_other": {"sst2": {s: {"ppl": values[("sst2", s)]} for s in ("seq128", "seq2048")}},
                "generation": [{"prompt": "p?", "answer": f"a{len(kept)}"}]}
    evaluation = {"pruned": block(ppl)}
    if dense:
        evaluation["dense"] = block(dense)
    return {"config": {"data": {"name": "tinyshakespeare"}}, "rounds": [{"budget": {"predicted_share": k}, "distill": {"steps": n, "tokens": 1024 * n}}
                       for k, n in zip(kept, steps)],
            "evaluation": evaluation, "stages": {"train_and_prune": 100.0}, "wall": {"wall_seconds": 120.5}}


def test_llm_iterative_rows_compare_each_arm_with_the_dense_model_of_the_same_runs():
    collect = _script(EXP / "llm_iterative" / "collect.py")
    dense = {("ts", "seq2048"): 20.0, ("sst2", "seq2048"): 50.0, ("ts", "seq128"): 40.0, ("sst2", "seq128"): 100.0}
    pruned = {key: value * 1.5 for key, value in dense.items()}
    runs = {"attention_drop_one_shot": _llm_run(pruned, [0.33], [150], dense),
            "attention_drop_iterative": _llm_run(dense, [0.67, 0.33], [75, 75])}
    text = "\n".join(collect.table(runs))
    assert "| dense | 1.00 | – | 20.00 | 50.00 | 40.00 | 100.00 | – | – |" in text
    assert "| attention_drop_one_shot | 0.33 | 150 (153,600) | 30.00 (+50.0%) | 75.00 (+50.0%) |" in text
    assert "| attention_drop_iterative | 0.67, 0.33 | 150 (153,600) | 20.00 (+0.0%) |" in text
    assert collect.answers(runs)[-1] == "| p? | a1 | a1 | a2 |"
    speed = collect.kl_speed(collect.kl_speed_from_log("round 1 loop_fp32_live: 4.0 s/step\n"
                                                       "round 1 fit_bf16_live: 2.0 s/step\n"
                                                       "round 2 loop_fp32_live: 6.0 s/step\n"
                                                       "round 2 fit_bf16_live: 2.0 s/step\nnoise"))
    assert speed[2:] == ["| loop_fp32_live | 5.00 | 1.00x |", "| fit_bf16_live | 2.00 | 2.50x |"]


def test_llm_kv_modes_clamped_layout_is_what_the_committed_rises_give(smollm2_folder):
    """results/measured_retrieval_clamped{,_last,_85,_85_last}_layout.json (the layouts the
    measured_retrieval_clamped arms evaluated: kv_modes.removal any and last at 2/3 and at 85% removed)
    are what clamped_layout.py derives from the committed rises of measured_retrieval and measured,
    with the library's retrieval mix and knapsack: 35 retrieval removal rises below 0."""
    script = experiment_script("llm_kv_modes/clamped_layout")
    counts = {"measured_retrieval_clamped": {"full": 23, "window": 60, "removed": 7},
              "measured_retrieval_clamped_last": {"full": 22, "window": 68, "removed": 0},
              "measured_retrieval_clamped_85": {"full": 8, "window": 44, "removed": 38},
              "measured_retrieval_clamped_85_last": {"full": 2, "window": 88, "removed": 0}}
    assert set(script.OUT) == set(counts)
    for arm, (removal, target) in script.OUT.items():
        committed = json.loads(script.layout_path(arm).read_text())
        assert json.loads(json.dumps(script.derive(smollm2_folder, removal, target))) == committed
        assert committed["retrieval"]["negative_removal_rises"] == 35 and committed["modes_count"] == counts[arm]
        assert committed["target"] == (0.34 if target is None else target)


def test_llm_kv_modes_preset_measured_what_clamped_layout_derived():
    """The README's claim: kv_modes=measured_retrieval measured end to end (measured_retrieval_last) chose
    exactly the layout clamped_layout.py derived from older runs' rises (measured_retrieval_clamped_last),
    its rises within 1e-4 of the derived ones."""
    results = EXP / "llm_kv_modes/results"
    run = json.loads((results / "measured_retrieval_last.json").read_text())
    derived = json.loads((results / "measured_retrieval_clamped_last_layout.json").read_text())
    assert run["final"]["kv_layout"]["modes"] == derived["final"]["kv_layout"]["modes"]
    measured = run["rounds"][0]["budget"]["kv_modes"]["retrieval"]
    for kind in ("removed_rise", "window_rise"):
        pairs = [(a, b) for xs, ys in zip(measured[kind], derived["retrieval"][kind]) for a, b in zip(xs, ys)]
        assert len(pairs) == 90 and max(abs(a - b) for a, b in pairs) < 1e-4, kind


def test_llm_kv_modes_arms_without_removed_units_or_training_answer_as_dense():
    """What answers.md says: the chat prompts and answers fit inside sink + window, so an arm that
    removes no unit and trains nothing answers exactly as the dense model (a windowed cache that
    dropped a token it should keep, or a mask that hid one, would change an answer)."""
    results = EXP / "llm_kv_modes/results"
    dense = json.loads((results / "dense.json").read_text())["evaluation"]["dense"]["generation"]
    checked = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        layout, pruned = data["final"].get("kv_layout"), data.get("evaluation", {}).get("pruned")
        if pruned is None or layout is None or data["rounds"][0].get("distill"):
            continue
        if any(mode == "removed" for layer in layout["modes"] for mode in layer):
            continue
        assert pruned["generation"] == dense, path.name
        checked.append(path.stem)
    assert len(checked) >= 10, checked
