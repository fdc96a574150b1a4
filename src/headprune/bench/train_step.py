"""Training-step latency: forward + backward + AdamW step, what fine-tuning between rounds costs.

For each (batch, seq) every variant (dense, masked, physically pruned) is timed in one
interleaved run, in train mode (dropout on), on random token ids with random labels; each
variant has its own AdamW optimizer (lr 1e-6, so many steps change nothing that matters for
timing). The headline is pruned vs masked at the same sparsity: what `pruning.physical` buys
each fine-tuning epoch of an iterative run over keeping the heads masked.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from headprune.bench import render
from headprune.report import Column
from headprune.bench.encoder import _dims, _flops
from headprune.bench.sections import GridSettings, Section, SectionInputs, check_grid, check_variants, kinds, register
from headprune.bench.variants import Variant
from headprune.costs.flops import ratio
from headprune.costs.timing import Clock, interleaved

log = logging.getLogger(__name__)
TRAIN_STEP_TARGET = 1.25  # training step at 50% of the heads, pruned vs masked


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> None:
    """One optimizer step on `batch` (a model computing its own loss from `labels`)."""
    with torch.enable_grad():
        model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bench_train_step(variants: list[Variant], batches: list[int], seqs: list[int], clock: Clock, warmup: int,
                     repeats: int, seed: int = 0, model_name: str = "") -> list[dict]:
    """One row per variant and (batch, seq): step latency, samples/s, ratios to dense and to the
    masked variant of the same sparsity, and the theoretical (forward FLOPs) ratio."""
    config = variants[0].model.config
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len is not None and max(seqs) > max_len:
        raise ValueError(f"bench.train_step.seqs contains {max(seqs)}; allowed: at most the model's "
                         f"max_position_embeddings={max_len}")
    device = next(variants[0].model.parameters()).device
    dims = _dims(variants[0].model)
    optimizers = [torch.optim.AdamW(v.model.parameters(), lr=1e-6) for v in variants]
    for v in variants:
        v.model.train()
    rows = []
    try:
        for batch in batches:
            for seq in seqs:
                g = torch.Generator().manual_seed(seed)
                inputs = {"input_ids": torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device),
                          "labels": torch.randint(0, config.num_labels, (batch,), generator=g).to(device)}
                cases = {f"{i}": lambda m=v.model, o=opt: train_step(m, o, inputs)
                         for i, (v, opt) in enumerate(zip(variants, optimizers))}
                log.info("train step batch=%d seq=%d: timing %d variants", batch, seq, len(variants))
                stats = interleaved(cases, clock, warmup=warmup, repeats=repeats)
                masked_at = {v.sparsity: stats[f"{i}"].median_ms for i, v in enumerate(variants) if v.kind == "masked"}
                flops = [_flops(v, batch, seq, dims)[1] for v in variants]
                for i, v in enumerate(variants):
                    step = stats[f"{i}"]
                    masked = masked_at.get(v.sparsity) if v.kind == "pruned" else None
                    rows.append({
                        "model": model_name, **v.row(), "batch": batch, "seq": seq,
                        "step_ms": step.median_ms, "samples_per_s": batch * 1e3 / step.median_ms,
                        "step_ratio": stats["0"].median_ms / step.median_ms,
                        "vs_masked_ratio": masked / step.median_ms if masked else None,
                        "theoretical_forward_ratio": ratio(flops[0], flops[i]),
                        "step_spread_ms": step.spread(), "heads_kept": sum(v.heads), "repeats": step.n,
                    })
    finally:
        for v in variants:
            v.model.eval()
    return rows


def run(inputs: SectionInputs) -> list[dict]:
    settings = inputs.bench.train_step
    name, variants = inputs.encoder_variants(kinds(settings), list(inputs.bench.layouts))
    return bench_train_step(variants, list(settings.batches), list(settings.seqs), inputs.clock, model_name=name,
                            **inputs.rounds)


def check(settings, bench) -> None:
    check_variants("train_step", settings)
    check_grid("train_step", settings)
    unknown = set(settings.variants) - {"masked", "pruned"}
    if unknown:
        raise ValueError(f"bench.train_step.variants: {sorted(unknown)} are not allowed; allowed: masked, pruned")


def summary(rows: list[dict], results: dict) -> dict:
    """At the largest shape: the step at 50% heads removed vs masked, against its target."""
    batch, seq = render.largest(rows)
    half = render.pruned_half(rows, (batch, seq))
    out = {"batch": batch, "seq": seq}
    if half and half["vs_masked_ratio"] is not None:
        out.update(vs_masked_ratio_50=half["vs_masked_ratio"], step_ratio_50=half["step_ratio"],
                   theoretical_forward_ratio_50=half["theoretical_forward_ratio"], target=TRAIN_STEP_TARGET,
                   meets_target=half["vs_masked_ratio"] >= TRAIN_STEP_TARGET)
    return out


def summary_lines(step: dict) -> list[str]:
    if "vs_masked_ratio_50" not in step:
        return []
    return [f"- training step, 50% heads removed (batch {step['batch']}, seq {step['seq']}): "
            f"{step['vs_masked_ratio_50']:.2f}x the masked model's (target >= {step['target']}x: {render.met(step)}), "
            f"{step['step_ratio_50']:.2f}x dense (forward FLOPs {step['theoretical_forward_ratio_50']:.2f}x)"]


def table(rows: list[dict]) -> list[str]:
    vs_masked = Column("x masked", lambda r: "" if r["vs_masked_ratio"] is None else f"{r['vs_masked_ratio']:.2f}", True)
    return render.table(render.title("## Training step: forward + backward + AdamW", rows), rows, render.GRID + [
        render.timed("step ms", "step_ms"), Column("samples/s", lambda r: f"{r['samples_per_s']:.1f}", True),
        render.ratio("x dense", "step_ratio"), vs_masked, render.ratio("theoretical x", "theoretical_forward_ratio")])


def plot(ax, rows: list[dict], block: dict) -> None:
    batch, seq = block["batch"], block["seq"]
    render.curves(ax, [r for r in rows if (r["batch"], r["seq"]) == (batch, seq)], "step_ratio", theory=False)
    ax.set_title(f"training step (batch {batch}, seq {seq})")


SECTION = register(Section("train_step", GridSettings, run, table, summary, summary_lines, check=check, plot=plot,
                           panel=2))
