"""Decode in llama.cpp, the engine CPU users serve with: the dense model against its pruned exports,
each written as a GGUF (deploy/gguf_export.py) and run by llama-cpp-python, with bench.llm's bound
and KV-bytes columns.

Per thread count and context length (bench.llamacpp.contexts):
- every GGUF gets one untimed prefill of the same random `context`-token prompt;
- then one interleaved run (costs.timing) of every model: `new_tokens` single-token decode steps
  from that cache (llama.cpp drops the steps' cells before each round); per-token = that time /
  new_tokens, tokens/s = 1000 / per-token ms;
- bound: llama.cpp's own attention share of a dense decode step, measured with a probe GGUF that
  is the dense model with every layer's attention removed but one KV group of layer 0 (llama.cpp
  needs layer 0's heads): share = (dense - probe) / (dense * (1 - probe's kept attention work));
  `kept` = the export's attention FLOPs over the same steps / the dense model's (costs.flops);
  Amdahl: bound = 1 / (1 - share * (1 - kept)), as in bench.llm;
- KV bytes: the per-layer K/V row bytes llama.cpp serialises for the prompt's cells (deploy/
  llamacpp.py `kv_rows`) times the context; `kv_exact`: every layer's rows equal the layout's
  prediction (F16 cache, flash attention); `kv_allocated_mib`: what llama.cpp logged allocating.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List

import numpy as np
from omegaconf import MISSING

from headprune.bench import render
from headprune.report import Column
from headprune.bench.origin import export_name, load_dense
from headprune.bench.sections import Section, register
from headprune.costs.flops import model_attention_flops
from headprune.costs.timing import Case, interleaved
from headprune.deploy.gguf_export import WEIGHT_TYPES, GGUFLayout, save_gguf
from headprune.deploy.hf import load_pruned
from headprune.heads.adapters import get_adapter, head_layout
from headprune.heads.surgery import prune_heads

log = logging.getLogger(__name__)
TOLERANCE = 0.05  # target: per-token speed-up at the longest context within 5% of its bound


@dataclass
class LlamaCppSettings:
    enabled: bool = MISSING
    pruned_dirs: List[str] = MISSING  # save_pruned folders; [] -> bench.llm.pruned_dirs, else [bench.pruned_dir]
    weights: str = MISSING  # GGUF weight type: f32 | f16 | q8_0
    contexts: List[int] = MISSING  # prompt tokens in the cache before the timed steps
    threads: List[int] = MISSING
    new_tokens: int = MISSING  # decode steps per timed round


def exports(bench) -> list[str]:
    own = list(bench.llamacpp.pruned_dirs)
    return own or list(bench.llm.pruned_dirs) or ([bench.pruned_dir] if bench.pruned_dir else [])


def _origin(bench) -> str:
    from headprune.bench.origin import origin_of

    found = {d: origin_of(d, bench.dense_model) for d in exports(bench)}
    if len(set(found.values())) > 1:
        raise ValueError(f"bench.llamacpp.pruned_dirs come from different dense models ({found}); allowed: exports "
                         "of one model (or name it: bench.dense_model=<name or folder>)")
    return next(iter(found.values()))


@dataclass
class _Model:
    name: str
    kind: str
    gguf: Path
    layout: GGUFLayout
    bytes: int
    hidden: int
    pruned_dir: str | None = None


def probe_of(dense) -> None:
    """In place: every layer's attention removed but layer 0's first KV group."""
    adapter = get_adapter(dense)
    group = adapter.group_size(dense.config)
    layout = head_layout(dense)
    prune_heads(dense, {i: [h for h in kept if i > 0 or h >= group] for i, kept in enumerate(layout)})


def write_ggufs(inputs, folder: Path) -> list[_Model]:
    """The dense model, each export and the probe as GGUF files in `folder` (dense first, probe last)."""
    from transformers import AutoTokenizer

    from headprune.models.build import resolve_pretrained
    from headprune.models.gguf import gguf_source

    bench, dirs = inputs.bench, exports(inputs.bench)
    origin = _origin(bench)
    source = gguf_source(origin)
    tokenizer = None if source else AutoTokenizer.from_pretrained(resolve_pretrained(origin))
    models = [(d, load_pruned(d).eval()) for d in dirs]
    import torch

    dense = load_dense(origin, models[0][1], dirs[0], torch.device("cpu"), torch.float32)
    out = []

    def write(model, name: str, kind: str, pruned_dir: str | None = None) -> None:
        saved = save_gguf(model, folder / f"{name}.gguf", tokenizer=tokenizer, source_gguf=source,
                          weights=bench.llamacpp.weights, overwrite=True, name=name)
        out.append(_Model(name, kind, saved.path, saved.layout, saved.bytes, int(model.config.hidden_size), pruned_dir))

    write(dense, "dense", "dense")
    for d, model in models:
        write(model, export_name(d), "pruned", d)
    probe_of(dense)
    write(dense, "attention_probe", "probe")
    return out


def run(inputs) -> list[dict]:
    from headprune.deploy import llamacpp

    settings = inputs.bench.llamacpp
    folder = Path(inputs.cfg.paths.output_dir) / "llamacpp"
    models = write_ggufs(inputs, folder)
    longest = max(settings.contexts) + settings.new_tokens
    system = llamacpp.system_info()
    rows = []
    for threads in settings.threads:
        loaded = [llamacpp.load(m.gguf, n_ctx=longest, threads=threads, logits_all=False) for m in models]
        try:
            for context in settings.contexts:
                rows += _at_context(inputs, models, loaded, context, threads, system)
        finally:
            for item in loaded:
                item.close()
    return rows


def _at_context(inputs, models: list[_Model], loaded: list, context: int, threads: int, system: str) -> list[dict]:
    from headprune.deploy import llamacpp

    s, rounds = inputs.bench.llamacpp, inputs.rounds
    g = np.random.default_rng(rounds["seed"])
    vocab = loaded[0].llm.n_vocab()
    prompt = [int(t) for t in g.integers(0, vocab, context)]
    steps = [int(t) for t in g.integers(0, vocab, s.new_tokens)]
    kv = []
    for item in loaded:
        item.llm.reset()
        item.llm.eval(prompt)  # untimed prefill
        kv.append(llamacpp.kv_rows(item))

    def decode(item) -> None:
        for token in steps:
            item.llm.eval([token])

    def start(item):
        item.llm.n_tokens = context  # the next eval drops the cells after the prompt
        return item

    cases = {f"{i}:decode": Case(run=decode, setup=lambda item=item: start(item)) for i, item in enumerate(loaded)}
    log.info("llamacpp threads=%d context=%d: timing %d GGUFs", threads, context, len(loaded))
    stats = interleaved(cases, inputs.clock, warmup=rounds["warmup"], repeats=rounds["repeats"])
    work = [_decode_flops(m, context, s.new_tokens) for m in models]
    per_token = [stats[f"{i}:decode"].median_ms / s.new_tokens for i in range(len(models))]
    probe = len(models) - 1
    probe_kept = work[probe] / work[0]
    share = (per_token[0] - per_token[probe]) / (per_token[0] * (1 - probe_kept))
    rows = []
    for i, m in enumerate(models):
        step = stats[f"{i}:decode"].scaled(s.new_tokens)
        kept = work[i] / work[0]
        bound = 1 / (1 - share * (1 - kept))
        predicted = m.layout.kv_bytes_per_token()
        kv_bytes = sum(kv[i].per_token) * context
        kv_dense = sum(kv[0].per_token) * context
        kv_kept, kv_all = sum(m.layout.kv_heads), sum(models[0].layout.kv_heads)
        rows.append({
            "model": inputs.bench.dense_model or _origin(inputs.bench), "variant": m.name, "kind": m.kind,
            "pruned_dir": m.pruned_dir, "arch": m.layout.arch, "weights": s.weights, "gguf_bytes": m.bytes,
            "threads": threads, "context": context, "new_tokens": s.new_tokens,
            "per_token_ms": step.median_ms, "per_token_spread_ms": step.spread(),
            "tokens_per_s": 1000 / step.median_ms, "per_token_ratio": per_token[0] / per_token[i],
            "dense_attention_share": share, "kept_attention_work": kept, "bound": bound,
            "ratio_to_bound": (per_token[0] / per_token[i]) / bound,
            "kv_cache_bytes": kv_bytes, "kv_ratio": kv_bytes / kv_dense, "kv_heads_share": kv_kept / kv_all,
            "kv_layer_bytes_per_token": kv[i].per_token, "kv_exact": kv[i].per_token == predicted,
            "kv_allocated_mib": llamacpp.kv_allocation(loaded[i].log)["mib"], "llama_cpp_system": system,
            "repeats": step.n,
        })
    return rows


def _decode_flops(m: _Model, context: int, new_tokens: int) -> float:
    """Attention FLOPs of the timed decode steps (step i attends to context + i + 1 keys)."""
    layout = m.layout
    return sum(model_attention_flops(1, 1, context + i + 1, layout.heads, layout.kv_heads, layout.head_dim, m.hidden)
               for i in range(new_tokens))


def check(settings, bench) -> None:
    """Grid values and the weight type; when enabled, exports whose dense origin is known and llama.cpp
    installed, before any work."""
    for name in ("contexts", "threads"):
        if not settings[name] or min(settings[name]) < 1:
            raise ValueError(f"bench.llamacpp.{name}={list(settings[name])} is not allowed; allowed: a non-empty "
                             "list of positive integers")
    if settings.new_tokens < 1:
        raise ValueError(f"bench.llamacpp.new_tokens={settings.new_tokens} is not allowed; allowed: an integer >= 1")
    if settings.weights not in WEIGHT_TYPES:
        raise ValueError(f"bench.llamacpp.weights={settings.weights!r} is not allowed; allowed: "
                         f"{', '.join(WEIGHT_TYPES)}")
    if settings.enabled:
        if not exports(bench):
            raise ValueError("bench.llamacpp.enabled=true needs pruned exports: bench.llamacpp.pruned_dirs=[<folder>,"
                             "...], bench.llm.pruned_dirs or bench.pruned_dir")
        _origin(bench)
        from headprune.deploy.llamacpp import import_llama_cpp

        import_llama_cpp()


def summary(rows: list[dict], results: dict) -> dict:
    """KV exactness over every row; per export and thread count at the longest context: tokens/s, the
    speed-up, its bound, their ratio (target within 5% of 1) and the KV ratio."""
    longest = max(r["context"] for r in rows)
    entry = {"kv_exact": all(r["kv_exact"] for r in rows), "context": longest}
    for r in rows:
        if r["kind"] == "pruned" and r["context"] == longest:
            entry[f"{r['variant']}/threads{r['threads']}"] = {
                k: r[k] for k in ("tokens_per_s", "per_token_ratio", "bound", "ratio_to_bound", "kv_ratio",
                                  "kv_heads_share", "dense_attention_share", "kept_attention_work")}
    return entry


def summary_lines(block: dict) -> list[str]:
    lines = [f"- llama.cpp: KV bytes per layer exactly as the layout predicts, every row: {block['kv_exact']}"]
    for key, d in block.items():
        if isinstance(d, dict):
            off = d["ratio_to_bound"] - 1
            met = "met" if abs(off) <= TOLERANCE else f"missed, {'above' if off > 0 else 'below'} it"
            lines.append(f"- llama.cpp {key}, context {block['context']}: {d['tokens_per_s']:.1f} tokens/s, "
                         f"{d['per_token_ratio']:.2f}x dense, bound {d['bound']:.2f}x (attention "
                         f"{d['dense_attention_share']:.0%} of a dense step, {d['kept_attention_work']:.3f} of its work "
                         f"kept): {d['ratio_to_bound']:.2f} of the bound (target within {TOLERANCE:.0%}: {met}); "
                         f"KV ratio {d['kv_ratio']:.3f}")
    return lines


def table(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    heading = (f"## llama.cpp decode, {r0['model']} ({r0['weights']} GGUF, {r0['new_tokens']} new tokens per round; "
               "attention_probe: the share probe)")
    return render.table(heading, rows, [
        Column("variant", lambda r: r["variant"], False), Column("arch", lambda r: r["arch"], False),
        render.fmt("threads", "d"), render.fmt("context", "d"), render.timed("per-token ms", "per_token_ms"),
        render.fmt("tokens_per_s", ".1f", "tokens/s"), render.ratio("per-token x", "per_token_ratio"),
        render.ratio("bound x", "bound"), render.ratio("x / bound", "ratio_to_bound"),
        Column("KV MiB", lambda r: f"{r['kv_cache_bytes'] / 2**20:,.2f}", True), render.fmt("kv_ratio", ".4f", "KV ratio"),
        Column("KV exact", lambda r: str(r["kv_exact"]), False)])


SECTION = register(Section("llamacpp", LlamaCppSettings, run, table, summary, summary_lines, check=check))
