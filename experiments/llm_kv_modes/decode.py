"""Decode speed and the cache held of KV-mode exports against the dense model, and the bound.

    python experiments/llm_kv_modes/decode.py ../llmruns/llm_kv_modes/<arm>/export [...] \
        [--contexts 4096 8192] [--new-tokens 16] [--repeats 5] [--device cuda --out decode_h200.json]

For each context: one prompt of `context - new_tokens` seeded random token ids (batch 1); each
model (the dense origin, then each export loaded as a user loads it: `load_pruned`, its windows
attached) prefills it once, untimed, into generate()'s kind of cache; then, interleaved
(`costs.timing.interleaved`: every model once per round, the order rotated), `new_tokens` greedy
steps from a fresh copy of that cache (the copy untimed). Per model: median ms per token,
speed-up over dense, the bytes the cache holds after the prefill (`costs.kv_bytes.cache_bytes`) and
its share of dense's, and the bound: Amdahl with the dense decode's attention share (a hooked
pass, `bench.decoder.attention_share`) and the export's attention FLOPs over the same steps, a
windowed unit's heads attending to at most sink + window keys (`costs.flops.attention_flops`).
Writes decode.json beside this script, or `--out` (one entry per context and model, replacing an
earlier entry of the same pair; device, threads, load average). `--device cuda`: every model and
the prompt on the GPU, timed with CUDA events, float32 as on CPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import torch

from headprune.bench.decoder import attention_share, decode, prefill
from headprune.bench.origin import load_dense, origin_of
from headprune.costs.flops import attention_flops
from headprune.costs.kv_bytes import cache_bytes
from headprune.costs.timing import Case, Clock, interleaved
from headprune.deploy.hf import load_pruned
from headprune.heads.adapters import get_adapter
from headprune.heads.windows import KV_LAYOUT_ATTR

HERE = Path(__file__).resolve().parent


def decode_flops(model, context: int, new_tokens: int) -> float:
    """Attention FLOPs of `new_tokens` decode steps after a prompt of `context - new_tokens`
    tokens: per layer, the kept full units' heads over every key, the windowed units' heads over
    at most sink + window keys (what their cache holds), removed units none."""
    adapter, config = get_adapter(model), model.config
    head_dim, hidden = adapter.head_dim(config), config.hidden_size
    heads = adapter.num_heads(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    group = heads // kv_heads
    layout = getattr(model, KV_LAYOUT_ATTR, None)
    modes = layout.modes if layout is not None else [("full",) * kv_heads] * config.num_hidden_layers
    kept = layout.kept if layout is not None else None
    total = 0.0
    for i in range(new_tokens):
        keys = context - new_tokens + i + 1
        for layer in modes:
            full, window = layer.count("full"), layer.count("window")
            if full:
                total += attention_flops(1, 1, keys, full * group, full, head_dim, hidden)
            if window:
                total += attention_flops(1, 1, min(keys, kept), window * group, window, head_dim, hidden)
    return total


def measure(exports: list[Path], context: int, new_tokens: int, repeats: int,
            device: torch.device = torch.device("cpu")) -> list[dict]:
    models = [load_pruned(e).eval().to(device) for e in exports]
    origin = origin_of(str(exports[0]), None, "export")
    dense = load_dense(origin, models[0], str(exports[0]), device, torch.float32).eval()
    names = ["dense", *[e.parent.name for e in exports]]
    every = [dense, *models]
    prompt = torch.randint(0, dense.config.vocab_size, (1, context - new_tokens),
                           generator=torch.Generator().manual_seed(0)).to(device)  # (1, T)
    with torch.no_grad():
        starts = [prefill(m, prompt) for m in every]  # (cache, next token) per model
    held = [cache_bytes(cache) for cache, _ in starts]
    clock = Clock(device)
    cases = {name: Case(run=lambda state, m=m: decode(m, *state, new_tokens),
                        setup=lambda s=s: (copy.deepcopy(s[0]), s[1]))
             for name, m, s in zip(names, every, starts)}
    stats = interleaved(cases, clock, warmup=1, repeats=repeats)
    share = attention_share(dense, lambda: (copy.deepcopy(starts[0][0]), starts[0][1]), new_tokens, clock, repeats)
    work = [decode_flops(m, context, new_tokens) for m in every]
    rows = []
    for i, (name, m) in enumerate(zip(names, every)):
        step = stats[name].scaled(new_tokens)
        kept = work[i] / work[0]
        bound = 1 / (1 - share * (1 - kept))
        speedup = stats["dense"].median_ms / stats[name].median_ms
        rows.append({"model": name, "context": context, "new_tokens": new_tokens, "per_token_ms": step.median_ms,
                     "per_token_spread_ms": step.spread(), "speedup": speedup, "dense_attention_share": share,
                     "kept_attention_work": kept, "bound": bound, "ratio_to_bound": speedup / bound,
                     "held_bytes": held[i], "held_share": held[i] / held[0], "repeats": step.n,
                     "device": device_name(device), "threads": torch.get_num_threads(), "load_average_end": list(os.getloadavg())})
        print(json.dumps(rows[-1]))
    return rows


def device_name(device: torch.device) -> str:
    """'cpu', or the GPU's name (e.g. 'NVIDIA H200')."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", type=Path, nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default="decode.json", help="file name beside this script")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU visible to torch")
    out = HERE / args.out
    rows = json.loads(out.read_text()) if out.is_file() else []
    for context in args.contexts:
        new = measure(args.exports, context, args.new_tokens, args.repeats, device)
        taken = {(r["model"], r["context"]) for r in new}
        rows = [r for r in rows if (r["model"], r["context"]) not in taken] + new
        out.write_text(json.dumps(rows, indent=1) + "\n")  # after each context: a later one may be stopped


if __name__ == "__main__":
    main()
