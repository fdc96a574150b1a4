"""ONNX Runtime latency: does the speed-up of head pruning survive the runtime models are served
with? Dense and physically pruned (uniform layout) copies are exported to ONNX
(`headprune.deploy.onnx`), loaded into CPU sessions with `threads` intra-op threads, checked
against PyTorch, and `session.run` is timed for every variant of a shape in one interleaved run.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import torch

from headprune.costs.timing import Clock, interleaved
from headprune.bench.variants import Variant

log = logging.getLogger(__name__)


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
