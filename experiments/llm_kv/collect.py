"""The llm_kv experiment's tables, from the runs' results.json.

    python experiments/llm_kv/collect.py --runs experiments/llm_kv/runs --out experiments/llm_kv

Copies each finished run (`<runs>/<arm>_<budget>/results.json`, with `wall.json`'s wall time and
threads added) to `<out>/results/<arm>_<budget>.json`; the tables are then built from
`<out>/results/*.json` alone: `results.md` (per budget and arm: KV cache kept, perplexity at seq
128 and 2048 and their change from dense, SST-2 zero-shot accuracy, seconds per stage; the three
random seeds as mean and spread beside every arm), `summary.md` (the README's table: the best
arm per budget without and with training), `answers.md` (the greedy chat answers, dense and each
arm side by side), `llm_kv.csv` (one row per run) and `results.png` (perplexity per arm).
The model's layers, query heads and KV heads come from `model.json` (written from the model's
config by `python experiments/llm_kv/layers.py shape`), each run's `model` record checked against it.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from headprune.report import DASH, cell_text, change, column, gather as gather_runs, markdown, number, read_json, script
from headprune.report import text, to_csv, write
from headprune.run_record import Evaluation, read_record, record

ARMS = {"random": "random scores", "magnitude": "weight magnitude", "taylor": "Taylor",
        "fisher": "Fisher", "fisher_re": "Fisher + rearrangement",
        "fisher_re_ls": "Fisher + rearrangement + least squares (scales, bias)",
        "fisher_re_bias": "Fisher + rearrangement + bias compensation",
        "fisher_re_refit": "Fisher + rearrangement + refit of O (residual target)",
        "fisher_re_refit_att": "Fisher + rearrangement + refit of O (attention target)",
        "refit_rank_refit": "refit-error ranking (KV groups) + refit of O",
        "refit_rank_head_refit": "refit-error ranking (heads) + refit of O",
        "fisher_lora": "Fisher + LoRA",
        "fisher_re_lora": "Fisher + rearrangement + LoRA",
        "fisher_re_lora_kd": "Fisher + rearrangement + LoRA on the KL to dense",
        "fisher_re_distill": "Fisher + rearrangement + KL to dense, every weight",
        "fisher_re_refit_kl": "Fisher + rearrangement + refit of O, then KL to dense, every weight",
        "lora_only": "LoRA alone (nothing pruned)"}
BUDGETS = {"kv67": "2 of 3 KV groups kept", "kv34": "1 of 3 KV groups kept",
           "q50": "half of the query heads kept, placed globally",
           "dense": "nothing pruned: the LoRA steps alone"}
HERE = Path(__file__).resolve().parent
TUNING = ("mask_tuning", "bias_compensation", "refit", "lora", "distill")  # a round's recovery report


def gather(runs: Path, out: Path) -> list[str]:
    """Copy each finished run (its export written and evaluated) to `out`/results, with wall.json."""
    return gather_runs(runs, out / "results",
                       lambda res: "export_dir" in res["final"] and "pruned" in res.get("evaluation", {}))


def split_name(stem: str) -> tuple[str, str, int | None]:
    """(arm, budget tag, random seed or None): random_s1_kv67 -> (random, kv67, 1)."""
    arm, budget = stem.rsplit("_", 1)
    if arm.startswith("random_s"):
        return "random", budget, int(arm.removeprefix("random_s"))
    return arm, budget, None


def row(stem: str, res: dict, shape: dict) -> dict:
    arm, budget, seed = split_name(stem)
    (r,) = res["rounds"]
    ev = record(res, stem).evaluation["pruned"]
    zs = ev.get("zero_shot", {}).get("sst2_local", {})
    tuning = recovery_report(r)
    stages = {"score": r["score_seconds"], "rearrange": (r.get("rearranged") or {}).get("seconds"),
              "tuning": tuning.get("seconds")}
    return {"run": stem, "budget": budget, "arm": arm, "seed": seed,
            "kv_share": kv_share(res, shape), "heads_kept": sum(res["final"]["heads_per_layer"]),
            "train_tokens": tuning.get("tokens"),
            "ppl128": ev.ppl(128), "ppl2048": ev.ppl(2048),
            "sst2_acc": zs.get("acc"), "sst2_n": zs.get("n"), "wall_seconds": (res.get("wall") or {}).get("wall_seconds"),
            **{f"{k}_seconds": v for k, v in stages.items()}}


def recovery_report(r: dict) -> dict:
    """A round's recovery report: its one recovery's entry, or for a chain (`recovery=chain`, the
    round's `chain`: the stage names) the stages' seconds and training tokens added up (the refit's
    `tokens` are its calibration tokens, fit / held out, and do not count)."""
    if "chain" in r:
        parts = [r[name] for name in r["chain"] if name in r]
        tokens = [p["tokens"] for p in parts if isinstance(p.get("tokens"), int)]  # training tokens (the refit's: a dict)
        return {"seconds": sum(p["seconds"] for p in parts), "tokens": sum(tokens) if tokens else None}
    return next((r[k] for k in TUNING if k in r), {})


def kv_share(res: dict, shape: dict) -> float:
    """Share of the dense KV cache the export keeps: a KV group stays while any of its query heads
    does (the export removes a group's key/value rows only with all of its heads). `shape`:
    model.json (layers, heads, kv_heads)."""
    layers, heads, groups = shape["layers"], shape["heads"], shape["kv_heads"]
    size = heads // groups  # query heads per KV group
    pruned = {tuple(h) for h in res["final"]["pruned"]}
    kept = sum(any((layer, g * size + i) not in pruned for i in range(size))
               for layer in range(layers) for g in range(groups))
    return kept / (layers * groups)


def load(results: Path, shape: dict) -> tuple[Evaluation | None, list[dict], dict]:
    """(dense evaluation, rows, answers per run) from the result files; each run's model must have
    `shape` (model.json)."""
    dense, rows, answers = None, [], {}
    for path in sorted(results.glob("*.json")):
        res = json.loads(path.read_text())
        if res["model"] != {"layers": shape["layers"], "heads": shape["heads"]}:
            raise ValueError(f"{path}: its model has {res['model']['layers']} layers x {res['model']['heads']} heads, "
                             f"model.json says {shape['layers']} x {shape['heads']}; allowed: runs of that model "
                             "(or write model.json again: python experiments/llm_kv/layers.py shape)")
        run = record(res, path.stem, str(path))
        if dense is None and "dense" in run.evaluation:
            dense = run.evaluation["dense"]
        rows.append(row(path.stem, res, shape))
        answers[path.stem] = run.evaluation["pruned"].get("generation", [])
    return dense, rows, answers


def _mean(values: list[float]) -> str:
    """The mean and, over several runs (the random seeds), " ± " their sample standard deviation."""
    spread = f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.2f}{spread}"


def _arm_row(name: str, runs: list[dict]) -> dict:
    """One arm's line: its run, or for the random arm the mean of its seeds (no seconds)."""
    acc = [r["sst2_acc"] for r in runs if r["sst2_acc"] is not None]
    seeds = len(runs) > 1 or runs[0]["arm"] == "random"
    return {"name": f"{name} (mean of {len(runs)} seed{'s' if len(runs) > 1 else ''})" if seeds else name,
            "kv_share": statistics.mean(r["kv_share"] for r in runs), "ppl128": [r["ppl128"] for r in runs],
            "ppl2048": [r["ppl2048"] for r in runs], "sst2_acc": statistics.mean(acc) if acc else None,
            **{k: None if seeds else runs[0][k] for k in ("score_seconds", "tuning_seconds", "wall_seconds")}}


def table(dense: Evaluation, rows: list[dict], shape: dict) -> str:
    d128, d2048 = dense.ppl(128), dense.ppl(2048)
    dz = dense.get("zero_shot", {}).get("sst2_local", {})
    lines = [f"Dense: perplexity {d128:.2f} (seq 128), {d2048:.2f} (seq 2048); SST-2 zero-shot "
             f"{number(dz.get('acc'), '.3f')} on {dz.get('n')} sentences (chance {number(dz.get('chance'))}).", ""]
    columns = [text("arm", "name"), column("KV kept", "kv_share", ".3f"),
               text("ppl seq 128", lambda r: _mean(r["ppl128"]), right=True),
               text("change", lambda r: change(statistics.mean(r["ppl128"]), d128), right=True),
               text("ppl seq 2048", lambda r: _mean(r["ppl2048"]), right=True),
               text("change", lambda r: change(statistics.mean(r["ppl2048"]), d2048), right=True),
               column("SST-2 acc", "sst2_acc", ".3f"), column("score s", "score_seconds", ".0f"),
               column("tuning s", "tuning_seconds", ".0f"), column("wall s", "wall_seconds", ".0f")]
    for budget, title in BUDGETS.items():
        group = [r for r in rows if r["budget"] == budget]
        if not group:
            continue
        arms = [_arm_row(name, [r for r in group if r["arm"] == arm]) for arm, name in ARMS.items()
                if any(r["arm"] == arm for r in group)]
        lines += [f"### {title} ({group[0]['heads_kept']} of {shape['layers'] * shape['heads']} query heads)", "",
                  *markdown(columns, arms), ""]
    return "\n".join(lines)


TRAINED = ("fisher_lora", "fisher_re_lora", "fisher_re_lora_kd", "fisher_re_distill", "fisher_re_refit_kl", "lora_only")


def summary(dense: Evaluation, rows: list[dict]) -> str:
    """The README's table: per budget, the best arm without training and the best with it."""
    d2048 = dense.ppl(2048)
    best = [{"budget": "all (dense)", "recovery": DASH, "arm": DASH, "kv_share": 1.0, "ppl2048": d2048, "change": DASH,
             "sst2_acc": dense.get("zero_shot", {}).get("sst2_local", {}).get("acc")}]
    for budget, title in BUDGETS.items():
        for trained, label in ((False, "none (no training)"), (True, "training")):
            group = [r for r in rows if r["budget"] == budget and r["arm"] != "random" and (r["arm"] in TRAINED) == trained]
            if group:
                r = min(group, key=lambda r: r["ppl2048"])
                best.append({**r, "budget": title, "recovery": label, "arm": ARMS[r["arm"]],
                             "change": change(r["ppl2048"], d2048)})
    return "\n".join(markdown([text("budget"), text("recovery"), text("best arm", "arm"), column("KV kept", "kv_share", ".3f"),
                               column("ppl seq 2048", "ppl2048"), text("change", right=True),
                               column("SST-2 acc", "sst2_acc", ".3f")], best))


def answers_table(dense: Evaluation, answers: dict) -> str:
    prompts = [a["prompt"] for a in dense.get("generation", [])]
    lines = []
    for i, prompt in enumerate(prompts):
        answered = [("dense", dense.get("generation")[i]["answer"])] + [(run, gen[i]["answer"]) for run, gen in answers.items()
                                                                   if i < len(gen)]
        lines += [f"### {prompt}", "", *markdown([text("model", lambda a: a[0]), text("answer", lambda a: cell_text(a[1]))],
                                                 answered), ""]
    return "\n".join(lines)


RECOVERED = ("fisher_re", "fisher_re_ls", "fisher_re_bias", "fisher_re_refit", "fisher_re_refit_att",
             "refit_rank_refit", "refit_rank_head_refit", "fisher_re_distill", "fisher_re_refit_kl")


def recoveries(results: Path, stopped: Path) -> str:
    """Per budget, each arm without training and the two full-weight KL arms (alone and after the
    refit): the validation perplexity (seq 512, the 16 held-out blocks) before and right after its
    recovery (a chain: after each stage, `val_after_<stage>`), the recovery's and the scoring's seconds, and for
    the refit the mean over layers of its relative calibration error before / after and of the
    held-out error at the chosen damp, and the damps chosen; runs stopped after the round
    (`stopped`) included. Read from each result file's `rounds[0]`."""
    files = {p.stem: p for p in sorted(results.glob("*.json"))}
    files.update({p.stem: p for p in sorted(stopped.glob("*.json"))} if stopped.is_dir() else {})
    lines = []
    for budget in BUDGETS:
        for arm in RECOVERED:
            path = files.get(f"{arm}_{budget}")
            if path is None:
                continue
            res = json.loads(path.read_text())
            (r,) = res["rounds"]
            tuning = recovery_report(r)
            after = r.get("val_after_recovery") or r.get("val_after_mask_tuning") or {}
            after_text = number(after.get("ppl"))
            if "chain" in r:
                after_text = " -> ".join(f"{number((r.get(f'val_after_{name}') or {}).get('ppl'))} ({name})"
                                         for name in r["chain"])
            refit = [layer for layer in (r.get("refit") or {}).get("layers", []) if "error_after" in layer]
            errors = held = damps = "–"
            if refit:
                mean = lambda key: statistics.mean(layer[key] for layer in refit)  # noqa: E731
                errors = f"{mean('error_before'):.3f} -> {mean('error_after'):.3f}"
                held = f"{statistics.mean(layer['heldout'][str(layer['damp'])] for layer in refit):.3f}"
                chosen = [layer["damp"] for layer in refit]
                damps = ", ".join(f"{d:g} ({chosen.count(d)})" for d in sorted(set(chosen)))
            finished = "yes" if "pruned" in res.get("evaluation", {}) else "stopped after the round"
            lines.append({"budget": budget, "arm": ARMS[arm], "before": r["val_before_finetune"]["ppl"], "after": after_text,
                          "score": r["score_seconds"], "recovery": tuning.get("seconds"), "errors": errors, "held": held,
                          "damps": damps, "finished": finished})
    return "\n".join(markdown([
        text("budget"), text("arm"), column("val ppl before", "before"), text("val ppl after recovery", "after", right=True),
        column("score s", "score", ".0f"), column("recovery s", "recovery", ".0f"),
        text("refit calib error before -> after (mean over layers)", "errors"),
        text("held-out error at the chosen damp", "held", right=True), text("damps chosen (layers)", "damps"),
        text("finished")], lines))


OTHER = "sst2"  # the corpus not calibrated on (evaluation.other_corpora)
LAST_WORD = "last_word_local"


def heldout(results: Path, other_dense: Path, last_word: Path) -> str:
    """Per budget and arm, what the calibration corpus does not show: perplexity at seq 2048 on
    Tiny Shakespeare's held-out part and on SST-2's validation sentences (`perplexity_other`), each
    as a ratio to dense and the second ratio over the first (issue 30's target: at most 1.5), and
    the last-word accuracy (`last_word_local`, greedy, as lm-eval scores LAMBADA) with its standard
    error and passages. Read from each result file's `evaluation.pruned`; an arm whose run did not
    measure the last word takes it from `last_word/*.json` (measure.py, on the same heads or on the
    run's export). Dense: from a result file's `evaluation.dense` where it has the measure, else from
    `other_dense` (other_corpus/other_corpus.json, the same windows) and, for the last word, the
    dense model of a `last_word/*.json` measured on the same number of passages."""
    files = sorted(results.glob("*.json"))
    others = json.loads(other_dense.read_text())["models"] if other_dense.is_file() else {}
    measured = {}  # run name -> the last-word row measure.py wrote, and the file
    dense_words = {}  # passages -> (dense last-word row, file)
    for path in sorted(last_word.glob("*.json")) if last_word.is_dir() else []:
        for name, model in json.loads(path.read_text())["models"].items():
            row_ = model["zero_shot"][LAST_WORD]
            if name == "dense":
                dense_words.setdefault(row_["n"], (row_, path.name))
            else:
                measured.setdefault(name, (row_, path.name))
    dense, rows = None, []
    for path in files:
        run = read_record(path)
        if "dense" in run.evaluation:
            ev = run.evaluation["dense"]
            dense = dense or {}
            if ev.ppl(2048, OTHER) is not None:
                dense.setdefault("other", (ev.ppl(2048, OTHER), path.name))
            if LAST_WORD in ev.get("zero_shot", {}):
                dense_words.setdefault(ev.get("zero_shot")[LAST_WORD]["n"], (ev.get("zero_shot")[LAST_WORD], path.name))
            dense.setdefault("main", ev.ppl(2048))
        ev = run.evaluation["pruned"]
        other = ev.ppl(2048, OTHER)
        other_source = path.name
        if other is None and path.stem in others:  # other_corpus/measure.py, on the same heads
            other, other_source = others[path.stem]["perplexity_other"][OTHER]["seq2048"]["ppl"], f"other_corpus/{other_dense.name}"
        word, source = ev.get("zero_shot", {}).get(LAST_WORD), path.name
        if word is None and path.stem in measured:
            word, source = measured[path.stem][0], f"last_word/{measured[path.stem][1]}"
        if other is None and word is None:
            continue
        arm, budget, seed = split_name(path.stem)
        rows.append({"run": path.stem, "arm": arm, "budget": budget, "seed": seed, "main": ev.ppl(2048),
                     "other": other, "other_source": other_source if other is not None else "–",
                     "word": word, "word_source": source if word is not None else "–"})
    if dense is None:
        raise ValueError(f"no result file in {results} evaluated the dense model (evaluation.dense=true)")
    if "other" not in dense and "dense" in others:
        dense["other"] = (others["dense"]["perplexity_other"][OTHER]["seq2048"]["ppl"], f"other_corpus/{other_dense.name}")
    d_main, (d_other, other_file) = dense["main"], dense.get("other", (None, "–"))

    def word_cell(word):
        return DASH if word is None else f"{word['acc']:.3f} ± {word['acc_stderr']:.3f} ({word['n']})"
    cells = [{"budget": DASH, "name": "dense", "main": d_main, "main_x": 1.0, "other": d_other, "other_x": 1.0,
              "ratio": None, "word": " / ".join(word_cell(w) for n, (w, _) in sorted(dense_words.items())),
              "other_source": other_file,
              "word_source": ", ".join(f"last_word/{f}" for _, (_, f) in sorted(dense_words.items()))}]
    order = {arm: i for i, arm in enumerate(ARMS)}
    for budget in BUDGETS:
        for r in sorted((r for r in rows if r["budget"] == budget), key=lambda r: (order[r["arm"]], r["seed"] or 0)):
            main_x = r["main"] / d_main
            other_x = None if r["other"] is None or d_other is None else r["other"] / d_other
            cells.append({**r, "name": ARMS[r["arm"]] + (f" (seed {r['seed']})" if r["seed"] is not None else ""),
                          "main_x": main_x, "other_x": other_x, "ratio": None if other_x is None else other_x / main_x,
                          "word": word_cell(r["word"])})
    return "\n".join(markdown([
        text("budget"), text("arm", "name"), column("ppl seq 2048, Tiny Shakespeare", "main"), column("x dense", "main_x"),
        column("ppl seq 2048, SST-2 sentences", "other"), column("x dense", "other_x"),
        column("SST-2 ratio / Tiny Shakespeare ratio (target <= 1.5)", "ratio"),
        text("last-word acc ± stderr (passages)", "word", right=True), text("SST-2 ppl from", "other_source"),
        text("last word from", "word_source")], cells))


def render(folder: Path = HERE, model: Path = HERE / "model.json") -> dict[str, str]:
    """results.md, answers.md, llm_kv.csv, summary.md, recoveries.md and heldout.md from `folder`/results
    (and this experiment's refit_target/, other_corpus/ and last_word/ raw files), and the side
    studies' tables (subtables); the model's shape from `model` (model.json)."""
    shape = read_json(model)
    dense, rows, answers = load(folder / "results", shape)
    return {"results.md": table(dense, rows, shape) + "\n", "answers.md": answers_table(dense, answers) + "\n",
            "llm_kv.csv": to_csv(rows), "summary.md": summary(dense, rows) + "\n",
            "recoveries.md": recoveries(folder / "results", HERE / "refit_target") + "\n",
            "heldout.md": heldout(folder / "results", HERE / "other_corpus" / "other_corpus.json", HERE / "last_word") + "\n",
            **subtables(shape)}


def subtables(shape: dict) -> dict[str, str]:
    """The tables of this experiment's side studies, each rendered by its own script from its raw
    files: layers/layers.md (layers_report.py), last_word/table.md and other_corpus/table.md (table.py)."""
    layers = script(HERE / "layers_report.py")
    words, other = script(HERE / "last_word" / "table.py"), script(HERE / "other_corpus" / "table.py")
    raw = [read_json(HERE / "layers" / name) for name in ("sensitivity.json", "heads.json")]
    return {"layers/layers.md": layers.markdown(*raw, read_json(HERE.parent / "layer_sensitivity" / "profile.json"), shape),
            "last_word/table.md": words.table(words.rows()), "other_corpus/table.md": other.table(other.rows())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=None, help="the run folders (skip to rebuild from results/)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=HERE / "model.json", help="the model's shape (layers.py shape)")
    args = parser.parse_args()
    if args.runs is not None and args.runs.is_dir():
        gather(args.runs, args.out)
    write(args.out, render(args.out, args.model))
    shape = read_json(args.model)
    dense, rows, _ = load(args.out / "results", shape)
    plot(dense, rows, args.out / "results.png")


def plot(dense: Evaluation, rows: list[dict], path: Path) -> None:
    """Perplexity (seq 2048, log scale) of every arm at each budget, dense as a line."""
    from headprune.plots import close, plt

    budgets = [b for b in BUDGETS if any(r["budget"] == b for r in rows)]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4.5), squeeze=False, sharey=True)
    for ax, budget in zip(axes[0], budgets):
        arms = [a for a in ARMS if any(r["budget"] == budget and r["arm"] == a for r in rows)]
        values = [statistics.mean(r["ppl2048"] for r in rows if r["budget"] == budget and r["arm"] == a) for a in arms]
        ax.barh(range(len(arms)), values, color="tab:blue")
        ax.set_yticks(range(len(arms)), [ARMS[a] for a in arms], fontsize=7)
        ax.axvline(dense.ppl(2048), color="k", ls="--", label="dense")
        ax.set_xscale("log")
        ax.set_title(BUDGETS[budget], fontsize=9)
        ax.set_xlabel("perplexity, seq 2048 (log)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    close(fig)


if __name__ == "__main__":
    main()
