"""A written GGUF file run in llama.cpp against the PyTorch model it came from (`headprune-export
--gguf FILE --check`), as `--onnx` checks its graph against ONNX Runtime.

llama.cpp is loaded as users serve it (flash attention, its default F16 KV cache, 1 thread) on
token windows (seeded random ids, or a text's tokens: headprune-export cuts them), and its logits compared with PyTorch's
float32 logits on the same windows:

- `gguf_bytes`: the file's size;
- `pytorch_ppl`, `gguf_ppl`: exp(mean next-token NLL) over the windows, each from its own logits
  with the same formula (`llamacpp.perplexity`), and `ppl_change` = gguf_ppl / pytorch_ppl - 1;
- the agreement figures of `deploy/onnx.agreement` (`max_abs_diff`, `rel_diff`,
  `argmax_agreement`, `min_top2_margin`) over every position;
- `kv_exact`: llama.cpp's cache holds, per layer, the K/V bytes per token the layout predicts.

A check passes when |ppl_change| <= `max_ppl_change`, argmax_agreement >= `min_argmax` and
kv_exact holds. The
absolute logit difference is reported, not judged: llama.cpp's flash attention rounds to F16 on
CPU whatever the weights (dense SmolLM2, F32 weights: max |difference| 5.5e-2 with it), and Q8_0
weights move logits by units. The defaults pass every file those experiments measured on 8 x 512
held-out Tiny Shakespeare tokens (experiments/llm_kv/decode/llamacpp/agreement.json: SmolLM2 and
two exports, argmax agreement >= 0.998 in F16 and 0.945-0.961 in Q8_0; experiments/llm_uneven/
gguf.json: eleven exports, perplexity change -0.02% to +0.01% in F16, up to +2.02% in Q8_0) and
fail a file whose layout or weights are wrong (another model's weights: tests/test_gguf_check.py).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from headprune.deploy import llamacpp
from headprune.deploy.gguf_export import gguf_layout
from headprune.deploy.onnx import agreement

MAX_PPL_CHANGE = 0.05
MIN_ARGMAX = 0.9


def random_windows(vocab_size: int, seq: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` windows of `seq` seeded random token ids below `vocab_size`."""
    ids = torch.randint(0, vocab_size, (count, seq), generator=torch.Generator().manual_seed(seed))  # (N, T)
    return ids.tolist()


@torch.no_grad()
def check_gguf(model: nn.Module, path: str | Path, windows: list[list[int]], threads: int = 1,
               exact: bool = False) -> dict:
    """llama.cpp on the GGUF `path` against `model` (float32) on `windows` (module docstring), and
    `kv_exact`: the K/V bytes per token llama.cpp's cache holds per layer equal the layout's
    (`GGUFLayout.kv_bytes_per_token`, F16 cache). `exact`: also the figures without flash
    attention on an F32 cache (`exact`: the export's own exactness, judged by nothing)."""
    path = Path(path)
    want = [model(torch.tensor([w])).logits[0].double().cpu().numpy() for w in windows]  # (T, V) each
    n_ctx = max(len(w) for w in windows)
    loaded = llamacpp.load(path, n_ctx=n_ctx, threads=threads)
    try:
        got = [llamacpp.logits(loaded, w) for w in windows]  # (T, V) each
        held = llamacpp.kv_rows(loaded).per_token
    finally:
        loaded.close()
    predicted = gguf_layout(model).kv_bytes_per_token(llamacpp.CACHE_TYPES["f16"][1])
    figures = {"gguf_bytes": path.stat().st_size, "windows": len(windows), "seq": len(windows[0]),
               "served_as": "llama.cpp, flash attention, F16 KV cache", "threads": threads,
               **_compare(got, want, windows), "kv_bytes_per_token": held, "kv_exact": held == predicted}
    if exact:
        loaded = llamacpp.load(path, n_ctx=n_ctx, threads=threads, cache="f32", flash_attn=False)
        try:
            figures["exact"] = {"served_as": "llama.cpp, no flash attention, F32 KV cache",
                                **_compare([llamacpp.logits(loaded, w) for w in windows], want, windows)}
        finally:
            loaded.close()
    return figures


def _compare(got: list[np.ndarray], want: list[np.ndarray], windows: list[list[int]]) -> dict:
    """Both perplexities, their change and the agreement figures of llama.cpp's logits `got`
    against PyTorch's `want` ((T, V) per window)."""
    torch_ppl, gguf_ppl = llamacpp.perplexity(want, windows), llamacpp.perplexity(got, windows)
    change = gguf_ppl / torch_ppl - 1
    return {"pytorch_ppl": torch_ppl, "gguf_ppl": gguf_ppl, "ppl_change": change if math.isfinite(change) else None,
            **agreement(torch.from_numpy(np.concatenate(got)), torch.from_numpy(np.concatenate(want)))}


def judge_gguf(figures: dict, max_ppl_change: float = MAX_PPL_CHANGE, min_argmax: float = MIN_ARGMAX) -> list[str]:
    """The bounds `figures` (from `check_gguf`) break, one line each; empty when it passes."""
    failures = []
    change, argmax = figures.get("ppl_change"), figures["argmax_agreement"]
    if change is None or not abs(change) <= max_ppl_change:
        failures.append(f"perplexity {figures['gguf_ppl']:.4g} in llama.cpp against {figures['pytorch_ppl']:.4g} in "
                        f"PyTorch (change {change}) exceeds --gguf-max-ppl-change {max_ppl_change:g}")
    if not argmax >= min_argmax:
        failures.append(f"argmax_agreement {argmax:.4f} over {figures['positions']} positions is below "
                        f"--gguf-min-argmax {min_argmax:g}")
    if figures.get("kv_exact") is False:
        failures.append(f"llama.cpp's cache holds {figures['kv_bytes_per_token']} K/V bytes per token per layer, "
                        "not what the layout predicts")
    return failures
