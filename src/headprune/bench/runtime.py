"""ONNX Runtime latency: does the speed-up of head pruning survive the runtime models are served
with? Dense and physically pruned (uniform layout) copies are exported to ONNX
(`headprune.deploy.onnx`), loaded into CPU sessions with `threads` intra-op threads, checked
against PyTorch, and `session.run` is timed for every variant of a shape in one interleaved run.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List

import numpy as np
import torch
from omegaconf import MISSING

from headprune.bench import render
from headprune.report import Column
from headprune.bench.sections import Section, SectionInputs, check_grid, check_sparsities, register
from headprune.bench.variants import Variant
from headprune.costs.timing import Clock, interleaved

log = logging.getLogger(__name__)
RUNTIME_TOLERANCE = 0.10  # ONNX Runtime's forward ratio at 50% heads within 10% of PyTorch's


@dataclass
class RuntimeSettings:
    enabled: bool = MISSING
    batches: List[int] = MISSING
    seqs: List[int] = MISSING
    sparsities: List[float] = MISSING


def bench_onnxruntime(variants: list[Variant], batches: list[int], seqs: list[int], clock: Clock, warmup: int,
                      repeats: int, threads: int, seed: int = 0, model_name: str = "") -> list[dict]:
    """One row per variant and (batch, seq): ONNX Runtime forward latency and its ratio to dense."""
    try:
        from headprune.deploy.onnx import check_onnx, export_onnx, input_names, onnx_session
    except ImportError as err:
        raise ImportError(f"bench.onnxruntime needs the onnx extra: pip install \"headprune[onnx]\" ({err}); or set "
                          "bench.onnxruntime.enabled=false") from None
    rows = []
    with tempfile.TemporaryDirectory(prefix="headprune-onnx-") as folder:
        sessions, checks = [], []
        for i, v in enumerate(variants):
            path = export_onnx(v.model, Path(folder) / f"{i}.onnx")
            checks.append(check_onnx(v.model, path)["max_abs_diff"])
            sessions.append(onnx_session(path, threads))
            log.info("onnxruntime: exported %s (max |ORT - torch| %.2g)", v.name, checks[-1])
        names = input_names(variants[0].model)
        vocab = variants[0].model.config.vocab_size
        for batch in batches:
            for seq in seqs:
                g = torch.Generator().manual_seed(seed)
                ids = torch.randint(0, vocab, (batch, seq), generator=g).numpy()
                feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
                feed = {k: feed[k] for k in names}
                cases = {str(i): (lambda s=s: s.run(None, feed)) for i, s in enumerate(sessions)}
                log.info("onnxruntime batch=%d seq=%d: timing %d variants", batch, seq, len(variants))
                stats = interleaved(cases, clock, warmup=warmup, repeats=repeats)
                for i, v in enumerate(variants):
                    st = stats[str(i)]
                    rows.append({"model": model_name, **v.row(), "batch": batch, "seq": seq, "ort_ms": st.median_ms,
                                 "ort_ratio": stats["0"].median_ms / st.median_ms, "ort_spread_ms": st.spread(),
                                 "max_abs_diff_vs_torch": checks[i], "heads_kept": sum(v.heads), "repeats": st.n,
                                 "threads": threads})
    return rows


def run(inputs: SectionInputs) -> list[dict]:
    settings = inputs.bench.onnxruntime
    name, variants = inputs.encoder_variants({"pruned": list(settings.sparsities)}, ["uniform"])
    return bench_onnxruntime(variants, list(settings.batches), list(settings.seqs), inputs.clock, model_name=name,
                             threads=inputs.bench.threads, **inputs.rounds)


def applies(inputs: SectionInputs) -> bool:
    """CPU sessions of an encoder: not on a GPU run, nor for an exported causal LM."""
    return inputs.device.type == "cpu" and not inputs.exported_is_lm


def check(settings, bench) -> None:
    check_grid("onnxruntime", settings)
    check_sparsities("bench.onnxruntime.sparsities", settings.sparsities)


def summary(rows: list[dict], results: dict) -> dict:
    """At the largest shape: ONNX Runtime's forward speed-up at 50% heads against PyTorch's (encoder rows)."""
    batch, seq = render.largest(rows)
    half = render.pruned_half(rows, (batch, seq))
    torch_half = render.pruned_half(results.get("encoder") or [], (batch, seq))
    out = {"batch": batch, "seq": seq, "max_abs_diff_vs_torch": max(r["max_abs_diff_vs_torch"] for r in rows)}
    if half:
        out["ort_ratio_50"] = half["ort_ratio"]
    if half and torch_half:
        rel = half["ort_ratio"] / torch_half["forward_ratio"] - 1
        out.update(torch_forward_ratio_50=torch_half["forward_ratio"], relative_difference=rel,
                   tolerance=RUNTIME_TOLERANCE, meets_target=abs(rel) <= RUNTIME_TOLERANCE)
    return out


def summary_lines(ort: dict) -> list[str]:
    if "relative_difference" not in ort:
        return []
    return [f"- ONNX Runtime forward, 50% heads removed (batch {ort['batch']}, seq {ort['seq']}): "
            f"{ort['ort_ratio_50']:.2f}x dense, PyTorch {ort['torch_forward_ratio_50']:.2f}x "
            f"({100 * ort['relative_difference']:+.2f}%, target within {100 * ort['tolerance']:.0f}%: "
            f"{render.met(ort)})"]


def table(rows: list[dict]) -> list[str]:
    return render.table(render.title("## ONNX Runtime forward (CPU)", rows), rows, render.GRID + [
        render.timed("ORT ms", "ort_ms"), render.ratio("ORT x dense", "ort_ratio"),
        Column("max abs diff vs PyTorch", lambda r: f"{r['max_abs_diff_vs_torch']:.1e}", True)])


SECTION = register(Section("onnxruntime", RuntimeSettings, run, table, summary, summary_lines, check=check,
                           applies=applies))
