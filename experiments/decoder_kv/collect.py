"""Gather the decoder_kv runs into one table: perplexity, parameters, KV cache and decode latency
per share of heads pruned.

    python experiments/decoder_kv/collect.py experiments/decoder_kv/runs --out experiments/decoder_kv

Reads <runs>/pretrain/, <runs>/prune/*/ (results.json and bench/bench.json), <runs>/control/*/
and, when present, <runs>/no_finetune/. Writes results.md, decoder_kv.csv, ppl_vs_sparsity.png
and copies of every results.json / bench.json under results/ (small files; no checkpoints).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

from headprune.plots import plt
from headprune.report import column, read_json as _load, text, to_csv, write
from headprune.report import markdown as markdown_table


def finetune_steps(res: dict) -> int:
    """Optimizer steps after the start: (rounds x epochs_per_round + recover_epochs) x batches per epoch."""
    sched, batches = res["config"]["schedule"], res["config"]["trainer"]["limit_train_batches"]
    return batches * (len(res["rounds"]) * sched["epochs_per_round"] + sched["recover_epochs"])


def bench_rows(bench: dict) -> tuple[dict, dict]:
    """(dense, exported) decoder rows of a bench.json measured on a pruned export."""
    rows = {r["variant"]: r for r in bench["decoder"]}
    return rows["dense"], rows["exported"]


def _row(sparsity, heads_per_layer, steps, ppl_pruned, ppl_finetuned, ppl_control, params, bench_row, dense_row):
    return {"sparsity": sparsity, "heads": sum(heads_per_layer), "heads_per_layer": " ".join(map(str, heads_per_layer)),
            "finetune_steps": steps, "ppl_after_pruning": ppl_pruned, "ppl_finetuned": ppl_finetuned,
            "ppl_dense_control": ppl_control, "attention_params": params["attention"], "total_params": params["total"],
            "kv_cache_bytes": bench_row["kv_cache_bytes"], "kv_ratio": bench_row["kv_cache_bytes"] / dense_row["kv_cache_bytes"],
            "per_token_ms": bench_row["per_token_ms"], "per_token_x": dense_row["per_token_ms"] / bench_row["per_token_ms"],
            "prefill_ms": bench_row["prefill_ms"], "prefill_x": dense_row["prefill_ms"] / bench_row["prefill_ms"],
            "attention_share": bench_row["per_token_attention_share"]}


def table_rows(root: Path) -> list[dict]:
    """The trained dense model, then each pruned model by sparsity. Speed ratios are against the
    dense model timed in the same interleaved bench run; the dense row shows medians over runs."""
    runs = [(_load(d / "results.json"), _load(d / "bench" / "bench.json"))
            for d in sorted((root / "prune").iterdir()) if (d / "results.json").is_file()]
    runs.sort(key=lambda run: run[0]["final"]["sparsity"])
    controls = {finetune_steps(r): r["final"]["val"]["ppl"]
                for r in (_load(p) for p in sorted((root / "control").glob("*/results.json")))}
    first = runs[0][0]
    denses = [bench_rows(bench)[0] for _, bench in runs]
    dense = {key: statistics.median(d[key] for d in denses)
             for key in ("per_token_ms", "prefill_ms", "per_token_attention_share", "kv_cache_bytes")}
    layers, heads = first["model"]["layers"], first["model"]["heads"]
    base_ppl = first["baseline"]["val"]["ppl"]
    rows = [_row(0.0, [heads] * layers, 0, base_ppl, base_ppl, None, first["baseline"]["params"], dense, dense)]
    for res, bench in runs:
        dense_row, exported = bench_rows(bench)
        steps = finetune_steps(res)
        rows.append(_row(res["final"]["sparsity"], res["final"]["heads_per_layer"], steps,
                         res["rounds"][-1]["val_before_finetune"]["ppl"], res["final"]["val"]["ppl"],
                         controls.get(steps), res["final"]["params"], exported, dense_row))
    return rows


def no_finetune_curve(root: Path) -> list[tuple[float, float]]:
    """(sparsity, ppl) of the pruning run without any fine-tuning, if it was run."""
    path = root / "no_finetune" / "results.json"
    if not path.is_file():
        return []
    res = _load(path)
    return [(0.0, res["baseline"]["val"]["ppl"])] + [(r["sparsity"], r["val"]["ppl"]) for r in res["rounds"]]


COLUMNS = [
    text("heads pruned", lambda r: f"{100 * r['sparsity']:.0f}% ({r['heads']} kept)", right=True),
    text("heads per layer", "heads_per_layer"),
    column("fine-tune steps", "finetune_steps", "d"),
    column("val ppl right after the last pruning round", "ppl_after_pruning", ".3f"),
    column("val ppl after fine-tuning", "ppl_finetuned", ".3f"),
    column("dense, same fine-tuning", "ppl_dense_control", ".3f", missing="-"),
    column("attention params", "attention_params", ","),
    column("KV cache (bytes)", "kv_cache_bytes", ","),
    column("KV x dense", "kv_ratio", ".3f"),
    column("per-token decode ms", "per_token_ms", ".3f"),
    column("decode speed-up", "per_token_x", ".2f", unit="x"),
    column("prefill speed-up", "prefill_x", ".2f", unit="x"),
    column("attention share of a decode step", "attention_share", ".0f", scale=100, unit="%")]
CURVE = [column("heads pruned", lambda p: p[0], ".0f", scale=100, unit="%"), column("val ppl", lambda p: p[1], ".3f")]


def markdown(rows: list[dict], curve: list[tuple[float, float]]) -> str:
    lines = markdown_table(COLUMNS, rows)
    if curve:
        lines += ["", "Without any fine-tuning (25% more heads masked per round, re-scored each round):", "",
                  *markdown_table(CURVE, curve)]
    return "\n".join(lines) + "\n"


def render(folder: Path) -> dict[str, str]:
    """results.md and decoder_kv.csv from the runs under `folder`/results (run.sh's runs folder layout)."""
    rows, curve = table_rows(folder / "results"), no_finetune_curve(folder / "results")
    return {"results.md": markdown(rows, curve), "decoder_kv.csv": to_csv(rows)}


def plot(rows: list[dict], curve: list[tuple[float, float]], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = [100 * r["sparsity"] for r in rows]
    left.plot(x, [r["ppl_finetuned"] for r in rows], marker="o", label="pruned, fine-tuned")
    left.plot(x, [r["ppl_after_pruning"] for r in rows], marker="o", label="right after the last pruning round")
    controls = [(100 * r["sparsity"], r["ppl_dense_control"]) for r in rows if r["ppl_dense_control"] is not None]
    if controls:
        left.plot(*zip(*controls), marker="s", ls="--", label="dense, same fine-tuning steps")
    if curve:
        left.plot([100 * s for s, _ in curve], [p for _, p in curve], marker="x", ls=":", label="no fine-tuning")
    left.set(xlabel="heads pruned (%)", ylabel="validation perplexity (per byte)")
    left.legend(fontsize=7)
    right.plot(x, [r["kv_ratio"] for r in rows], marker="o", label="KV-cache bytes / dense")
    right.plot(x, [1 / r["per_token_x"] for r in rows], marker="o", label="per-token decode time / dense")
    right.set(xlabel="heads pruned (%)", ylim=(0, 1.1))
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def copy_small_files(root: Path, out: Path) -> None:
    """results.json and bench.json of every run, under out/results/<run>/ (no checkpoints or exports)."""
    for src in list(root.rglob("results.json")) + list(root.rglob("bench.json")):
        dest = out / "results" / src.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="the runs folder of run.sh")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.md, decoder_kv.csv, the plot")
    args = parser.parse_args(argv)
    copy_small_files(args.root, args.out)
    files = render(args.out)
    write(args.out, files)
    plot(table_rows(args.out / "results"), no_finetune_curve(args.out / "results"), args.out / "ppl_vs_sparsity.png")
    print(files["results.md"])

if __name__ == "__main__":
    main()
