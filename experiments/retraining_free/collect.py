"""The retraining_free experiment's tables, from the runs' results.json.

    python experiments/retraining_free/collect.py --runs experiments/retraining_free/runs \\
        --out experiments/retraining_free

Copies each finished run (`<runs>/<arm>_<budget>/results.json`, with `wall.json`'s wall time
added as `wall_seconds`) to `<out>/results/<arm>_<budget>.json`; the tables are then built from
`<out>/results/*.json` alone: `results.md` (accuracy per budget and arm, the drop from the
unpruned model, heads kept, predicted and measured latency share, seconds per stage) and
`retraining_free.csv` (one row per run). With `--beside <recovery results folder>`, also
`beside.md`: the heads-budget runs next to the prune-and-fine-tune arms of experiments/recovery
(accuracy before and after pruning, wall time), from both folders' result files.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from headprune.apps.collect import to_csv
from headprune.atomic import write_json_atomic, write_text_atomic

ARMS = {"taylor": "(a) Taylor, masking only", "fisher": "(b) Fisher + rearrangement",
        "fisher_ls": "(c) (b) + least-squares tuning"}


def gather(runs: Path, out: Path) -> None:
    (out / "results").mkdir(parents=True, exist_ok=True)
    for run in sorted(p for p in runs.iterdir() if p.is_dir() and (p / "results.json").is_file()):
        res = json.loads((run / "results.json").read_text())
        if "export_dir" not in res["final"]:
            continue  # unfinished
        if (run / "wall.json").is_file():
            res["wall_seconds"] = json.loads((run / "wall.json").read_text())["wall_seconds"]
        write_json_atomic(out / "results" / f"{run.name}.json", res)


def budget_of(name: str) -> tuple[str, str]:
    """(arm, budget label) from a run name: fisher_ls_latency_0.8_seq128 -> (fisher_ls, latency 0.8 seq128)."""
    for arm in sorted(ARMS, key=len, reverse=True):
        if name.startswith(arm + "_"):
            return arm, name[len(arm) + 1:].replace("_", " ")
    raise ValueError(f"{name}: no known arm prefix ({', '.join(ARMS)})")


def rows(results: Path) -> list[dict]:
    out = []
    for path in sorted(results.glob("*.json")):
        arm, budget = budget_of(path.stem)
        res = json.loads(path.read_text())
        (r,) = res["rounds"]
        latency = res["final"].get("latency", {})
        stages = {"costs": res.get("budget", {}).get("seconds"), "score": r["score_seconds"],
                  "rearrange": (r.get("rearranged") or {}).get("seconds"),
                  "mask_tuning": (r.get("mask_tuning") or {}).get("seconds")}
        out.append({"budget": budget, "arm": arm, "acc_unpruned": res["baseline"]["val"]["acc"],
                    "acc": res["final"]["val"]["acc"],
                    "acc_before_tuning": r["val_before_finetune"]["acc"],
                    "heads_kept": sum(res["final"]["heads_per_layer"]),
                    "heads_per_layer": " ".join(map(str, res["final"]["heads_per_layer"])),
                    "predicted_share": (r.get("budget") or {}).get("predicted_share"),
                    "measured_share": latency.get("measured_share"), "wall_seconds": res.get("wall_seconds"),
                    "latency_table_cached": res.get("budget", {}).get("table_cached"),
                    **{f"{k}_seconds": v for k, v in stages.items()}})
    order = {"heads": 0, "latency": 1}
    out.sort(key=lambda x: (order[x["budget"].split()[0]], x["budget"].split()[-1], x["budget"], list(ARMS).index(x["arm"])))
    return out


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(table: list[dict]) -> str:
    lines = ["| budget | arm | heads kept | acc | drop (points) | acc before tuning | predicted / measured latency "
             "| seconds: costs, score, rearrange, tuning | wall s |",
             "|---|---|---:|---:|---:|---:|---|---|---:|"]
    for r in table:
        label = r["budget"].replace("heads ", "heads removed ")
        latency = (f"{_num(r['predicted_share'], '.3f')} / {_num(r['measured_share'], '.3f')}"
                   if r["measured_share"] is not None else "–")
        stages = ", ".join(_num(r[f"{k}_seconds"], ".1f") for k in ("costs", "score", "rearrange", "mask_tuning"))
        lines.append(f"| {label} | {ARMS[r['arm']]} | {r['heads_kept']} | {100 * r['acc']:.2f} "
                     f"| {100 * (r['acc_unpruned'] - r['acc']):.2f} | {100 * r['acc_before_tuning']:.2f} | {latency} "
                     f"| {stages} | {_num(r['wall_seconds'], '.0f')} |")
    return "\n".join(lines) + "\n"


FINETUNE_ARMS = {"one_shot_short": "one-shot, then 1 epoch", "one_shot_long": "one-shot, then 1 epoch per round",
                 "iterative": "iterative, 1 epoch per round", "distill": "iterative + distillation"}


def beside(table: list[dict], recovery: Path) -> str:
    """Retraining-free runs at heads budgets beside the recovery experiment's prune-and-fine-tune
    arms: what each starts from, what it ends at, and its wall time (mean over seeds)."""
    lines = ["| heads removed | route | starts from | acc before pruning | acc after | change (points) | wall min |",
             "|---:|---|---|---:|---:|---:|---:|"]
    out = []
    for r in table:
        if r["budget"].startswith("heads "):
            out.append((float(r["budget"].split()[1]), 0, f"retraining-free {ARMS[r['arm']]}",
                        "fine-tuned on all of SST-2", [r["acc_unpruned"]], [r["acc"]], [r["wall_seconds"]]))
    groups: dict = {}
    for path in sorted(recovery.glob("*.json")):
        arm, target, _ = path.stem.rsplit("_", 2)
        if arm in FINETUNE_ARMS:
            res = json.loads(path.read_text())
            g = groups.setdefault((float(target), arm), ([], [], []))
            g[0].append(res["baseline"]["val"]["acc"])
            g[1].append(res["final"]["val"]["acc"])
            g[2].append(res.get("wall_seconds"))
    for (target, arm), (before, after, walls) in groups.items():
        out.append((target, 1 + list(FINETUNE_ARMS).index(arm), f"prune and fine-tune: {FINETUNE_ARMS[arm]}",
                    "2 epochs on 4,000 sentences", before, after, walls))
    for target, _, route, start, before, after, walls in sorted(out, key=lambda x: x[:2]):
        known = [w for w in walls if w is not None]
        wall = f"{statistics.fmean(known) / 60:.1f}" if len(known) == len(walls) else "– (reused)"
        seeds = f" (mean of {len(after)} seeds)" if len(after) > 1 else ""
        b, a = statistics.fmean(before), statistics.fmean(after)
        lines.append(f"| {100 * target:g}% | {route}{seeds} | {start} | {100 * b:.2f} | {100 * a:.2f} "
                     f"| {100 * (a - b):+.2f} | {wall} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--beside", type=Path, default=None, help="experiments/recovery/results, for beside.md")
    args = parser.parse_args(argv)
    if args.runs is not None:
        gather(args.runs, args.out)
    table = rows(args.out / "results")
    write_text_atomic(args.out / "retraining_free.csv", to_csv(table))
    write_text_atomic(args.out / "results.md", markdown(table))
    if args.beside is not None:
        write_text_atomic(args.out / "beside.md", beside(table, args.beside))
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
