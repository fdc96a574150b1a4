"""The quickstart with heads masked vs physically removed after each round: wall time, training
throughput per round, heads pruned and accuracies, from the two runs of physical_timing.sh.

    python experiments/quickstart/physical_timing.py experiments/quickstart/runs --out experiments/quickstart

Writes physical_timing.json (the numbers the table is made of, copied from each run's
results.json and wall.json) and physical_timing.md (the table).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from headprune.atomic import write_json_atomic, write_text_atomic

ARMS = ("masked", "physical")


def gather(runs: Path) -> dict:
    out = {}
    for arm in ARMS:
        res = json.loads((runs / arm / "results.json").read_text())
        wall = json.loads((runs / arm / "wall.json").read_text())
        out[arm] = {"wall_seconds": wall["wall_seconds"], "load_average_after": wall["load_average_after"],
                    "physical_effective": res["pruning"]["physical_effective"],
                    "baseline": {"acc": res["baseline"]["val"]["acc"],
                                 "train_samples_per_s": res["baseline"]["train_samples_per_s"]},
                    "rounds": [{"round": r["round"], "pruned": r["pruned"], "acc": r["val"]["acc"],
                                "acc_before_finetune": r["val_before_finetune"]["acc"],
                                "train_seconds": r["train_seconds"], "train_samples_per_s": r["train_samples_per_s"]}
                               for r in res["rounds"]],
                    "final_acc": res["final"]["val"]["acc"], "final_pruned": res["final"]["pruned"]}
    return out


def table(data: dict) -> str:
    m, p = data["masked"], data["physical"]
    lines = ["| | masked (pruning.physical=false) | physical (default) | physical / masked |", "|---|---:|---:|---:|",
             f"| wall time (min) | {m['wall_seconds'] / 60:.1f} | {p['wall_seconds'] / 60:.1f} "
             f"| {p['wall_seconds'] / m['wall_seconds']:.3f} |",
             f"| baseline epochs, samples/s | {m['baseline']['train_samples_per_s']:.1f} "
             f"| {p['baseline']['train_samples_per_s']:.1f} | |"]
    for rm, rp in zip(m["rounds"], p["rounds"]):
        lines.append(f"| round {rm['round']} fine-tuning, samples/s | {rm['train_samples_per_s']:.1f} "
                     f"| {rp['train_samples_per_s']:.1f} | {rp['train_samples_per_s'] / rm['train_samples_per_s']:.2f}x |")
    same = all(rm["pruned"] == rp["pruned"] for rm, rp in zip(m["rounds"], p["rounds"]))
    accs = " / ".join(f"{100 * r['acc']:.2f}" for r in m["rounds"])
    accs_p = " / ".join(f"{100 * r['acc']:.2f}" for r in p["rounds"])
    lines += [f"| accuracy after each round (%) | {accs} | {accs_p} | |",
              f"| final accuracy (%) | {100 * m['final_acc']:.2f} | {100 * p['final_acc']:.2f} | |",
              f"| same heads pruned in every round | | | {'yes' if same else 'no'} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    data = gather(args.runs)
    write_json_atomic(args.out / "physical_timing.json", data)
    write_text_atomic(args.out / "physical_timing.md", table(data))
    print(table(data))


if __name__ == "__main__":
    main()
