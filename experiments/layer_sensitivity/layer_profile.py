"""Per-layer sensitivity profile: SST-2 dev accuracy with a share of one layer's heads masked.

For every layer and every share, the `share` lowest-scoring heads of that layer alone are masked
(no training) and the fine-tuned model is evaluated on the validation set. Scores come from the
same 512-sentence scoring slice that headprune-train ranks heads on.

    HF_HUB_OFFLINE=1 HEADPRUNE_DATA_DIR=../shared/data python experiments/layer_sensitivity/layer_profile.py \\
        --model experiments/metric_curves/runs/finetune/export --out experiments/layer_sensitivity

writes profile.json (every row), profile.md (accuracy change per layer and share) and profile.png.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from headprune.heads.mask import HeadMask
from headprune.data.classification import TextClassificationDataModule
from headprune.models import build_model, load_tokenizer
from headprune.atomic import write_json_atomic, write_text_atomic
from headprune.scoring import score_heads
from headprune.selection.sensitivity import sensitivity_profile


def table(rows: list[dict], shares: list[float]) -> str:
    base = rows[0]
    head = "| layer | " + " | ".join(f"{100 * s:g}% masked" for s in shares) + " | loss rise, 50% masked |"
    lines = [f"Unmasked: accuracy {100 * base['acc']:.2f}%, loss {base['loss']:.4f}. Cells: accuracy change "
             "in points (heads masked).", "", head, "|---|" + "---:|" * (len(shares) + 1)]
    for layer in sorted({r["layer"] for r in rows[1:]}):
        cells = {r["share"]: r for r in rows if r["layer"] == layer}
        rise = f"{cells[0.5]['loss_change']:+.4f}" if 0.5 in cells else ""
        lines.append(f"| {layer} | " + " | ".join(f"{100 * cells[s]['acc_change']:+.2f} ({cells[s]['heads_masked']})"
                                                  for s in shares) + f" | {rise} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], shares: list[float], path) -> None:
    from headprune.plots import plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    layers = sorted({r["layer"] for r in rows[1:]})
    for share in shares:
        drop = [100 * next(r["acc_change"] for r in rows if r["layer"] == layer and r["share"] == share)
                for layer in layers]
        ax.plot(layers, drop, marker="o", label=f"{100 * share:g}% of the layer's heads masked")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("layer")
    ax.set_xticks(layers)
    ax.set_ylabel("accuracy change (points)")
    ax.set_title("MiniLM on SST-2: one layer's weakest heads masked")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a fine-tuned classifier, e.g. <sst2_finetune run>/export")
    parser.add_argument("--out", required=True)
    parser.add_argument("--metric", default="taylor")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--score-samples", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--max-validation-samples", type=int, default=None, help="for smoke runs")
    parser.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR", "../shared/data"))
    args = parser.parse_args()

    start = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    dm = TextClassificationDataModule(tokenizer, train_file="sst2/train.tsv", validation_file="sst2/validation.tsv",
                                      data_dir=args.data_dir, score_samples=args.score_samples,
                                      max_train_samples=0, max_validation_samples=args.max_validation_samples,
                                      max_length=args.max_length)
    dm.setup()
    model = build_model(args.model, num_labels=2).eval()
    mask = HeadMask.for_model(model)
    scores = score_heads(model, dm.score_dataloader(), args.metric, mask=mask)  # (L, H)
    rows = sensitivity_profile(model, mask, scores, dm.val_dataloader(), args.shares)
    seconds = time.perf_counter() - start
    meta = {"model": args.model, "metric": args.metric, "shares": args.shares, "score_samples": args.score_samples,
            "validation_examples": len(dm.val_set), "seconds": round(seconds, 1), "torch_threads": torch.get_num_threads(),
            "scores": scores.tolist()}
    write_json_atomic(os.path.join(args.out, "profile.json"), {**meta, "rows": rows})
    text = table(rows, args.shares)
    write_text_atomic(os.path.join(args.out, "profile.md"), text)
    plot(rows, args.shares, os.path.join(args.out, "profile.png"))
    print(text)
    print(f"{seconds:.0f} s, {torch.get_num_threads()} torch thread(s)")


if __name__ == "__main__":
    main()
