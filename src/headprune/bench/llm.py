"""Decode on a pretrained causal LM against its pruned exports, each speed-up next to its bound.

Why: the `decoder` section times random-init toy decoders at one shape; serving asks what a real
model's exports (bench.llm.pruned_dirs, else bench.pruned_dir) save against the dense model they
came from (bench/origin.py) at long prompts and several batches. It reuses the decoder section's
prefill / decode / attention_share, `costs.kv_bytes.cache_bytes` and the interleaved clock. Per
thread count
and prompt length:
- one untimed batch-1 prefill per model gives the prompt's cache; the batch-B cache is that cache
  repeated B times along the batch (`batch_repeat_interleave`): the shapes and work of B prompts
  without B prefills (minutes each at 4096 tokens on one CPU thread);
- per batch, one interleaved run of every model: the prefill of the (B, prompt_len) prompt (only
  for batches in `prefill_batches`) and `new_tokens` greedy steps from a fresh copy of the
  prompt's cache (the copy untimed: a KV-modes export's windowed cache cannot be cropped back);
  per-token = that time / new_tokens;
- KV bytes: `cache_bytes` of the batch-B cache (prompt_len positions), counted, beside what the
  layout predicts (`costs.kv_bytes.model_bytes`: removed units nothing, a windowed unit of a
  KV-modes export sink + window tokens, the model's own sliding layers their window);
  `kv_exact`: the two are equal;
- bound: `share` = median share of a dense decode step spent inside the attention modules (a
  hooked pass: Q/K/V/O projections, RoPE, cache update, attention over the cache); `kept` = the
  pruned model's attention FLOPs over the same decode steps / the dense model's (costs.flops; a
  windowed unit's query heads attend to at most sink + window keys, what its cache holds);
  Amdahl: bound = 1 / (1 - share * (1 - kept)).
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import List

import torch
from omegaconf import MISSING

from headprune.bench import render
from headprune.report import Column
from headprune.bench.decoder import attention_share, decode, prefill
from headprune.bench.origin import check_export, export_name, load_dense, origin_of
from headprune.bench.sections import Section, SectionInputs, register
from headprune.bench.variants import Variant, exported_variants
from headprune.costs.flops import attention_flops, model_attention_flops
from headprune.costs.kv_bytes import cache_bytes, model_bytes
from headprune.costs.timing import Case, interleaved
from headprune.deploy.hf import load_pruned
from headprune.heads.adapters import get_adapter, layer_heads
from headprune.heads.windows import FULL, KV_LAYOUT_ATTR, MODES, WINDOW
from headprune.tasks import CAUSAL_LM, check_model_task, max_positions, task_of

log = logging.getLogger(__name__)
TOLERANCE = 0.05  # target: per-token speed-up at the longest prompt within 5% of its bound, either side


@dataclass
class LLMSettings:
    enabled: bool = MISSING
    pruned_dirs: List[str] = MISSING  # the exports; [] -> [bench.pruned_dir]
    prompt_lens: List[int] = MISSING
    batches: List[int] = MISSING
    prefill_batches: List[int] = MISSING  # batches whose prefill is timed (a subset of `batches`)
    threads: List[int] = MISSING
    new_tokens: int = MISSING


def exports(bench) -> list[str]:
    return list(bench.llm.pruned_dirs) or ([bench.pruned_dir] if bench.pruned_dir else [])


def settings_of(bench) -> dict[str, str]:
    """Each export folder -> the setting it was given in (`bench.llm.pruned_dirs[i]`, else
    `bench.pruned_dir`), for messages."""
    if bench.llm.pruned_dirs:
        return {d: f"bench.llm.pruned_dirs[{i}]" for i, d in enumerate(bench.llm.pruned_dirs)}
    return {d: "bench.pruned_dir" for d in exports(bench)}


def check_causal_lm(pruned_dir: str, setting: str) -> None:
    """The export's config names a causal-LM class (read from config.json, before any load)."""
    config = json.loads((Path(pruned_dir).expanduser() / "config.json").read_text())
    architectures = list(config.get("architectures") or [])
    if task_of(SimpleNamespace(architectures=architectures)) is not CAUSAL_LM:
        raise ValueError(f"{setting}={pruned_dir} holds no causal LM ({', '.join(architectures) or 'no architectures'}"
                         "); allowed: exports of a causal LM (an encoder's export: bench.pruned_dir with "
                         "bench.llm.enabled=false)")


def one_origin(dirs: list[str], setting: str, dense_model: str | None) -> str:
    """The one dense model the export folders `dirs` (given as `setting`) came from, each first
    checked to be a folder holding a causal LM; exports of different models are refused."""
    for d in dirs:
        check_export(d, setting)
        check_causal_lm(d, setting)
    found = {origin_of(d, dense_model, setting) for d in dirs}
    if len(found) > 1:
        raise ValueError(f"{setting} come from different dense models; allowed: exports of one model (or name it: "
                         "bench.dense_model=<name or folder>)")
    return found.pop()


def origin(bench) -> str:
    """The one dense model every export came from (bench.dense_model overrides the records);
    each export is first checked to be a folder holding a causal LM."""
    named = settings_of(bench)
    for d in exports(bench):
        check_export(d, named[d])
        check_causal_lm(d, named[d])
    found = {d: origin_of(d, bench.dense_model, named[d]) for d in exports(bench)}
    if len(set(found.values())) > 1:
        raise ValueError(f"bench.llm.pruned_dirs come from different dense models ({found}); allowed: exports of "
                         "one model (or name it: bench.dense_model=<name or folder>)")
    return next(iter(found.values()))


def run(inputs: SectionInputs) -> list[dict]:
    settings, dirs, dense_name = inputs.bench.llm, exports(inputs.bench), origin(inputs.bench)
    models = [load_pruned(d, dtype=inputs.dtype).eval().to(inputs.device) for d in dirs]
    for d, m in zip(dirs, models):
        check_model_task(m, CAUSAL_LM, f"bench.llm (of the export {d}) task")
    dense = load_dense(dense_name, models[0], dirs[0], inputs.device, inputs.dtype)
    variants = exported_variants(dense, models[0], [])[:1]
    for d, m in zip(dirs, models):
        variants.append(exported_variants(dense, m, [])[1])
        variants[-1].name = export_name(d)
    longest = max(settings.prompt_lens) + settings.new_tokens
    if (limit := max_positions(dense.config)) is not None and longest > limit:
        raise ValueError(f"bench.llm.prompt_lens + bench.llm.new_tokens = {longest} exceeds {dense_name}'s {limit} "
                         f"positions; allowed: at most {limit}")
    before, rows = torch.get_num_threads(), []
    try:
        for threads in settings.threads:
            torch.set_num_threads(threads)
            for prompt_len in settings.prompt_lens:
                rows += _at_prompt(inputs, variants, prompt_len, threads, dense_name, dict(zip(map(id, models), dirs)))
    finally:
        torch.set_num_threads(before)
    return rows


def _at_prompt(inputs: SectionInputs, variants: list[Variant], prompt_len: int, threads: int, model: str,
               dirs: dict) -> list[dict]:
    """The rows of every batch at one prompt length: one batch-1 prefill per model, then per batch."""
    s, rounds, clock = inputs.bench.llm, inputs.rounds, inputs.clock
    g = torch.Generator().manual_seed(rounds["seed"])
    prompt = torch.randint(0, variants[0].model.config.vocab_size, (1, prompt_len), generator=g).to(inputs.device)
    with torch.no_grad():
        starts = [prefill(v.model, prompt) for v in variants]  # (cache, next token (1, 1)) per model
    rows = []
    for batch in s.batches:
        states = []
        for cache, token in starts:
            cache = copy.deepcopy(cache)
            cache.batch_repeat_interleave(batch)
            states.append((cache, token.expand(batch, 1)))
        kv = [cache_bytes(cache) for cache, _ in states]
        predicted = [sum(model_bytes(v.model, prompt_len, batch)) for v in variants]

        def start(i: int):
            cache, token = states[i]
            return copy.deepcopy(cache), token  # the prompt's cache, untouched by earlier rounds

        cases = {}
        for i, v in enumerate(variants):
            if batch in s.prefill_batches:
                cases[f"{i}:prefill"] = lambda m=v.model: prefill(m, prompt.expand(batch, prompt_len))
            cases[f"{i}:decode"] = Case(run=lambda state, m=v.model: decode(m, *state, s.new_tokens),
                                        setup=lambda i=i: start(i))
        log.info("llm threads=%d prompt=%d batch=%d: timing %d models", threads, prompt_len, batch, len(variants))
        stats = interleaved(cases, clock, warmup=rounds["warmup"], repeats=rounds["repeats"])
        shares = [attention_share(v.model, lambda i=i: start(i), s.new_tokens, clock, rounds["repeats"])
                  for i, v in enumerate(variants)]
        work = [_decode_flops(v, batch, prompt_len, s.new_tokens) for v in variants]
        for i, v in enumerate(variants):
            rows.append(_row(v, i, stats, shares, work, kv, predicted, variants[0], model=model,
                             pruned_dir=dirs.get(id(v.model)),
                             threads=threads, batch=batch, prompt_len=prompt_len, new_tokens=s.new_tokens))
        del states
    return rows


def _row(v: Variant, i: int, stats: dict, shares: list, work: list, kv: list, predicted: list, dense: Variant,
         **where) -> dict:
    step = stats[f"{i}:decode"].scaled(where["new_tokens"])
    layout = getattr(v.model, KV_LAYOUT_ATTR, None)
    pre = stats.get(f"{i}:prefill")
    kept = work[i] / work[0]
    bound = 1 / (1 - shares[0] * (1 - kept))
    speedup = stats["0:decode"].median_ms / stats[f"{i}:decode"].median_ms
    kv_kept, kv_dense = sum(v.kv_heads), sum(dense.kv_heads)
    return {
        **where, **v.row(), "heads_kept": sum(v.heads), "kv_heads_kept": kv_kept,
        "prefill_ms": pre.median_ms if pre else None, "prefill_spread_ms": pre.spread() if pre else None,
        "prefill_ratio": stats["0:prefill"].median_ms / pre.median_ms if pre else None,
        "per_token_ms": step.median_ms, "per_token_spread_ms": step.spread(), "per_token_ratio": speedup,
        "attention_share": shares[i], "dense_attention_share": shares[0], "kept_attention_work": kept,
        "bound": bound, "ratio_to_bound": speedup / bound,
        "kv_cache_bytes": kv[i], "kv_predicted_bytes": predicted[i], "kv_ratio": kv[i] / kv[0],
        "kv_heads_share": kv_kept / kv_dense, "kv_exact": kv[i] == predicted[i], "repeats": step.n,
        **({"kv_sink": layout.sink, "kv_window": layout.window,
            "kv_units": {m: sum(u.count(m) for u in layout.modes) for m in MODES}} if layout is not None else {}),
    }


def _decode_flops(v: Variant, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Attention FLOPs of the timed decode steps (step i attends to prompt_len + i + 1 keys; with
    a KV layout attached, a windowed unit's query heads to at most sink + window of them)."""
    adapter, config = get_adapter(v.model), v.model.config
    head_dim, hidden = adapter.head_dim(config), config.hidden_size
    layout = getattr(v.model, KV_LAYOUT_ATTR, None)
    if layout is None:
        return sum(model_attention_flops(batch, 1, prompt_len + i + 1, v.heads, v.kv_heads, head_dim, hidden,
                                         v.densities) for i in range(new_tokens))
    group = adapter.num_heads(config) // adapter.num_kv_heads(config)  # query heads per KV unit
    total = 0.0
    for layer, modes in enumerate(layout.modes):
        heads = [modes[h // group] for h in layer_heads(v.model, layer)]  # each kept query head's unit mode
        units = [m for u, m in enumerate(modes) if any(h // group == u for h in layer_heads(v.model, layer))]
        for i in range(new_tokens):
            keys = prompt_len + i + 1
            for mode, seen in ((FULL, keys), (WINDOW, min(keys, layout.kept))):
                if heads.count(mode):
                    total += attention_flops(batch, 1, seen, heads.count(mode), units.count(mode), head_dim, hidden)
    return total


def check(settings, bench) -> None:
    """Grid values, and (when enabled) an export whose dense origin is known, before any work."""
    for name in ("prompt_lens", "batches", "threads"):
        if not settings[name] or min(settings[name]) < 1:
            raise ValueError(f"bench.llm.{name}={list(settings[name])} is not allowed; allowed: a non-empty list "
                             "of positive integers")
    if settings.new_tokens < 1:
        raise ValueError(f"bench.llm.new_tokens={settings.new_tokens} is not allowed; allowed: an integer >= 1")
    extra = sorted(set(settings.prefill_batches) - set(settings.batches))
    if extra:
        raise ValueError(f"bench.llm.prefill_batches contains {extra}, not in bench.llm.batches; allowed: a subset "
                         f"of {list(settings.batches)}")
    if settings.enabled:
        if not exports(bench):
            raise ValueError("bench.llm.enabled=true needs pruned exports: bench.llm.pruned_dirs=[<folder>,...] "
                             "or bench.pruned_dir=<folder>")
        origin(bench)


def summary(rows: list[dict], results: dict) -> dict:
    """KV exactness over every row; per export, thread count and batch at the longest prompt: the
    per-token speed-up, its bound, their ratio (target: within 5% of 1) and the KV ratio."""
    longest = max(r["prompt_len"] for r in rows)
    entry = {"kv_exact": all(r["kv_exact"] for r in rows), "kv_exact_against": "layout", "prompt_len": longest}
    for r in rows:
        if r["kind"] == "pruned" and r["prompt_len"] == longest:
            entry[f"{r['variant']}/threads{r['threads']}/batch{r['batch']}"] = {
                k: r[k] for k in ("sparsity", "per_token_ratio", "bound", "ratio_to_bound", "kv_ratio",
                                  "kv_heads_share", "dense_attention_share", "kept_attention_work")}
    return entry


def summary_lines(block: dict) -> list[str]:
    what = ("held exactly what the layout predicts (costs.kv_bytes.model_bytes)" if block.get("kv_exact_against")
            else "exactly the kept KV-head share of the dense model's")  # a record written before the layout count
    lines = [f"- llm: KV bytes {what}, every row: {block['kv_exact']}"]
    for key, d in block.items():
        if isinstance(d, dict):
            off = d["ratio_to_bound"] - 1  # above the bound: the Amdahl model misses a saving outside attention
            met = "met" if abs(off) <= TOLERANCE else f"missed, {'above' if off > 0 else 'below'} it"
            lines.append(f"- llm {key}, prompt {block['prompt_len']}: per-token decode {d['per_token_ratio']:.2f}x "
                         f"dense, bound {d['bound']:.2f}x (attention {d['dense_attention_share']:.0%} of a dense step, "
                         f"{d['kept_attention_work']:.3f} of its work kept): {d['ratio_to_bound']:.2f} of the bound "
                         f"(target within {TOLERANCE:.0%}: {met}); KV ratio {d['kv_ratio']:.3f}")
    return lines


def table(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    heading = f"## Pretrained decoder {r0['model']} ({r0['new_tokens']} new tokens per round)"
    return render.table(heading, rows, [
        Column("variant", lambda r: r["variant"], False), render.fmt("sparsity", ".2f"), render.fmt("threads", "d"),
        render.fmt("batch", "d"), render.fmt("prompt_len", "d", "prompt"),
        Column("prefill ms", lambda r: render.ms(r["prefill_ms"], r["prefill_spread_ms"]) if r["prefill_ms"] else "–", True),
        render.timed("per-token ms", "per_token_ms"), render.ratio("per-token x", "per_token_ratio"),
        render.ratio("bound x", "bound"), render.ratio("x / bound", "ratio_to_bound"),
        Column("attention share", lambda r: f"{r['attention_share']:.0%}", True),
        Column("KV MiB", lambda r: f"{r['kv_cache_bytes'] / 2**20:,.1f}", True), render.fmt("kv_ratio", ".4f", "KV ratio")])


def plot(ax, rows: list[dict], block: dict) -> None:
    """Per export and batch (fewest threads): per-token speed-up vs prompt length, bound dashed."""
    threads = min(r["threads"] for r in rows)
    rows = [r for r in rows if r["kind"] == "pruned" and r["threads"] == threads]
    for key in dict.fromkeys((r["variant"], r["batch"]) for r in rows):
        pts = sorted((r["prompt_len"], r["per_token_ratio"], r["bound"]) for r in rows
                     if (r["variant"], r["batch"]) == key)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} batch {key[1]}")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", color=line.get_color())
    ax.set_title(f"pretrained decoder per-token, {threads} thread(s) (dashed: bound)", fontsize=9)
    ax.set_xlabel("prompt tokens")


SECTION = register(Section("llm", LLMSettings, run, table, summary, summary_lines, check=check, plot=plot, panel=3))
