"""The quickstart's per-round table, from its results.json.

    python experiments/quickstart/table.py experiments/quickstart/results.json > experiments/quickstart/rounds.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def table(res: dict) -> str:
    lines = ["| round | heads pruned | sparsity | heads per layer | acc right after pruning | acc after 1 fine-tuning "
             "epoch | fine-tuning samples/s | scoring s |", "|---:|---:|---:|---|---:|---:|---:|---:|"]
    base = res["baseline"]
    lines.append(f"| baseline (2 epochs) | 0 | 0.000 | {' '.join(['12'] * 6)} | – | {100 * base['val']['acc']:.2f} "
                 f"| {base.get('train_samples_per_s', 0):.1f} | – |")
    total = 0
    for r in res["rounds"]:
        total += r["n_pruned"]
        lines.append(f"| {r['round']} | {total} | {r['sparsity']:.3f} | {' '.join(map(str, r['heads_per_layer']))} "
                     f"| {100 * r['val_before_finetune']['acc']:.2f} | {100 * r['val']['acc']:.2f} "
                     f"| {r['train_samples_per_s']:.1f} | {r['score_seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def largest_drop(res: dict) -> tuple[int, float]:
    """(round, points) of the largest accuracy drop a pruning step caused before its fine-tuning."""
    before = [res["baseline"]["val"]["acc"]] + [r["val"]["acc"] for r in res["rounds"]]
    drops = [(r["round"], 100 * (before[i] - r["val_before_finetune"]["acc"])) for i, r in enumerate(res["rounds"])]
    return max(drops, key=lambda d: d[1])


if __name__ == "__main__":
    sys.stdout.write(table(json.loads(Path(sys.argv[1]).read_text())))
