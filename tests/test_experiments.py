"""The experiments' committed raw files hold what their READMEs claim (every arm and budget run, the
same heads where the same choice is expected) and the experiments' scripts compute what their tables
say on synthetic runs; tests/test_experiment_results.py checks every committed table against its
collect.py's rendering of those files."""
import json
from pathlib import Path

import pytest

from headprune.run_record import Evaluation
from tests.helpers import EXPERIMENTS as EXP
from tests.helpers import REPO, experiment_script


def _script(path: Path):
    return experiment_script(str(path.relative_to(EXP).with_suffix("")))


def test_iterative_vs_one_shot_runs_cover_every_target_and_arm():
    collect = experiment_script("iterative_vs_one_shot/collect")
    targets = {(r["target"], r["arm"]) for r in collect.table_rows(EXP / "iterative_vs_one_shot" / "results")}
    assert targets == {(t, arm) for t in (0.3, 0.5, 0.7, 0.9) for arm in ("iterative", "one_shot")}


def test_layer_profile_covers_the_unmasked_model_and_every_layer():
    saved = json.loads((EXP / "layer_sensitivity" / "profile.json").read_text())
    assert {r["layer"] for r in saved["rows"]} == {None, *range(6)}


def test_metric_curves_cover_every_metric_and_policy():
    for policy in ("global", "uniform"):
        runs = json.loads((EXP / "metric_curves" / policy / "runs.json").read_text())
        metrics = sorted(r["overrides"]["metric"] for r in runs)
        assert metrics == sorted(["taylor", "entropy", "lrp", "fisher", "confidence", "magnitude"] + ["random"] * 3)
        for run in runs:
            assert [round(r["sparsity"], 1) for r in run["rounds"]] == [round(0.1 * i, 1) for i in range(1, 10)]


def test_layer_sensitivity_readme_quotes_the_profile_of_the_raw_results():
    folder = EXP / "layer_sensitivity"
    runs = json.loads((folder / "runs.json").read_text())
    (sensitivity,) = [r for r in runs if r["overrides"]["layer_policy"] == "sensitivity"]
    quoted = ", ".join(f"{x:.4f}" for x in sensitivity["layer_sensitivity"]["loss_rise"])
    assert quoted in (folder / "README.md").read_text()  # the profile the README quotes is in the raw results


def test_recovery_runs_cover_every_arm_the_issue_asks_for():
    collect = experiment_script("recovery/collect")
    runs = {(r["arm"], r["target"], r["seed"]) for r in collect.load(EXP / "recovery" / "results")}
    expected = {(arm, t, 0) for arm in collect.ARMS if arm != "distill_hidden" for t in (0.7, 0.9)}
    expected |= {(arm, 0.9, s) for arm in ("iterative", "distill", "dense") for s in (1, 2)}
    expected |= {("distill_hidden", 0.9, s) for s in (0, 1)}
    assert runs == expected  # every arm the issue asks for, seeds 1 and 2 for (c), (d), (e) at 90%


def test_retraining_free_runs_cover_every_arm_and_budget():
    collect = experiment_script("retraining_free/collect")
    budgets = {(r["arm"], r["budget"]) for r in collect.rows(EXP / "retraining_free" / "results")}
    expected = {(arm, f"heads {s}") for arm in collect.ARMS for s in ("0.5", "0.6", "0.7", "0.8")}
    expected |= {(arm, f"latency {t} seq{q}") for arm in collect.ARMS for t in ("0.9", "0.8", "0.7") for q in (64, 128)}
    assert budgets == expected


def test_retraining_free_reruns_remove_the_committed_runs_heads():
    """experiments/retraining_free/rerun: the arms without tuning removed the same heads with the same
    accuracy as the committed runs (streaming_ls.md, rendered by collect.py, shows them side by side)."""
    out = EXP / "retraining_free"
    for path in (out / "rerun").glob("*.json"):
        committed = out / "results" / path.name.replace("_nobias", "")
        old, new = (json.loads(p.read_text()) for p in (committed, path))
        assert old["rounds"][0]["pruned"] == new["rounds"][0]["pruned"], path.name
        if not path.stem.startswith("fisher_ls"):
            assert old["final"]["val"]["acc"] == new["final"]["val"]["acc"], path.name


def _llm_run(pruned, ppl2048, recovery="LeastSquares", layers=2, heads=4):
    """A results.json as an experiment=llm_kv run writes it, cut to what collect.py reads."""
    ev = {"perplexity": {"seq128": {"ppl": 2 * ppl2048}, "seq2048": {"ppl": ppl2048}},
          "zero_shot": {"sst2_local": {"acc": 0.75, "n": 8, "chance": 0.5}},
          "generation": [{"prompt": "Hi?", "answer": f"ppl {ppl2048}"}]}
    return {"model": {"layers": layers, "heads": heads}, "config": {"recovery": {"_target_": recovery}, "data": {"name": "tinyshakespeare"}},
            "rounds": [{"score_seconds": 1.5, "mask_tuning": {"seconds": 2.5, "tokens": 64}}],
            "final": {"pruned": pruned, "heads_per_layer": [heads - sum(p[0] == i for p in pruned) for i in range(layers)]},
            "evaluation": {"dense": dict(ev, perplexity={"seq128": {"ppl": 20.0}, "seq2048": {"ppl": 10.0}}), "pruned": ev}}


def test_llm_kv_collect_reads_the_kv_groups_from_model_json_and_picks_the_best_arm(tmp_path):
    """collect.py on synthetic runs of a 2-layer model with 4 query heads in 2 KV groups: the KV share
    counts a group as kept while any of its heads is, the tables name the model's query heads, and
    the summary's best arm is the lowest perplexity; a run of another model is refused by name."""
    collect = _script(EXP / "llm_kv" / "collect.py")
    shape = {"layers": 2, "heads": 4, "kv_heads": 2}
    runs = {"fisher_kv67": _llm_run([[0, 0], [0, 1], [1, 2]], 12.0),  # layer 0 group 0 gone; layer 1 keeps head 3
            "taylor_kv67": _llm_run([[0, 0], [0, 2], [1, 0], [1, 2]], 15.0)}  # no whole group gone
    (tmp_path / "results").mkdir()
    for stem, res in runs.items():
        (tmp_path / "results" / f"{stem}.json").write_text(json.dumps(res))
    dense, rows, answers = collect.load(tmp_path / "results", shape)
    assert {r["run"]: r["kv_share"] for r in rows} == {"fisher_kv67": 0.75, "taylor_kv67": 1.0}
    assert answers["fisher_kv67"] == [{"prompt": "Hi?", "answer": "ppl 12.0"}]
    table = collect.table(dense, rows, shape)
    assert "### 2 of 3 KV groups kept (5 of 8 query heads)" in table
    assert "| Fisher | 0.750 | 24.00 | +20.0% | 12.00 | +20.0% | 0.750 | 2 | 2 | – |" in table
    assert "| 2 of 3 KV groups kept | none (no training) | Fisher | 0.750 | 12.00 | +20.0% | 0.750 |" in \
        collect.summary(dense, rows)
    (tmp_path / "results" / "other_kv67.json").write_text(json.dumps(_llm_run([], 9.0, layers=3)))
    with pytest.raises(ValueError, match=r"other_kv67\.json: its model has 3 layers x 4 heads, model\.json says 2 x 4"):
        collect.load(tmp_path / "results", shape)


def test_last_word_rows_removed_the_heads_of_the_committed_llm_kv_runs():
    """experiments/llm_kv/last_word: every pruned arm removed the heads its committed llm_kv result
    names (table.md, rendered by llm_kv's collect.py, is checked in tests/test_experiment_results.py)."""
    rows = experiment_script("llm_kv/last_word/table").rows()
    assert {r["model"] for r in rows} >= {"dense", "random_s0_kv67"}
    assert all(r["same_heads"] in (None, True) for r in rows) and all(r["n"] == 100 for r in rows)


def test_other_corpus_main_perplexities_are_the_committed_llm_kv_ones():
    """experiments/llm_kv/other_corpus: the main-corpus perplexities it measured equal the committed
    llm_kv ones (table.md is checked in tests/test_experiment_results.py)."""
    rows = experiment_script("llm_kv/other_corpus/table").rows()
    assert all(r["main"] == r["committed"] for r in rows) and {r["model"] for r in rows} == {"dense", "fisher_re_ls_kv67"}


def test_llm_decode_tables_are_what_table_py_prints_of_the_bench_files():
    """experiments/llm_kv/decode: each run's PyTorch decode table in the README is table.py's
    rendering of that folder's committed bench.json (never typed by hand)."""
    table = _script(EXP / "llm_kv" / "decode" / "table.py")
    readme = (EXP / "llm_kv" / "decode" / "README.md").read_text()
    for folder in ("cpu_threads1", "cpu_threads1_decode_repeat", "cpu_threads2_decode", "cpu_layouts"):
        assert table.table(str(EXP / "llm_kv" / "decode" / folder / "bench.json")) in readme, folder


def test_llm_uneven_targets_take_each_allocations_best_repair():
    """experiments/llm_uneven: a run name carries its repair (`<arm>[_refit|_refit_kl]_<budget>`),
    checked against the raw run, and targets.md judges every allocation by its best repaired row
    without training and by its refit + KL row against the KL target, each target's best in bold."""
    collect = _script(EXP / "llm_uneven" / "collect.py")
    assert collect.split("attention_drop_refit_kv34") == ("attention_drop", "refit", "kv34")
    assert collect.split("attention_drop_kv67") == ("attention_drop", "", "kv67")
    assert collect.split("measured_refit_skip_kv67") == ("measured", "refit_skip", "kv67")
    assert collect.split("measured_refit_kl_kv67") == ("measured", "refit_kl", "kv67")
    with pytest.raises(ValueError, match="not <arm>"):
        collect.row("nonsense_kv67", {})
    # a refit run's tag must say whether its refit passed over the layers without heads (before 96d106f)
    old = json.loads((EXP / "llm_uneven" / "results" / "attention_drop_refit_skip_kv67.json").read_text())
    assert collect.row("attention_drop_refit_skip_kv67", old)["repair"].startswith("refit, attention-free layers skipped")
    with pytest.raises(ValueError, match="skipped layers"):
        collect.row("attention_drop_refit_kv67", old)
    # and whether it trained: the refit_kl tag is the refit then exactly collect.KL_STEPS KL steps
    chain = json.loads((EXP / "llm_kv" / "results" / "fisher_re_refit_kl_kv67.json").read_text())
    assert collect.row("uniform_refit_kl_kv67", chain)["trained"]
    with pytest.raises(ValueError, match="trained 50 KL steps"):
        collect.row("uniform_refit_kv67", chain)
    chain["rounds"][0]["distill"]["steps"] = 20
    with pytest.raises(ValueError, match="trained 20 KL steps"):
        collect.row("uniform_refit_kl_kv67", chain)
    with pytest.raises(ValueError, match="trained None KL steps"):
        collect.row("attention_drop_refit_kl_kv67", {**old, "rounds": [{**old["rounds"][0], "refit": None}]})
    dense = Evaluation.of({"perplexity": {"seq128": {"ppl": 60.0}, "seq2048": {"ppl": 30.0}}}, "tinyshakespeare")

    def run(arm, repair, ppl, trained=False):
        return {"budget": "kv67", "arm": arm, "repair": repair, "ppl2048": ppl, "other2048": None, "trained": trained}
    rows = [run("uniform", "bias compensation", 45.0), run("uniform", "output-projection refit", 36.0),
            run("measured", "output-projection refit", 50.0), run("measured", "bias compensation", 39.0),
            run("measured", "output-projection refit, then 50 KL steps", 32.7, True),
            run("uniform", "output-projection refit, then 50 KL steps", 33.3, True)]
    lines = collect.targets(dense, rows).splitlines()[2:]
    assert len(lines) == 4
    assert "| none | <= +25% | **uniform (Fisher + rearrangement)** | output-projection refit | +20.0% | yes | -5.0 |" in lines[0]
    assert "| none | <= +25% | measured (cost curves, knapsack, greedy correction) | bias compensation | +30.0% | no | +5.0 |" in lines[1]
    assert "| 50 KL steps | <= +10% | uniform (Fisher + rearrangement) | output-projection refit, then 50 KL steps | +11.0% | no | +1.0 |" in lines[2]
    assert "| 50 KL steps | <= +10% | **measured (cost curves, knapsack, greedy correction)** | output-projection refit, then 50 KL steps | +9.0% | yes | -1.0 |" in lines[3]


def test_llm_uneven_decode_rows_are_checked_against_each_allocations_layout():
    """experiments/llm_uneven: the llama.cpp decode table takes each allocation's benched layout
    (uniform as kv67, the others as <arm>_kv67) after checking, from llama.cpp's per-layer KV bytes,
    that the bench ran that allocation's KV groups per layer; a budget none was benched at gets none."""
    collect = _script(EXP / "llm_uneven" / "collect.py")
    group = [{"run": "measured_refit_kv67", "arm": "measured", "repair": "output-projection refit",
              "kept_units_per_layer": [3, 0, 2]},
             {"run": "uniform_refit_kv67", "arm": "uniform", "repair": "output-projection refit",
              "kept_units_per_layer": [2, 2, 2]}]

    def bench_row(variant, kept, context, tokens_per_s, kind="pruned"):
        return {"variant": variant, "kind": kind, "arch": "deci", "threads": 1, "context": context, "new_tokens": 16,
                "tokens_per_s": tokens_per_s, "per_token_ratio": 1.5, "bound": 1.4, "ratio_to_bound": 1.07,
                "kv_ratio": sum(kept) / 9, "kv_exact": True, "kv_layer_bytes_per_token": [256 * k for k in kept]}
    rows = [bench_row(v, k, c, t) for c in (512, 4096) for v, k, t in
            (("dense", [3, 3, 3], 5.0), ("measured_kv67", [3, 0, 2], 7.0), ("kv67", [2, 2, 2], 7.5),
             ("measured_kv34", [1, 0, 2], 9.0))] + [bench_row("attention_probe", [1, 0, 0], 512, 20.0, "probe")]
    lines = collect.decode_table({"llamacpp": rows, "meta": {"commit": "abc"}}, group, "kv67")
    body = [line for line in lines if line.startswith("| ") and not line.startswith("| allocation")]
    assert [line.split(" | ")[0] for line in body] == ["| dense", "| uniform (Fisher + rearrangement)",
                                                        "| measured (cost curves, knapsack, greedy correction)"]
    assert "| measured (cost curves, knapsack, greedy correction) | deci | 1 | 7.0 | 7.0 | 1.50 | 1.40 | 1.07 | 0.556 | True |" in lines
    with pytest.raises(ValueError, match="no dense row"):  # a KV head's bytes are read from the dense model's
        collect.decode_table({"llamacpp": [r for r in rows if r["variant"] != "dense"]}, group, "kv67")
    wide = [{**r, "kv_layer_bytes_per_token": [2 * b for b in r["kv_layer_bytes_per_token"]]} for r in rows]
    assert collect.decode_table({"llamacpp": wide, "meta": {"commit": "abc"}}, group, "kv67") == lines  # head size 2x
    not_benched = [{**group[0], "arm": "global"}]  # no global_kv34 row in the bench
    assert collect.decode_table({"llamacpp": rows}, not_benched, "kv34") == []
    rows[1]["kv_layer_bytes_per_token"] = [768, 256, 512]  # the bench ran another layout
    with pytest.raises(ValueError, match=r"measured_kv67 keeps \[3, 1, 2\] KV heads per layer"):
        collect.decode_table({"llamacpp": rows}, group, "kv67")


def test_llm_uneven_answers_are_each_runs_beside_the_dense_models(tmp_path):
    """experiments/llm_uneven/answers.md: per prompt the dense model's answer, then each run's that
    generated; a run asked other prompts is refused by its file name."""
    collect = _script(EXP / "llm_uneven" / "collect.py")
    dense = [{"prompt": "Q1?", "answer": "a|b"}, {"prompt": "Q2?", "answer": "line\nbreak"}]

    def result(name, generation):
        (tmp_path / f"{name}.json").write_text(json.dumps({"evaluation": {"pruned": {"generation": generation}}}))
    result("measured_refit_kv67", [{"prompt": "Q1?", "answer": "m1"}, {"prompt": "Q2?", "answer": "m2"}])
    result("global_kv67", None)  # generation off: no row
    text = collect.answers(dense, tmp_path)
    assert text.splitlines()[:6] == ["### Q1?", "", "| model | answer |", "|---|---|", "| dense | a/b |",
                                     "| measured_refit_kv67 | m1 |"]
    assert "| dense | line break |" in text and "global_kv67" not in text
    result("attention_drop_refit_kv34", [{"prompt": "Q9?", "answer": "x"}])
    with pytest.raises(ValueError, match="attention_drop_refit_kv34.json: its chat prompts"):
        collect.answers(dense, tmp_path)


def test_llm_uneven_gguf_rows():
    """experiments/llm_uneven: gguf.py's sizes and llama.cpp perplexities become a row per exported
    run (a refused layout says why); a budget with no exported run gets no GGUF table."""
    collect = _script(EXP / "llm_uneven" / "collect.py")
    group = [{"run": "attention_drop_refit_kv67", "arm": "attention_drop", "repair": "output-projection refit"},
             {"run": "attention_drop_kv67", "arm": "attention_drop", "repair": "bias compensation"}]
    gguf = {"seq": 512, "windows": 8, "models": {
        "attention_drop_refit_kv67": {"arch": "deci", "pytorch_ppl": 40.0, "q8_0_ppl_cost": 0.01,
                                      "f16": {"gguf_bytes": 250_000_000, "ppl": 40.1},
                                      "q8_0": {"gguf_bytes": 140_000_000, "ppl": 40.501}},
        "attention_drop_kv67": {"refused": "layer 4 keeps no heads but ..."}}}
    lines = collect.gguf_table(gguf, group)
    assert "| attention drop (He et al. 2024) | output-projection refit | deci | 250.0 | 140.0 | 40.10 | 40.50 | +1.0% " \
           "| 40.00 |" in lines
    assert "| attention drop (He et al. 2024) | bias compensation | refused: layer 4 keeps no heads but ... |" in "\n".join(lines)
    assert collect.gguf_table({"models": {}}, group) == []


def test_llm_kv_arms_are_configs_and_collect_names_each():
    """experiments/llm_kv's arms are conf/experiment/llm_kv/arms.yaml's (run.sh lists them with
    `python -m headprune.apps.arms llm_kv`); collect.py names each (random_s0..2 as the random arm's
    seeds), and each composes as experiment=llm_kv/<arm> (tests/test_arms.py)."""
    from headprune.apps.arms import arms as arms_of

    collect = experiment_script("llm_kv/collect")
    arms = set(arms_of("llm_kv"))
    assert {collect.split_name(f"{arm}_kv67")[0] for arm in arms} == set(collect.ARMS)
    run_sh = (EXP / "llm_kv" / "run.sh").read_text()
    assert "headprune.apps.arms llm_kv" in run_sh and "experiment=llm_kv/$arm" in run_sh and "ARM[" not in run_sh


def test_llamacpp_decode_layouts_read_layers_and_kv_groups_from_the_models_config():
    """experiments/llm_kv/decode/llamacpp/exports.py: kv67 / kv34 remove the first third / two thirds
    of each layer's KV groups and drop10 all of them in its layers, for the model's layer and group
    counts; an llm_uneven layout of another depth, or drop10 past the last layer, is refused."""
    from types import SimpleNamespace

    exports = experiment_script("llm_kv/decode/llamacpp/exports")
    smollm2 = exports.layouts(SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3))
    assert smollm2["kv67"] == {layer: [0] for layer in range(30)} and smollm2["kv34"] == {l: [0, 1] for l in range(30)}
    assert smollm2["drop10"] == {layer: [0, 1, 2] for layer in exports.DROP10}
    assert all(len(groups) < 3 or layer in smollm2["drop10"] or name != "drop10" for name, layout in smollm2.items()
               for layer, groups in layout.items())
    six = exports.layouts(SimpleNamespace(num_hidden_layers=30, num_key_value_heads=6))
    assert six["kv67"][0] == [0, 1] and six["kv34"][29] == [0, 1, 2, 3] and six["drop10"][4] == list(range(6))
    with pytest.raises(ValueError, match="drop10 names layer 29; the model has layers 0..19"):
        exports.layouts(SimpleNamespace(num_hidden_layers=20, num_key_value_heads=3))


def test_every_name_an_experiment_imports_from_headprune_exists():
    """Each `from headprune... import name` of an experiment script (at module level or inside a
    function) names something the package has now: a name moved or removed by a refactor breaks the
    script only when it is rerun (peers_kvpress/run_ours.py imported heads.windows.held_bytes after
    the byte count moved to costs.kv_bytes.cache_bytes, the one counter)."""
    import ast
    import importlib

    missing = []
    for path in sorted(EXP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "headprune"):
                continue
            try:
                module = importlib.import_module(node.module)
            except ModuleNotFoundError as err:
                if err.name and err.name.split(".")[0] == "headprune":
                    missing.append(f"{path.relative_to(EXP)}:{node.lineno}: {node.module}")
                continue  # an optional third-party package this machine lacks
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{path.relative_to(EXP)}:{node.lineno}: {node.module}.{alias.name}")
    assert missing == []
