"""Gather the iterative_vs_one_shot runs into one table and plot.

    python experiments/iterative_vs_one_shot/collect.py --gather experiments/iterative_vs_one_shot/runs \\
        --out experiments/iterative_vs_one_shot

--gather copies each run's results.json (a single run `runs/<name>/` or a one-job multirun
`runs/<name>/0/`) to `<out>/results/<name>.json`. The table and plot are then built from
`<out>/results/*.json` alone (`iterative_<target>`, `one_shot_<target>`, `dense_7_epochs`):
`results.md`, `iterative_vs_one_shot.csv`, `acc_vs_sparsity.png`.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from headprune.report import column, read_json, text, to_csv, write
from headprune.report import markdown as markdown_table

ARMS = ("iterative", "one_shot")


def gather(runs: Path, out: Path) -> None:
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    for run in sorted(p for p in runs.iterdir() if p.is_dir()):
        for src in (run / "results.json", run / "0" / "results.json"):
            if src.is_file() and json.loads(src.read_text())["final"]:
                shutil.copyfile(src, results / f"{run.name}.json")


def _epochs(res: dict) -> int:
    sched = res["config"]["schedule"]
    return sched["baseline_epochs"] + len(res["rounds"]) * sched["epochs_per_round"] + sched["recover_epochs"]


def table_rows(results: Path) -> list[dict]:
    rows = []
    for path in sorted(results.glob("*.json")):
        arm, _, target = path.stem.rpartition("_")
        if arm not in ARMS:
            continue
        res = json.loads(path.read_text())
        rounds = res["rounds"]
        rows.append({"target": float(target), "arm": arm, "epochs": _epochs(res), "rounds": len(rounds),
                     "heads_kept": sum(res["final"]["heads_per_layer"]),
                     "heads_per_layer": " ".join(map(str, res["final"]["heads_per_layer"])),
                     "acc_baseline": res["baseline"]["val"]["acc"],
                     "acc_worst_after_prune": min(r["val_before_finetune"]["acc"] for r in rounds),
                     "acc_after_last_prune": rounds[-1]["val_before_finetune"]["acc"],
                     "acc_final": res["final"]["val"]["acc"]})
    rows.sort(key=lambda r: (r["target"], r["arm"]))
    return rows


def _heads(r: dict) -> str:
    return f"{r['heads_kept']} ({r['heads_per_layer']})" if r["heads_per_layer"] else str(r["heads_kept"])


def _gain(r: dict) -> float | None:
    return None if r["acc_baseline"] is None else r["acc_final"] - r["acc_baseline"]


COLUMNS = [column("target", "target", "g", scale=100, unit="%"), text("arm"), column("epochs", "epochs", "d"),
           text("heads kept (per layer)", _heads), column("acc after 2 baseline epochs", "acc_baseline", scale=100),
           column("lowest acc right after a prune", "acc_worst_after_prune", scale=100),
           column("final acc", "acc_final", scale=100, bold=True), column("final - baseline", _gain, "+.2f", scale=100)]


def markdown(rows: list[dict], dense: dict | None) -> str:
    if dense is not None:  # trained as long as the 50% arms, never pruned
        rows = rows + [{"target": 0, "arm": "dense control", "epochs": _epochs(dense), "heads_kept": 72,
                        "heads_per_layer": "", "acc_baseline": None, "acc_worst_after_prune": None,
                        "acc_final": dense["final"]["val"]["acc"]}]
    return "\n".join(markdown_table(COLUMNS, rows)) + "\n"


def render(folder: Path) -> dict[str, str]:
    """results.md and iterative_vs_one_shot.csv from `folder`/results/*.json."""
    rows = table_rows(folder / "results")
    return {"results.md": markdown(rows, _dense(folder)), "iterative_vs_one_shot.csv": to_csv(rows)}


def _dense(folder: Path) -> dict | None:
    path = folder / "results" / "dense_7_epochs.json"
    return read_json(path) if path.is_file() else None


def plot(rows: list[dict], dense: dict | None, path: Path) -> None:
    from headprune.plots import plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, color in zip(ARMS, ("tab:blue", "tab:red")):
        pts = [r for r in rows if r["arm"] == arm]
        xs = [100 * r["target"] for r in pts]
        ax.plot(xs, [100 * r["acc_final"] for r in pts], "o-", color=color, label=f"{arm}: after fine-tuning")
        ax.plot(xs, [100 * r["acc_worst_after_prune"] for r in pts], "x--", color=color, alpha=0.6,
                label=f"{arm}: lowest right after a prune")
    if rows:
        ax.axhline(100 * rows[0]["acc_baseline"], color="grey", lw=0.8, ls=":", label="after the 2 baseline epochs")
    if dense is not None:
        ax.plot([0], [100 * dense["final"]["val"]["acc"]], "k*", ms=9, label=f"dense, {_epochs(dense)} epochs")
    ax.set_xlabel("heads pruned (%)")
    ax.set_ylabel("SST-2 dev accuracy (%)")
    ax.set_title("MiniLM, 4,000 SST-2 sentences, same epochs per target")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gather", type=Path, help="runs folder to copy results.json files from")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.gather:
        gather(args.gather, args.out)
    files = render(args.out)
    write(args.out, files)
    plot(table_rows(args.out / "results"), _dense(args.out), args.out / "acc_vs_sparsity.png")
    print(files["results.md"])

if __name__ == "__main__":
    main()
