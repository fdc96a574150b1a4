"""The recovery experiment's table and plot, from the runs' results.json.

    python experiments/recovery/collect.py --runs experiments/recovery/runs \\
        --reuse experiments/iterative_vs_one_shot/results --out experiments/recovery

Copies every finished run (`<runs>/<arm>_<target>_s<seed>/results.json` and its `wall.json`) to
`<out>/results/<arm>_<target>_s<seed>.json` (wall time added as `wall_seconds`), and the reused
seed-0 runs of iterative_vs_one_shot (`one_shot_<t>.json` -> arm one_shot_long, `iterative_<t>.json`
-> iterative) under the same naming with `"reused_from"` set. The tables are then built from
`<out>/results/*.json` alone: `results.md` (one row per arm and target: mean ± sample std over
seeds), `recovery.csv` (one row per run), `curves.md` and `acc_vs_sparsity.png` (accuracy after
each round's fine-tuning, mean over seeds).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from headprune.apps.collect import curve_table, plot
from headprune.atomic import write_json_atomic
from headprune.report import column, spread, text, to_csv, write
from headprune.report import markdown as markdown_table

ARMS = {"one_shot_short": "(a) one-shot, then 1 epoch", "one_shot_long": "(b) one-shot, then 1 epoch per round",
        "iterative": "(c) iterative, 1 epoch per round", "distill": "(d) iterative + distillation",
        "distill_hidden": "(d') (d) + hidden-state matching", "dense": "(e) dense, trained as long"}
REUSED = {"one_shot": "one_shot_long", "iterative": "iterative"}  # iterative_vs_one_shot file stem -> arm


def gather(runs: Path, reuse: Path | None, out: Path) -> None:
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    for run in sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []:
        src = run / "results.json"
        if not src.is_file():
            continue
        res = json.loads(src.read_text())
        if not res["final"]:
            continue  # still running
        if (run / "wall.json").is_file():
            wall = json.loads((run / "wall.json").read_text())
            res["wall_seconds"] = wall["wall_seconds"]
            if "note" in wall:  # e.g. a run resumed after an interruption: how its wall time was summed
                res["wall_note"] = wall["note"]
        write_json_atomic(results / f"{run.name}.json", res)
    for path in sorted(reuse.glob("*.json")) if reuse is not None else []:
        stem, _, target = path.stem.rpartition("_")
        if stem in REUSED and target in ("0.7", "0.9"):
            res = json.loads(path.read_text())
            res["reused_from"] = str(path)
            write_json_atomic(results / f"{REUSED[stem]}_{target}_s0.json", res)


def load(results: Path) -> list[dict]:
    """Every run, with `arm`, `target`, `seed` from its file name (as run.sh names them)."""
    runs = []
    for path in sorted(results.glob("*.json")):
        arm, target, seed = path.stem.rsplit("_", 2)
        res = json.loads(path.read_text())
        res.update(arm=arm, target=float(target), seed=int(seed[1:]), run_dir=path.stem,
                   overrides={"arm": arm, "target": target, "seed": seed[1:]})
        runs.append(res)
    return runs


def _epochs(res: dict) -> int:
    s = res["config"]["schedule"]
    return s["baseline_epochs"] + len(res["rounds"]) * s["epochs_per_round"] + s["recover_epochs"]


def run_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for r in sorted(runs, key=lambda r: (r["target"], list(ARMS).index(r["arm"]), r["seed"])):
        after = [x["val_before_finetune"]["acc"] for x in r["rounds"]]
        rows.append({"target": r["target"], "arm": r["arm"], "seed": r["seed"], "epochs": _epochs(r),
                     "heads_kept": sum(r["final"]["heads_per_layer"]), "acc_baseline": r["baseline"]["val"]["acc"],
                     "acc_after_each_prune": " ".join(f"{100 * a:.2f}" for a in after),
                     "acc_lowest_after_prune": min(after) if after else None, "acc_final": r["final"]["val"]["acc"],
                     "wall_seconds": r.get("wall_seconds"),
                     "teacher_seconds": sum(x.get("teacher_seconds", 0.0) for x in r["rounds"]) or None,
                     "reused_from": r.get("reused_from", "")})
    return rows


def _wall(group: list[dict]) -> str:
    walls = [r["wall_seconds"] / 60 if r["wall_seconds"] else None for r in group]
    return spread(walls, digits=1) if any(walls) else "– (reused)"


COLUMNS = [column("target", lambda g: g[0]["target"], "g", scale=100, unit="%"),
           text("arm", lambda g: ARMS[g[0]["arm"]]), text("seeds", lambda g: ",".join(str(r["seed"]) for r in g), right=True),
           text("epochs", lambda g: g[0]["epochs"], right=True),
           text("acc after the 2 baseline epochs",
                lambda g: "–" if g[0]["arm"] == "dense" else spread([r["acc_baseline"] for r in g], scale=100), right=True),
           text("lowest acc right after a prune", lambda g: spread([r["acc_lowest_after_prune"] for r in g], scale=100),
                right=True),
           text("final acc", lambda g: f"**{spread([r['acc_final'] for r in g], scale=100)}**", right=True),
           text("wall min", _wall, right=True)]


def markdown(rows: list[dict]) -> str:
    """One line per target and arm (in ARMS' order): each figure's mean ± sample std over the seeds."""
    groups = [[r for r in rows if r["target"] == target and r["arm"] == arm]
              for target in sorted({r["target"] for r in rows}) for arm in ARMS]
    return "\n".join(markdown_table(COLUMNS, [g for g in groups if g])) + "\n"


def render(folder: Path) -> dict[str, str]:
    """results.md, recovery.csv and curves.md from `folder`/results/*.json."""
    runs = load(folder / "results")
    rows = run_rows(runs)
    pruned = [r for r in runs if r["arm"] != "dense"]
    return {"recovery.csv": to_csv(rows), "results.md": markdown(rows),
            "curves.md": curve_table(pruned, ["arm", "target"], mean_over=["seed"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=None, help="run.sh's runs folder (copied into <out>/results)")
    parser.add_argument("--reuse", type=Path, default=None, help="iterative_vs_one_shot/results, for the reused runs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.runs is not None:
        gather(args.runs, args.reuse, args.out)
    files = render(args.out)
    write(args.out, files)
    pruned = [r for r in load(args.out / "results") if r["arm"] != "dense"]
    plot(pruned, args.out / "acc_vs_sparsity.png", ["arm", "target"], mean_over=["seed"])
    print(files["results.md"])

if __name__ == "__main__":
    main()
