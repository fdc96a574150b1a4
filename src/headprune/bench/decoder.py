"""Decoder latency and KV cache: prefill, per-token decode with the cache, and cache bytes.

Decoders are built from config dicts with random weights: speed and cache size do not depend
on the values. For each variant, in one interleaved run:
- prefill: one forward over a (batch, prompt_len) prompt into an empty cache (logits of the
  last position only, as `generate` does);
- decode: after an untimed prefill, `new_tokens` greedy steps of one token each with the
  cache; per-token latency is that time / new_tokens.
KV-cache bytes are counted from the cache's tensors after prefill + decode
(`costs.kv_bytes.cache_bytes`, windowed heads' held tokens included). The attention share of a
decode step comes from a separate pass with timing hooks on every layer's attention module
(projections, cache update, kernel, output projection).
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from omegaconf import MISSING, OmegaConf
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from headprune.bench import render
from headprune.report import Column
from headprune.bench.sections import Section, SectionInputs, check_variants, kinds, one_of, register
from headprune.bench.variants import Variant, build_variants
from headprune.costs.flops import model_attention_flops, ratio
from headprune.costs.kv_bytes import cache_bytes
from headprune.costs.timing import Case, Clock, ModuleTimer, interleaved
from headprune.heads.adapters import get_adapter
from headprune.tasks import max_positions

log = logging.getLogger(__name__)
ATTN = ("eager", "sdpa")


@dataclass
class DecoderSettings:
    enabled: bool = MISSING
    models: List[str] = MISSING  # keys of bench.decoder_configs
    batch: int = MISSING
    prompt_len: int = MISSING
    new_tokens: int = MISSING
    attn_implementation: str = MISSING
    variants: Dict[str, List[float]] = MISSING


def build_decoder(spec: dict, attn_implementation: str = "sdpa", seed: int = 0) -> nn.Module:
    """A random-init causal LM from `spec`: {"model_type": ..., **config fields}."""
    spec = dict(spec)
    if "model_type" not in spec:
        raise ValueError(f"bench.decoder_configs entry {spec} has no model_type; allowed: gpt2, llama, mistral, qwen2")
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def prefill(model: nn.Module, prompt: torch.Tensor):
    """(cache, next token (B, 1)) after one forward over the prompt (B, T)."""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[:, -1:].argmax(-1)


def decode(model: nn.Module, cache, token: torch.Tensor, steps: int):
    """`steps` greedy one-token steps with the cache; returns the cache."""
    for _ in range(steps):
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)  # (B, 1)
    return cache


def bench_decoder(variants: list[Variant], batch: int, prompt_len: int, new_tokens: int, clock: Clock,
                  warmup: int, repeats: int, seed: int = 0, model_name: str = "") -> list[dict]:
    """One row per variant: prefill and per-token latency, attention share, KV-cache bytes."""
    config = variants[0].model.config
    max_len = max_positions(config)
    if max_len is not None and prompt_len + new_tokens > max_len:
        raise ValueError(f"bench.decoder.prompt_len + bench.decoder.new_tokens = {prompt_len + new_tokens} exceeds "
                         f"the {model_name} config's {max_len} positions; allowed: at most {max_len}")
    device = next(variants[0].model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=g).to(device)  # (B, T)
    cases = {}
    for i, v in enumerate(variants):
        cases[f"{i}:prefill"] = lambda m=v.model: prefill(m, prompt)
        cases[f"{i}:decode"] = Case(run=lambda state, m=v.model: decode(m, *state, new_tokens),
                                    setup=lambda m=v.model: prefill(m, prompt))
    log.info("decoder %s: timing %d variants x (prefill, decode %d tokens)", model_name, len(variants), new_tokens)
    stats = interleaved(cases, clock, warmup=warmup, repeats=repeats)
    dims = _dims(variants[0].model)
    flops = [_generation_flops(v, batch, prompt_len, new_tokens, dims) for v in variants]
    kv = [cache_bytes(_generate_cache(v.model, prompt, new_tokens)) for v in variants]
    rows = []
    for i, v in enumerate(variants):
        pre, step = stats[f"{i}:prefill"], stats[f"{i}:decode"].scaled(new_tokens)
        rows.append({
            "model": model_name, **v.row(), "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "prefill_ms": pre.median_ms, "per_token_ms": step.median_ms,
            "prefill_ratio": stats["0:prefill"].median_ms / pre.median_ms,
            "per_token_ratio": stats["0:decode"].median_ms / stats[f"{i}:decode"].median_ms,
            "per_token_attention_share": attention_share(v.model, lambda m=v.model: prefill(m, prompt), new_tokens,
                                                         clock, repeats),
            "kv_cache_bytes": kv[i], "kv_ratio": kv[i] / kv[0],
            "theoretical_attention_ratio": ratio(flops[0], flops[i]),
            "heads_kept": sum(v.heads), "kv_heads_kept": sum(v.kv_heads),
            "prefill_spread_ms": pre.spread(), "per_token_spread_ms": step.spread(), "repeats": pre.n,
        })
    return rows


def attention_share(model: nn.Module, start: Callable[[], tuple], new_tokens: int, clock: Clock,
                    repeats: int) -> float:
    """Median share of decode time spent inside the attention modules (hooked pass, not the timed one);
    each pass decodes `new_tokens` from the (cache, token) `start()` gives (a prefill, a cropped cache)."""
    adapter = get_adapter(model)
    modules = [adapter.attention(block) for block in adapter.blocks(model)]
    shares = []
    with torch.no_grad():
        for _ in range(repeats):
            cache, token = start()
            with ModuleTimer(modules, clock) as timer:
                total = clock.time(lambda: decode(model, cache, token, new_tokens))
            shares.append(timer.total_ms / total)
    return statistics.median(shares)


def _generate_cache(model: nn.Module, prompt: torch.Tensor, new_tokens: int):
    with torch.no_grad():
        cache, token = prefill(model, prompt)
        return decode(model, cache, token, new_tokens)


def _dims(model: nn.Module) -> dict:
    adapter, config = get_adapter(model), model.config
    return {"head_dim": adapter.head_dim(config), "hidden": config.hidden_size}


def _generation_flops(v: Variant, batch: int, prompt_len: int, new_tokens: int, dims: dict) -> float:
    """Attention FLOPs of prefill plus every decode step (step i attends to prompt_len + i + 1 keys)."""
    def at(q_len: int, kv_len: int) -> float:
        return model_attention_flops(batch, q_len, kv_len, v.heads, v.kv_heads, dims["head_dim"], dims["hidden"],
                                     v.densities)
    return at(prompt_len, prompt_len) + sum(at(1, prompt_len + i + 1) for i in range(new_tokens))


def run(inputs: SectionInputs) -> list[dict]:
    """The rows of every decoder: the exported causal LM when given, else each of `models`."""
    d, rows = inputs.bench.decoder, []
    for name, variants in _variants(inputs):
        rows += bench_decoder(variants, d.batch, d.prompt_len, d.new_tokens, inputs.clock, model_name=name,
                              **inputs.rounds)
    return rows


def _variants(inputs: SectionInputs):
    """(name, variants) per decoder, built one at a time."""
    bench = inputs.bench
    if inputs.exported_is_lm:
        yield inputs.exported_variants(kinds(bench.decoder))
        return
    for name in bench.decoder.models:
        spec = OmegaConf.to_container(bench.decoder_configs[name], resolve=True)
        dense = build_decoder(spec, bench.decoder.attn_implementation, seed=inputs.cfg.seed)
        dense = dense.to(inputs.device, inputs.dtype)
        yield name, build_variants(dense, kinds(bench.decoder), list(bench.layouts))


def check(settings, bench) -> None:
    one_of("bench.decoder.attn_implementation", settings.attn_implementation, ATTN)
    check_variants("decoder", settings)
    for name in ("batch", "prompt_len", "new_tokens"):
        if settings[name] < 1:
            raise ValueError(f"bench.decoder.{name}={settings[name]} is not allowed; allowed: an integer >= 1")
    for model in settings.models:
        one_of("bench.decoder.models", model, tuple(bench.decoder_configs))


def summary(rows: list[dict], results: dict) -> dict:
    """Per model: KV-cache exactness, and at 50% heads the per-token speed-up against its Amdahl bound."""
    return {model: _model_summary([r for r in rows if r["model"] == model])
            for model in dict.fromkeys(r["model"] for r in rows)}


def _model_summary(rows: list[dict]) -> dict:
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


def summary_lines(block: dict) -> list[str]:
    lines = []
    for model, d in block.items():
        line = f"- {model}: KV bytes exactly the kept KV-head share: {d['kv_exact']}"
        if "per_token_ratio_50" in d:
            line += (f"; 50% heads: KV ratio {d['kv_ratio_50']:.3f}, per-token decode {d['per_token_ratio_50']:.2f}x "
                     f"dense (bound {d['per_token_bound_50']:.2f}x: attention is {d['dense_attention_share']:.0%} "
                     f"of a dense step, {d['attention_share_50']:.0%} of a pruned one)")
        lines.append(line)
    return lines


def table(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    heading = f"## Decoders (batch {r0['batch']}, prompt {r0['prompt_len']}, {r0['new_tokens']} new tokens)"
    return render.table(heading, rows, [
        Column("model", lambda r: r["model"], False), render.GRID[0], render.GRID[1],
        render.timed("prefill ms", "prefill_ms"), render.timed("per-token ms", "per_token_ms"),
        render.ratio("prefill x", "prefill_ratio"), render.ratio("per-token x", "per_token_ratio"),
        Column("attention share", lambda r: f"{r['per_token_attention_share']:.0%}", True),
        Column("KV bytes", lambda r: f"{r['kv_cache_bytes']:,}", True), render.fmt("kv_ratio", ".3f", "KV ratio"),
        render.ratio("theoretical attention x", "theoretical_attention_ratio")])


def plot(ax, rows: list[dict], block: dict) -> None:
    for i, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
        render.curves(ax, [r for r in rows if r["model"] == model], "per_token_ratio", label=f"{model} ",
                      theory=i == 0)
    ax.set_title("decoder per-token latency")


SECTION = register(Section("decoder", DecoderSettings, run, table, summary, summary_lines, check=check, plot=plot,
                           panel=1))
