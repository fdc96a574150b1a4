"""bench.json, bench.md and bench.png from the encoder and decoder rows, plus the headline summary."""
from __future__ import annotations

from pathlib import Path

from headprune.atomic import write_json_atomic, write_text_atomic
from headprune.plots import plt

ATTENTION_TARGET = 1.85  # attention sub-layer speed-up wanted at 50% of the heads removed
TRAIN_STEP_TARGET = 1.25  # training step at 50% of the heads, pruned vs masked
RUNTIME_TOLERANCE = 0.10  # ONNX Runtime's forward ratio at 50% heads within 10% of PyTorch's


def summary(results: dict) -> dict:
    """Headline numbers: attention speed-up at 50% heads (largest grid point), masked vs dense,
    the training step and ONNX Runtime at 50% heads, KV-cache exactness and per-token decode
    speed-up of each decoder."""
    out: dict = {}
    enc = results.get("encoder") or []
    for section, fn in (("encoder", _encoder_summary), ("train_step", _train_step_summary)):
        if results.get(section):
            out[section] = fn(results[section])
    if results.get("onnxruntime"):
        out["onnxruntime"] = _runtime_summary(results["onnxruntime"], enc)
    dec = results.get("decoder") or []
    for model in dict.fromkeys(r["model"] for r in dec):
        out.setdefault("decoder", {})[model] = _decoder_summary([r for r in dec if r["model"] == model])
    return out


def _largest(rows: list[dict]) -> tuple[int, int]:
    """The (batch, seq) with the most tokens."""
    return max(((r["batch"], r["seq"]) for r in rows), key=lambda bs: (bs[0] * bs[1], bs))


def _pruned_half(rows: list[dict], shape: tuple[int, int]) -> dict | None:
    return next((r for r in rows if (r["batch"], r["seq"]) == shape and r["kind"] == "pruned"
                 and r["layout"] in ("uniform", "exported") and r["sparsity"] == 0.5), None)


def _encoder_summary(enc: list[dict]) -> dict:
    batch, seq = _largest(enc)
    at = {(r["variant"], r["sparsity"]): r for r in enc if (r["batch"], r["seq"]) == (batch, seq)}
    dense = at[("dense", 0.0)]
    spread = dense["attention_spread_ms"]
    out = {"batch": batch, "seq": seq, "dense_attention_iqr_rel": (spread["q3"] - spread["q1"]) / dense["attention_ms"]}
    pruned = at.get(("pruned_uniform", 0.5))
    if pruned:
        out.update(attention_ratio_50=pruned["attention_ratio"], target=ATTENTION_TARGET,
                   meets_target=pruned["attention_ratio"] >= ATTENTION_TARGET,
                   theoretical_attention_ratio_50=pruned["theoretical_attention_ratio"])
    masked = at.get(("masked", 0.5))
    if masked:
        out.update(masked_forward_ratio_50=masked["forward_ratio"], masked_attention_ratio_50=masked["attention_ratio"])
    return out


def _train_step_summary(steps: list[dict]) -> dict:
    batch, seq = _largest(steps)
    half = _pruned_half(steps, (batch, seq))
    out = {"batch": batch, "seq": seq}
    if half and half["vs_masked_ratio"] is not None:
        out.update(vs_masked_ratio_50=half["vs_masked_ratio"], step_ratio_50=half["step_ratio"],
                   theoretical_forward_ratio_50=half["theoretical_forward_ratio"], target=TRAIN_STEP_TARGET,
                   meets_target=half["vs_masked_ratio"] >= TRAIN_STEP_TARGET)
    return out


def _runtime_summary(ort: list[dict], enc: list[dict]) -> dict:
    batch, seq = _largest(ort)
    half, torch_half = _pruned_half(ort, (batch, seq)), _pruned_half(enc, (batch, seq))
    out = {"batch": batch, "seq": seq, "max_abs_diff_vs_torch": max(r["max_abs_diff_vs_torch"] for r in ort)}
    if half:
        out["ort_ratio_50"] = half["ort_ratio"]
    if half and torch_half:
        rel = half["ort_ratio"] / torch_half["forward_ratio"] - 1
        out.update(torch_forward_ratio_50=torch_half["forward_ratio"], relative_difference=rel,
                   tolerance=RUNTIME_TOLERANCE, meets_target=abs(rel) <= RUNTIME_TOLERANCE)
    return out


def _decoder_summary(rows: list[dict]) -> dict:
    dense = next(r for r in rows if r["variant"] == "dense")
    pruned = [r for r in rows if r["kind"] == "pruned"]
    entry = {"kv_exact": all(r["kv_ratio"] == r["kv_heads_kept"] / dense["kv_heads_kept"] for r in pruned),
             "dense_attention_share": dense["per_token_attention_share"]}
    half = next((r for r in pruned if r["layout"] == "uniform" and r["sparsity"] == 0.5), None)
    if half:  # bound: only the dense step's attention share shrinks, by the FLOP ratio (Amdahl)
        share, theory = dense["per_token_attention_share"], half["theoretical_attention_ratio"]
        entry.update(per_token_ratio_50=half["per_token_ratio"], kv_ratio_50=half["kv_ratio"],
                     attention_share_50=half["per_token_attention_share"],
                     per_token_bound_50=1 / (1 - share * (1 - 1 / theory)))
    return entry


def write_reports(results: dict, output_dir: str | Path) -> dict[str, Path]:
    """Write bench.json, bench.md and bench.png into `output_dir`; returns their paths."""
    output_dir = Path(output_dir)
    paths = {"json": output_dir / "bench.json", "md": output_dir / "bench.md", "png": output_dir / "bench.png"}
    write_json_atomic(paths["json"], results)
    write_text_atomic(paths["md"], markdown(results))
    plot(results, paths["png"])
    return paths


def markdown(results: dict) -> str:
    """Summary lines, then one table per section. Times are medians [quartiles]; x = dense / variant."""
    lines = ["# headprune-bench", ""]
    meta = results.get("meta", {})
    if meta:
        lines += [f"device: {meta.get('device')}, threads: {meta.get('threads')}, torch {meta.get('torch')}, "
                  f"transformers {meta.get('transformers')}, load average before/after: "
                  f"{meta.get('load_before')} / {meta.get('load_after')}", ""]
    lines += summary_lines(results.get("summary", {}))
    for section, table in (("encoder", _encoder_table), ("train_step", _train_step_table),
                           ("onnxruntime", _runtime_table), ("decoder", _decoder_table)):
        if results.get(section):
            lines += table(results[section]) + [""]
    lines += ["ms: median [first quartile - third quartile] over the timed rounds. x: dense time / variant time "
              "(2.00 = twice as fast); x masked: the masked variant's time at the same sparsity / this one's; "
              "theoretical: dense / variant attention FLOPs (training step: forward FLOPs; matrix products only, zero "
              "weights skipped). KV ratio: variant cache bytes / dense. Attention share: time inside the attention "
              "modules / decode time (separate hooked pass).", ""]
    return "\n".join(lines)


HEADLINE = (("masked", 0.5, "masked"), ("pruned_uniform", 0.25, "pruned (uniform)"),
            ("pruned_uniform", 0.5, "pruned (uniform)"), ("pruned_uniform", 0.75, "pruned (uniform)"),
            ("unstructured_dense", 0.5, "unstructured, dense kernels"),
            ("unstructured_sparse", 0.5, "unstructured, CSR kernels"))


def headline_table(results: dict) -> str:
    """The README's table: at the encoder's largest shape, per variant, the attention sub-layer
    and whole-forward speed-ups with the FLOP limit, ONNX Runtime's forward speed-up and the
    training step against the masked model at the same sparsity (where those sections ran)."""
    enc = results["encoder"]
    shape = _largest(enc)

    def at(section: str, variant: str, sparsity: float) -> dict | None:
        return next((r for r in results.get(section) or [] if (r["batch"], r["seq"]) == shape
                     and r["variant"] == variant and r["sparsity"] == sparsity), None)

    def x(value: float | None, bold: bool = False) -> str:
        return "–" if value is None else (f"**{value:.2f}x**" if bold else f"{value:.2f}x")

    lines = ["| variant | removed | attention sub-layer | theoretical | whole forward | ONNX Runtime forward "
             "| training step vs masked |", "|---|---:|---:|---:|---:|---:|---:|"]
    for variant, sparsity, name in HEADLINE:
        row = at("encoder", variant, sparsity)
        if row is None:
            continue
        removed = f"{sparsity:.0%} of the " + ("weights" if variant.startswith("unstructured") else "heads")
        ort, step = at("onnxruntime", variant, sparsity), at("train_step", variant, sparsity)
        lines.append(f"| {name} | {removed} | {x(row['attention_ratio'], bold=sparsity == 0.5 and variant == 'pruned_uniform')} "
                     f"| {x(row['theoretical_attention_ratio'])} | {x(row['forward_ratio'])} "
                     f"| {x(ort and ort['ort_ratio'])} | {x(step and step['vs_masked_ratio'])} |")
    return "\n".join(lines) + "\n"


def _title(name: str, rows: list[dict]) -> str:
    return name + (f" ({rows[0]['model']})" if rows[0].get("model") else "")


def _table(title: str, rows: list[dict], columns: list[tuple]) -> list[str]:
    """A markdown table under `title`: one (heading, cell(row) -> str, right-aligned) per column."""
    lines = [title, "", "| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "|".join("---:" if c[2] else "---" for c in columns) + "|"]
    return lines + ["| " + " | ".join(c[1](r) for c in columns) + " |" for r in rows]


def _fmt(key: str, spec: str, heading: str | None = None) -> tuple:
    return heading or key, lambda r: format(r[key], spec), True


def _timed(heading: str, key: str) -> tuple:
    return heading, lambda r: _ms(r[key], r[key.removesuffix("_ms") + "_spread_ms"]), True


def _ratio(heading: str, key: str) -> tuple:
    return heading, lambda r: f"{r[key]:.2f}", True


GRID = [("variant", lambda r: r["variant"], False), _fmt("sparsity", ".2f"), _fmt("batch", "d"), _fmt("seq", "d")]


def _encoder_table(enc: list[dict]) -> list[str]:
    return _table(_title("## Encoder", enc), enc, GRID + [
        _timed("forward ms", "forward_ms"), _timed("attention ms", "attention_ms"), _ratio("forward x", "forward_ratio"),
        _ratio("attention x", "attention_ratio"), _ratio("theoretical attention x", "theoretical_attention_ratio")])


def _train_step_table(steps: list[dict]) -> list[str]:
    vs_masked = ("x masked", lambda r: "" if r["vs_masked_ratio"] is None else f"{r['vs_masked_ratio']:.2f}", True)
    return _table(_title("## Training step: forward + backward + AdamW", steps), steps, GRID + [
        _timed("step ms", "step_ms"), ("samples/s", lambda r: f"{r['samples_per_s']:.1f}", True),
        _ratio("x dense", "step_ratio"), vs_masked, _ratio("theoretical x", "theoretical_forward_ratio")])


def _runtime_table(ort: list[dict]) -> list[str]:
    return _table(_title("## ONNX Runtime forward (CPU)", ort), ort, GRID + [
        _timed("ORT ms", "ort_ms"), _ratio("ORT x dense", "ort_ratio"),
        ("max abs diff vs PyTorch", lambda r: f"{r['max_abs_diff_vs_torch']:.1e}", True)])


def _decoder_table(dec: list[dict]) -> list[str]:
    r0 = dec[0]
    title = f"## Decoders (batch {r0['batch']}, prompt {r0['prompt_len']}, {r0['new_tokens']} new tokens)"
    return _table(title, dec, [("model", lambda r: r["model"], False), GRID[0], GRID[1],
                               _timed("prefill ms", "prefill_ms"), _timed("per-token ms", "per_token_ms"),
                               _ratio("prefill x", "prefill_ratio"), _ratio("per-token x", "per_token_ratio"),
                               ("attention share", lambda r: f"{r['per_token_attention_share']:.0%}", True),
                               ("KV bytes", lambda r: f"{r['kv_cache_bytes']:,}", True), _fmt("kv_ratio", ".3f", "KV ratio"),
                               _ratio("theoretical attention x", "theoretical_attention_ratio")])


def plot(results: dict, path: str | Path) -> None:
    """Latency ratio vs sparsity: encoder attention sub-layer (largest grid point) and decoder per-token."""
    enc, dec = results.get("encoder") or [], results.get("decoder") or []
    steps = results.get("train_step") or []
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    if enc:
        batch, seq = results["summary"]["encoder"]["batch"], results["summary"]["encoder"]["seq"]
        rows = [r for r in enc if (r["batch"], r["seq"]) == (batch, seq)]
        _curves(axes[0], rows, "attention_ratio")
        axes[0].set_title(f"encoder attention sub-layer (batch {batch}, seq {seq})")
    if dec:
        for i, model in enumerate(dict.fromkeys(r["model"] for r in dec)):
            _curves(axes[1], [r for r in dec if r["model"] == model], "per_token_ratio", label=f"{model} ",
                    theory=i == 0)
        axes[1].set_title("decoder per-token latency")
    if steps:
        batch, seq = results["summary"]["train_step"]["batch"], results["summary"]["train_step"]["seq"]
        _curves(axes[2], [r for r in steps if (r["batch"], r["seq"]) == (batch, seq)], "step_ratio", theory=False)
        axes[2].set_title(f"training step (batch {batch}, seq {seq})")
    for ax in axes:
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("sparsity (share of heads removed)")
        ax.set_ylabel("speed-up (dense time / variant time)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _curves(ax, rows: list[dict], key: str, label: str = "", theory: bool = True) -> None:
    dense = [r for r in rows if r["variant"] == "dense"]
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "dense"):
        pts = sorted((r["sparsity"], r[key]) for r in dense + [r for r in rows if r["variant"] == variant])
        ax.plot(*zip(*pts), marker="o", label=f"{label}{variant}")
    if not theory:
        return
    for kinds, style, what in ((("pruned",), "--", "pruned"), (("unstructured_dense",), ":", "unstructured")):
        pts = sorted({(r["sparsity"], r["theoretical_attention_ratio"]) for r in rows
                      if r["kind"] == "dense" or (r["kind"] in kinds and r["layout"] in (None, "uniform", "exported"))})
        if len(pts) > 1:
            ax.plot(*zip(*pts), color="black", ls=style, label=f"theoretical attention (FLOPs, {what})")


def summary_lines(s: dict) -> list[str]:
    """The headline numbers of `summary(results)` as markdown bullets, each against its target."""
    lines = []
    enc = s.get("encoder", {})
    if "attention_ratio_50" in enc:
        lines.append(f"- attention sub-layer, 50% heads removed (batch {enc['batch']}, seq {enc['seq']}): "
                     f"{enc['attention_ratio_50']:.2f}x dense (target >= {enc['target']}x: {_met(enc)}, theoretical "
                     f"{enc['theoretical_attention_ratio_50']:.2f}x)")
    if "masked_forward_ratio_50" in enc:
        lines.append(f"- masked, 50% heads: forward {enc['masked_forward_ratio_50']:.2f}x, attention "
                     f"{enc['masked_attention_ratio_50']:.2f}x dense (dense attention IQR "
                     f"{enc['dense_attention_iqr_rel']:.0%} of its median)")
    step = s.get("train_step", {})
    if "vs_masked_ratio_50" in step:
        lines.append(f"- training step, 50% heads removed (batch {step['batch']}, seq {step['seq']}): "
                     f"{step['vs_masked_ratio_50']:.2f}x the masked model's (target >= {step['target']}x: {_met(step)}), "
                     f"{step['step_ratio_50']:.2f}x dense (forward FLOPs {step['theoretical_forward_ratio_50']:.2f}x)")
    ort = s.get("onnxruntime", {})
    if "relative_difference" in ort:
        lines.append(f"- ONNX Runtime forward, 50% heads removed (batch {ort['batch']}, seq {ort['seq']}): "
                     f"{ort['ort_ratio_50']:.2f}x dense, PyTorch {ort['torch_forward_ratio_50']:.2f}x "
                     f"({100 * ort['relative_difference']:+.2f}%, target within {100 * ort['tolerance']:.0f}%: {_met(ort)})")
    for model, d in s.get("decoder", {}).items():
        line = f"- {model}: KV bytes exactly the kept KV-head share: {d['kv_exact']}"
        if "per_token_ratio_50" in d:
            line += (f"; 50% heads: KV ratio {d['kv_ratio_50']:.3f}, per-token decode {d['per_token_ratio_50']:.2f}x "
                     f"dense (bound {d['per_token_bound_50']:.2f}x: attention is {d['dense_attention_share']:.0%} "
                     f"of a dense step, {d['attention_share_50']:.0%} of a pruned one)")
        lines.append(line)
    return lines + ([""] if lines else [])


def _met(block: dict) -> str:
    return "met" if block["meets_target"] else "missed"


def _ms(median: float, spread: dict) -> str:
    return f"{median:.2f} [{spread['q1']:.2f}-{spread['q3']:.2f}]"
