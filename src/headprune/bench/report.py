"""bench.json, bench.md and bench.png from the sections' rows, the headline summary and the README's
table. Every section renders its own rows (bench/sections.py); this module loops over them."""
from __future__ import annotations

from pathlib import Path

from headprune.atomic import write_json_atomic, write_text_atomic
from headprune.bench.render import largest
from headprune.bench.sections import SECTIONS
from headprune.plots import plt


def summary(results: dict) -> dict:
    """Each section's headline block (for sections with rows): the encoder's attention speed-up at
    50% heads and masked vs dense, the training step and ONNX Runtime at 50% heads, and per decoder
    KV-cache exactness and per-token decode speed-up."""
    return {name: section.summary(results[name], results) for name, section in SECTIONS.items() if results.get(name)}


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
                  f"{meta.get('load_before')} / {meta.get('load_after')}"
                  + (f", commit {meta['commit']}" if meta.get("commit") else ""), ""]
    lines += summary_lines(results.get("summary", {}))
    for name, section in SECTIONS.items():
        if results.get(name):
            lines += section.table(results[name]) + [""]
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
    shape = largest(enc)

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


def plot(results: dict, path: str | Path) -> None:
    """One panel per section that has one and ran: speed-up vs sparsity next to the FLOP limits
    (encoder attention sub-layer at its largest shape, decoder per-token, training step), and the
    pretrained decoder's per-token speed-up vs prompt length next to its bound."""
    panels = sorted((s for s in SECTIONS.values() if s.panel is not None and results.get(s.name)),
                    key=lambda s: s.panel)  # only sections that ran: no empty panels
    n = max(len(panels), 1)
    fig, axes = plt.subplots(1, n, figsize=(16 * n / 3, 4.2), squeeze=False)
    axes = axes[0]
    for ax, section in zip(axes, panels):
        section.plot(ax, results[section.name], results["summary"][section.name])
    for ax in axes:
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel(ax.get_xlabel() or "sparsity (share of heads removed)")
        ax.set_ylabel(ax.get_ylabel() or "speed-up (dense time / variant time)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_lines(s: dict) -> list[str]:
    """The headline numbers of `summary(results)` as markdown bullets, each against its target."""
    lines = [line for name, section in SECTIONS.items() if name in s for line in section.summary_lines(s[name])]
    return lines + ([""] if lines else [])
