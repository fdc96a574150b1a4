"""The tables and the plot of experiments/llm_kv/layers/, made from its raw json alone (no model is
loaded): layers.md and sensitivity.png from sensitivity.json, heads.json, the model's shape in
experiments/llm_kv/model.json and the MiniLM profile of experiments/layer_sensitivity/profile.json.

    python experiments/llm_kv/layers_report.py      # layers/layers.md, layers/sensitivity.png

(tests/test_experiment_results.py regenerates layers.md and tests/test_llm_layers.py the plot from the
committed files; test_llm_layers.py checks these functions on small synthetic ones.) The raw json is written by experiments/llm_kv/layers.py.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "layers"
MODEL = HERE / "model.json"
MINILM_PROFILE = HERE.parent / "layer_sensitivity" / "profile.json"


def change(ppl: float, dense: float) -> str:
    return f"{100 * (ppl / dense - 1):+.1f}%"


def sensitivity_rows(sens: dict, layers: int) -> list[dict]:
    """One row per layer: layer, depth (layer / (layers - 1): 0..1 whatever the model's depth), ppl
    and loss rise per measured seq. `layers`: the model's (model.json), not the rows measured."""
    n = layers
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


def sensitivity_md(sens: dict, profile: dict, shape: dict) -> str:
    seqs = list(sens["dense"])
    settings = dict(zip((f"seq{s}" for s in sens["settings"]["seqs"]), sens["settings"]["tokens"]))
    lines = ["## One layer removed (every KV group of the layer masked)", "",
             "Dense: " + ", ".join(f"perplexity {sens['dense'][s]['ppl']:.2f} at {s.replace('seq', 'seq ')} "
                                   f"({settings[s]:,} held-out tokens, {sens['dense'][s]['windows']} windows)"
                                   for s in seqs) + ".", "",
             "| layer | depth | " + " | ".join(f"ppl {s.replace('seq', 'seq ')} | change | loss rise" for s in seqs) + " |",
             "|---:|---:|" + "---:|---:|---:|" * len(seqs)]
    for row in sensitivity_rows(sens, shape["layers"]):
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


def plot(sens: dict, profile: dict, shape: dict, path: Path) -> None:
    from headprune.plots import plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = sensitivity_rows(sens, shape["layers"])
    for seq, marker in zip(sens["dense"], ("o", "s")):
        pts = [(r["depth"], r[f"{seq}_loss_rise"]) for r in rows if seq in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ms=3.5,
                label=f"SmolLM2-135M ({shape['layers']} layers), perplexity {seq.replace('seq', 'seq ')}")
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


def kv_group(head: int, group_size: int) -> int:
    """The KV group query head `head` reads: `group_size` consecutive query heads share one (HF's
    repeat_kv; the adapters' `kv_head`). `group_size`: heads.json's, checked against model.json."""
    return head // group_size


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
            key = (l, kv_group(h, g))
            groups[key] = groups.get(key, 0) + 1
        out[f"sink_groups_{t}"] = {k for k, n in groups.items() if 2 * n > g}  # most of its heads
        out[f"sink_groups_any_{t}"] = set(groups)
    pairs = [(p["layer"], *p["heads"]) for p in heads["diagnostics"]["redundancy"]["near_duplicates"]]
    out["pairs"] = pairs
    out["pairs_cross"] = [(l, i, j) for l, i, j in pairs if kv_group(i, g) != kv_group(j, g)]
    out["dup_heads"] = {(l, h) for l, i, j in pairs for h in (i, j)}
    out["dup_groups"] = {(l, kv_group(h, g)) for l, h in out["dup_heads"]}
    out["cross_js"] = [[min(js[l][h][k] for k in range(len(row)) if kv_group(k, g) != kv_group(h, g)) for h in range(len(row))]
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
    groups_removed = {(l, kv_group(h, g)) for l, h in removed}
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


def heads_md(heads: dict, shape: dict) -> str:
    g, total = heads["group_size"], len(heads["first_token_share"]) * len(heads["first_token_share"][0])
    k, last = shape["kv_heads"], len(heads["first_token_share"]) - 1  # KV groups per layer, last layer
    most = " or ".join(str(n) for n in range(g // 2 + 1, g + 1))
    sets = head_sets(heads)
    fmt = lambda hs: ", ".join(f"{l}.{h}" for l, h in sorted(hs)) or "none"  # noqa: E731
    pct = lambda x: "–" if x != x else f"{100 * x:.0f}%"  # noqa: E731
    lines = ["## Attention-sink and near-duplicate heads (dense model, calibration blocks)", "",
             f"Calibration: {heads['calibration']['blocks']} x {heads['calibration']['block_size']} tokens "
             "(the blocks experiment=llm_kv scores heads on, no BOS). Sink share: mean attention weight on the "
             "block's first token over queries 2..512 (`first_token_share`), and on a BOS put before each block "
             "(`BOS first`: the project's special-token share, `diagnostics_bos`). Heads as layer.head; "
             f"KV group = head // {g}. A sink group has most ({most}) of its heads sinks (`any head`: at least one).", "",
             "| rule | sink heads | sink heads, BOS first | sink groups (most heads) | sink groups (any head) |",
             "|---|---:|---:|---:|---:|"]
    for t in heads["sink_thresholds"]:
        lines.append(f"| share >= {t} | {len(sets[f'sinks_calib_{t}'])} | {len(sets[f'sinks_bos_{t}'])} | "
                     f"{len(sets[f'sink_groups_{t}'])} | {len(sets[f'sink_groups_any_{t}'])} |")
    lines.append("")
    for t in heads["sink_thresholds"]:
        per_layer = [sum(x >= t for x in row) for row in sets["share"]]
        lines.append(f"Sink heads (share >= {t}) per layer 0-{last}: " + " ".join(map(str, per_layer)) + ".")
    t_hi = heads["sink_thresholds"][0]
    mean_layer = [sum(row) / len(row) for row in sets["share"]]
    lines += ["", f"Sink heads at share >= {t_hi}: {fmt(sets[f'sinks_calib_{t_hi}'])}; BOS first: "
              f"{fmt(sets[f'sinks_bos_{t_hi}'])}. Mean first-token share per layer 0-{last}: "
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
    lines += ["", "Every run removes whole KV groups, the same number in each layer (`layer_policy=uniform`): "
              f"1 of {k} groups per layer at 2 of {k} kept, 2 of {k} at 1 of {k} kept, so random choice removes any head "
              f"or group with probability 1/{k} (2/{k} at 1 of {k} kept).",
              "", "Runs: " + ", ".join(f"`{s}`" for _, stems in ARMS for s in stems) + " (experiments/llm_kv/results/; "
              "`fisher_re_ls_*` and `fisher_re_bias_*` removed the same heads as `fisher_re_*`)."]
    return "\n".join(lines) + "\n"


def markdown(sens: dict, heads: dict | None, profile: dict, shape: dict) -> str:
    """layers.md. `shape`: model.json (the model's layers, query heads, KV heads); heads.json's group
    size must be its own."""
    if heads is not None and heads["group_size"] != shape["heads"] // shape["kv_heads"]:
        raise ValueError(f"heads.json: group_size {heads['group_size']} is not the model's "
                         f"{shape['heads']} // {shape['kv_heads']} query heads per KV head (model.json)")
    text = ("# SmolLM2-135M-Instruct layer by layer (generated by experiments/llm_kv/layers_report.py "
            "from sensitivity.json, heads.json, ../model.json and experiments/layer_sensitivity/profile.json)\n\n")
    text += sensitivity_md(sens, profile, shape)
    if heads is not None:
        text += "\n" + heads_md(heads, shape)
    return text


def main() -> None:
    sens = json.loads((OUT / "sensitivity.json").read_text())
    heads_path = OUT / "heads.json"
    heads = json.loads(heads_path.read_text()) if heads_path.exists() else None
    profile = json.loads(MINILM_PROFILE.read_text())
    shape = json.loads(MODEL.read_text())
    (OUT / "layers.md").write_text(markdown(sens, heads, profile, shape))
    plot(sens, profile, shape, OUT / "sensitivity.png")
    print((OUT / "layers.md").read_text())


if __name__ == "__main__":
    main()
