"""Encoder latency: the whole forward and the attention sub-layer alone, over a batch x seq grid.

The attention sub-layer (Q/K/V projections, scores, weighted sum, output projection) is timed
by replay. One untimed forward of each variant records, with forward pre-hooks, the exact
inputs of every layer's attention core and, where it sits outside the core, of its output
projection (BERT: `BertSelfAttention`, then `output.dense`). The timed call replays those calls
layer after layer on the recorded hidden states: the attention work of one forward without
feed-forward blocks, embeddings, the rest of the model's Python, or BERT's residual LayerNorm
(a (B, T, hidden) pass that no head owns; it stays in the whole-forward time). The masked
variant's HeadMask hook runs on the replayed output projection, as in a real forward.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from headprune.bench import render
from headprune.bench.sections import GridSettings, Section, SectionInputs, check_grid, check_variants, kinds, register
from headprune.bench.variants import Variant
from headprune.costs.flops import ffn_flops, model_attention_flops, ratio
from headprune.costs.replay import record_attention_calls, replay
from headprune.costs.timing import Clock, interleaved
from headprune.heads.adapters import get_adapter

log = logging.getLogger(__name__)
ATTENTION_TARGET = 1.85  # attention sub-layer speed-up wanted at 50% of the heads removed


def bench_encoder(variants: list[Variant], batches: list[int], seqs: list[int], clock: Clock, warmup: int,
                  repeats: int, seed: int = 0, model_name: str = "") -> list[dict]:
    """One row per variant and (batch, seq); every variant of a grid point is timed in one interleaved run."""
    config = variants[0].model.config
    dims = _dims(variants[0].model)
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len is not None and max(seqs) > max_len:
        raise ValueError(f"bench.encoder.seqs contains {max(seqs)}; allowed: at most the model's "
                         f"max_position_embeddings={max_len}")
    device = next(variants[0].model.parameters()).device
    rows = []
    for batch in batches:
        for seq in seqs:
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)  # (B, T)
            cases = {}
            for i, v in enumerate(variants):
                calls = record_attention_calls(v.model, ids)
                cases[f"{i}:forward"] = lambda m=v.model: m(input_ids=ids)
                cases[f"{i}:attention"] = lambda c=calls: replay(c)
            log.info("encoder batch=%d seq=%d: timing %d variants x (forward, attention)", batch, seq, len(variants))
            stats = interleaved(cases, clock, warmup=warmup, repeats=repeats)
            del cases
            flops = [_flops(v, batch, seq, dims) for v in variants]
            dense_fwd, dense_attn = stats["0:forward"], stats["0:attention"]
            for i, v in enumerate(variants):
                fwd, attn = stats[f"{i}:forward"], stats[f"{i}:attention"]
                rows.append({
                    "model": model_name, **v.row(), "batch": batch, "seq": seq,
                    "forward_ms": fwd.median_ms, "attention_ms": attn.median_ms,
                    "forward_ratio": dense_fwd.median_ms / fwd.median_ms,
                    "attention_ratio": dense_attn.median_ms / attn.median_ms,
                    "theoretical_attention_ratio": ratio(flops[0][0], flops[i][0]),
                    "theoretical_forward_ratio": ratio(flops[0][1], flops[i][1]),
                    "throughput_seq_s": batch * 1e3 / fwd.median_ms,
                    "forward_spread_ms": fwd.spread(), "attention_spread_ms": attn.spread(),
                    "heads_kept": sum(v.heads), "repeats": fwd.n,
                })
    return rows


def _dims(model: nn.Module) -> dict:
    adapter, config = get_adapter(model), model.config
    hidden = getattr(config, "hidden_size", None) or config.dim
    intermediate = getattr(config, "intermediate_size", None) or config.hidden_dim
    return {"head_dim": adapter.head_dim(config), "hidden": hidden, "intermediate": intermediate}


def _flops(v: Variant, batch: int, seq: int, dims: dict) -> tuple[float, float]:
    """(attention FLOPs, forward FLOPs = attention + feed-forward) of one forward of `v`."""
    attention = model_attention_flops(batch, seq, seq, v.heads, v.kv_heads, dims["head_dim"], dims["hidden"],
                                      v.densities)
    return attention, attention + len(v.heads) * ffn_flops(batch, seq, dims["hidden"], dims["intermediate"])


def run(inputs: SectionInputs) -> list[dict]:
    settings = inputs.bench.encoder
    name, variants = inputs.encoder_variants(kinds(settings), list(inputs.bench.layouts))
    return bench_encoder(variants, list(settings.batches), list(settings.seqs), inputs.clock, model_name=name,
                         **inputs.rounds)


def check(settings, bench) -> None:
    check_variants("encoder", settings)
    check_grid("encoder", settings)


def summary(rows: list[dict], results: dict) -> dict:
    """At the largest shape: the attention speed-up at 50% heads against its target, masked vs dense."""
    batch, seq = render.largest(rows)
    at = {(r["variant"], r["sparsity"]): r for r in rows if (r["batch"], r["seq"]) == (batch, seq)}
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


def summary_lines(enc: dict) -> list[str]:
    lines = []
    if "attention_ratio_50" in enc:
        lines.append(f"- attention sub-layer, 50% heads removed (batch {enc['batch']}, seq {enc['seq']}): "
                     f"{enc['attention_ratio_50']:.2f}x dense (target >= {enc['target']}x: {render.met(enc)}, "
                     f"theoretical {enc['theoretical_attention_ratio_50']:.2f}x)")
    if "masked_forward_ratio_50" in enc:
        lines.append(f"- masked, 50% heads: forward {enc['masked_forward_ratio_50']:.2f}x, attention "
                     f"{enc['masked_attention_ratio_50']:.2f}x dense (dense attention IQR "
                     f"{enc['dense_attention_iqr_rel']:.0%} of its median)")
    return lines


def table(rows: list[dict]) -> list[str]:
    return render.table(render.title("## Encoder", rows), rows, render.GRID + [
        render.timed("forward ms", "forward_ms"), render.timed("attention ms", "attention_ms"),
        render.ratio("forward x", "forward_ratio"), render.ratio("attention x", "attention_ratio"),
        render.ratio("theoretical attention x", "theoretical_attention_ratio")])


def plot(ax, rows: list[dict], block: dict) -> None:
    batch, seq = block["batch"], block["seq"]
    render.curves(ax, [r for r in rows if (r["batch"], r["seq"]) == (batch, seq)], "attention_ratio")
    ax.set_title(f"encoder attention sub-layer (batch {batch}, seq {seq})")


SECTION = register(Section("encoder", GridSettings, run, table, summary, summary_lines, check=check, plot=plot,
                           panel=0))
