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

from headprune.apps.collect import to_csv
from headprune.atomic import write_json_atomic, write_text_atomic

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
        "lora_only": "LoRA alone (nothing pruned)"}
BUDGETS = {"kv67": "2 of 3 KV groups kept", "kv34": "1 of 3 KV groups kept",
           "q50": "half of the query heads kept, placed globally",
           "dense": "nothing pruned: the LoRA steps alone"}
HERE = Path(__file__).resolve().parent
TUNING = ("mask_tuning", "bias_compensation", "refit", "lora", "distill")  # a round's recovery report


def gather(runs: Path, out: Path) -> None:
    (out / "results").mkdir(parents=True, exist_ok=True)
    for run in sorted(p for p in runs.iterdir() if p.is_dir() and (p / "results.json").is_file()):
        res = json.loads((run / "results.json").read_text())
        if "export_dir" not in res["final"] or "pruned" not in res.get("evaluation", {}):
            continue  # unfinished
        if (run / "wall.json").is_file():
            res["wall"] = json.loads((run / "wall.json").read_text())
        write_json_atomic(out / "results" / f"{run.name}.json", res)


def split_name(stem: str) -> tuple[str, str, int | None]:
    """(arm, budget tag, random seed or None): random_s1_kv67 -> (random, kv67, 1)."""
    arm, budget = stem.rsplit("_", 1)
    if arm.startswith("random_s"):
        return "random", budget, int(arm.removeprefix("random_s"))
    return arm, budget, None


def row(stem: str, res: dict, shape: dict) -> dict:
    arm, budget, seed = split_name(stem)
    (r,) = res["rounds"]
    ev = res["evaluation"]["pruned"]
    zs = ev.get("zero_shot", {}).get("sst2_local", {})
    tuning = next((r[k] for k in TUNING if k in r), {})
    stages = {"score": r["score_seconds"], "rearrange": (r.get("rearranged") or {}).get("seconds"),
              "tuning": tuning.get("seconds")}
    return {"run": stem, "budget": budget, "arm": arm, "seed": seed,
            "kv_share": kv_share(res, shape), "heads_kept": sum(res["final"]["heads_per_layer"]),
            "train_tokens": tuning.get("tokens"),
            "ppl128": ev["perplexity"]["seq128"]["ppl"], "ppl2048": ev["perplexity"]["seq2048"]["ppl"],
            "sst2_acc": zs.get("acc"), "sst2_n": zs.get("n"), "wall_seconds": (res.get("wall") or {}).get("wall_seconds"),
            **{f"{k}_seconds": v for k, v in stages.items()}}


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


def load(results: Path, shape: dict) -> tuple[dict | None, list[dict], dict]:
    """(dense evaluation, rows, answers per run) from the result files; each run's model must have
    `shape` (model.json)."""
    dense, rows, answers = None, [], {}
    for path in sorted(results.glob("*.json")):
        res = json.loads(path.read_text())
        if res["model"] != {"layers": shape["layers"], "heads": shape["heads"]}:
            raise ValueError(f"{path}: its model has {res['model']['layers']} layers x {res['model']['heads']} heads, "
                             f"model.json says {shape['layers']} x {shape['heads']}; allowed: runs of that model "
                             "(or write model.json again: python experiments/llm_kv/layers.py shape)")
        if dense is None and "dense" in res["evaluation"]:
            dense = res["evaluation"]["dense"]
        rows.append(row(path.stem, res, shape))
        answers[path.stem] = res["evaluation"]["pruned"].get("generation", [])
    return dense, rows, answers


def _fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def _change(x, base):
    return "–" if x is None or base is None else f"{100 * (x / base - 1):+.1f}%"


def table(dense: dict, rows: list[dict], shape: dict) -> str:
    d128, d2048 = dense["perplexity"]["seq128"]["ppl"], dense["perplexity"]["seq2048"]["ppl"]
    dz = dense.get("zero_shot", {}).get("sst2_local", {})
    lines = [f"Dense: perplexity {d128:.2f} (seq 128), {d2048:.2f} (seq 2048); SST-2 zero-shot "
             f"{_fmt(dz.get('acc'), 3)} on {dz.get('n')} sentences (chance {_fmt(dz.get('chance'), 2)}).", ""]
    for budget, title in BUDGETS.items():
        group = [r for r in rows if r["budget"] == budget]
        if not group:
            continue
        lines += [f"### {title} ({group[0]['heads_kept']} of {shape['layers'] * shape['heads']} query heads)", "",
                  "| arm | KV kept | ppl seq 128 | change | ppl seq 2048 | change | SST-2 acc | score s | tuning s | wall s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm, name in ARMS.items():
            runs = [r for r in group if r["arm"] == arm]
            if not runs:
                continue
            if arm == "random":
                p128, p2048 = ([r[k] for r in runs] for k in ("ppl128", "ppl2048"))
                acc = [r["sst2_acc"] for r in runs if r["sst2_acc"] is not None]
                spread = lambda v: f" ± {statistics.stdev(v):.1f}" if len(v) > 1 else ""  # noqa: E731
                share = statistics.mean(r["kv_share"] for r in runs)
                lines.append(f"| {name} (mean of {len(runs)} seed{'s' if len(runs) > 1 else ''}) | {share:.3f} "
                             f"| {statistics.mean(p128):.2f}{spread(p128)} | {_change(statistics.mean(p128), d128)} "
                             f"| {statistics.mean(p2048):.2f}{spread(p2048)} | {_change(statistics.mean(p2048), d2048)} "
                             f"| {_fmt(statistics.mean(acc) if acc else None, 3)} | – | – | – |")
                continue
            (r,) = runs
            lines.append(f"| {name} | {r['kv_share']:.3f} | {r['ppl128']:.2f} | {_change(r['ppl128'], d128)} | {r['ppl2048']:.2f} "
                         f"| {_change(r['ppl2048'], d2048)} | {_fmt(r['sst2_acc'], 3)} | {_fmt(r['score_seconds'], 0)} "
                         f"| {_fmt(r['tuning_seconds'], 0)} | {_fmt(r['wall_seconds'], 0)} |")
        lines.append("")
    return "\n".join(lines)


TRAINED = ("fisher_lora", "fisher_re_lora", "fisher_re_lora_kd", "fisher_re_distill", "lora_only")


def summary(dense: dict, rows: list[dict]) -> str:
    """The README's table: per budget, the best arm without training and the best with it."""
    d2048 = dense["perplexity"]["seq2048"]["ppl"]
    dz = dense.get("zero_shot", {}).get("sst2_local", {}).get("acc")
    lines = ["| budget | recovery | best arm | KV kept | ppl seq 2048 | change | SST-2 acc |",
             "|---|---|---|---:|---:|---:|---:|",
             f"| all (dense) | – | – | 1.000 | {d2048:.2f} | – | {_fmt(dz, 3)} |"]
    for budget, title in BUDGETS.items():
        for trained, label in ((False, "none (no training)"), (True, "training")):
            group = [r for r in rows if r["budget"] == budget and r["arm"] != "random" and (r["arm"] in TRAINED) == trained]
            if not group:
                continue
            best = min(group, key=lambda r: r["ppl2048"])
            lines.append(f"| {title} | {label} | {ARMS[best['arm']]} | {best['kv_share']:.3f} | {best['ppl2048']:.2f} "
                         f"| {_change(best['ppl2048'], d2048)} | {_fmt(best['sst2_acc'], 3)} |")
    return "\n".join(lines)


def answers_table(dense: dict, answers: dict) -> str:
    prompts = [a["prompt"] for a in dense.get("generation", [])]
    lines = []
    for i, prompt in enumerate(prompts):
        lines += [f"### {prompt}", "", "| model | answer |", "|---|---|",
                  f"| dense | {dense['generation'][i]['answer'].replace('|', '/').replace(chr(10), ' ')} |"]
        for run, gen in answers.items():
            if i < len(gen):
                lines.append(f"| {run} | {gen[i]['answer'].replace('|', '/').replace(chr(10), ' ')} |")
        lines.append("")
    return "\n".join(lines)


RECOVERED = ("fisher_re", "fisher_re_ls", "fisher_re_bias", "fisher_re_refit", "fisher_re_refit_att",
             "refit_rank_refit", "refit_rank_head_refit")


def recoveries(results: Path, stopped: Path) -> str:
    """Per budget, each arm without training: the validation perplexity (seq 512, the 16 held-out
    blocks) before and right after its recovery, the recovery's and the scoring's seconds, and for
    the refit the mean over layers of its relative calibration error before / after and of the
    held-out error at the chosen damp, and the damps chosen; runs stopped after the round
    (`stopped`) included. Read from each result file's `rounds[0]`."""
    files = {p.stem: p for p in sorted(results.glob("*.json"))}
    files.update({p.stem: p for p in sorted(stopped.glob("*.json"))} if stopped.is_dir() else {})
    lines = ["| budget | arm | val ppl before | val ppl after recovery | score s | recovery s | refit calib error before -> after "
             "(mean over layers) | held-out error at the chosen damp | damps chosen (layers) | finished |",
             "|---|---|---:|---:|---:|---:|---|---:|---|---|"]
    for budget in BUDGETS:
        for arm in RECOVERED:
            path = files.get(f"{arm}_{budget}")
            if path is None:
                continue
            res = json.loads(path.read_text())
            (r,) = res["rounds"]
            tuning = next((r[k] for k in TUNING if k in r), {})
            after = r.get("val_after_recovery") or r.get("val_after_mask_tuning") or {}
            refit = [layer for layer in (r.get("refit") or {}).get("layers", []) if "error_after" in layer]
            errors = held = damps = "–"
            if refit:
                mean = lambda key: statistics.mean(layer[key] for layer in refit)  # noqa: E731
                errors = f"{mean('error_before'):.3f} -> {mean('error_after'):.3f}"
                held = f"{statistics.mean(layer['heldout'][str(layer['damp'])] for layer in refit):.3f}"
                chosen = [layer["damp"] for layer in refit]
                damps = ", ".join(f"{d:g} ({chosen.count(d)})" for d in sorted(set(chosen)))
            finished = "yes" if "pruned" in res.get("evaluation", {}) else "stopped after the round"
            lines.append(f"| {budget} | {ARMS[arm]} | {_fmt(r['val_before_finetune']['ppl'])} | {_fmt(after.get('ppl'))} "
                         f"| {_fmt(r['score_seconds'], 0)} | {_fmt(tuning.get('seconds'), 0)} | {errors} | {held} | {damps} "
                         f"| {finished} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=None, help="the run folders (skip to rebuild from results/)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=HERE / "model.json", help="the model's shape (layers.py shape)")
    args = parser.parse_args()
    if args.runs is not None and args.runs.is_dir():
        gather(args.runs, args.out)
    shape = json.loads(args.model.read_text())
    dense, rows, answers = load(args.out / "results", shape)
    write_text_atomic(args.out / "results.md", table(dense, rows, shape) + "\n")
    write_text_atomic(args.out / "answers.md", answers_table(dense, answers) + "\n")
    write_text_atomic(args.out / "llm_kv.csv", to_csv(rows))
    write_text_atomic(args.out / "summary.md", summary(dense, rows) + "\n")
    write_text_atomic(args.out / "recoveries.md", recoveries(args.out / "results", Path(__file__).parent / "refit_target")
                      + "\n")
    plot(dense, rows, args.out / "results.png")


def plot(dense: dict, rows: list[dict], path: Path) -> None:
    """Perplexity (seq 2048, log scale) of every arm at each budget, dense as a line."""
    from headprune.plots import close, plt

    budgets = [b for b in BUDGETS if any(r["budget"] == b for r in rows)]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4.5), squeeze=False, sharey=True)
    for ax, budget in zip(axes[0], budgets):
        arms = [a for a in ARMS if any(r["budget"] == budget and r["arm"] == a for r in rows)]
        values = [statistics.mean(r["ppl2048"] for r in rows if r["budget"] == budget and r["arm"] == a) for a in arms]
        ax.barh(range(len(arms)), values, color="tab:blue")
        ax.set_yticks(range(len(arms)), [ARMS[a] for a in arms], fontsize=7)
        ax.axvline(dense["perplexity"]["seq2048"]["ppl"], color="k", ls="--", label="dense")
        ax.set_xscale("log")
        ax.set_title(BUDGETS[budget], fontsize=9)
        ax.set_xlabel("perplexity, seq 2048 (log)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    close(fig)


if __name__ == "__main__":
    main()
