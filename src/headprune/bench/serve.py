"""What serving gains: throughput over a batch sweep, the sequences that fit a memory budget, and
the time to first token, for the dense model and each export, with static caches.

Why: at batch 1 a decode step is launch-bound, so a per-token ratio there says little about what
a smaller cache buys. A server holds a fixed memory budget: the cache bytes per sequence decide
how many sequences fit, and at that batch the step reads the cache. Per context (default 4k, 8k,
16k tokens) and model:
- cache: a static one (deploy/static_cache.py: full layers a StaticLayer of context +
  new_tokens tokens, the model's own sliding layers a StaticSlidingWindowLayer, windowed KV units
  a ring of sink + window entries with nothing allocated per step), counted after the prefill
  (`costs.kv_bytes.cache_bytes`) next to its price (`costs.kv_bytes.model_bytes`, static);
- capacity: the largest batch whose weights + cache bytes fit `memory_gib` (at most `max_batch`),
  from the price per sequence, which the counted cache equals (tested);
- time to first token: the batch-1 prefill of the prompt into the static cache and the first
  token's argmax (`warmup` + `repeats` rounds, median);
- throughput: per batch of `batches` plus every model's capacity (a batch a model does not fit is
  a row with `fits` false, not timed): the batch-1 prefill's cache repeated to the batch
  (`repeat_rows`), then `new_tokens` greedy steps; tokens/s = batch x new_tokens / seconds,
  median over rounds, the cache's positions and rings put back between rounds (`restore`).
- `graphs`: `none` (eager), `cuda_graph` (one decode step captured with torch.cuda.graphs and
  replayed; CUDA only) or `compile` (torch.compile of the step). Where capture or compilation
  fails, or a model's sliding layers branch on Python ints (no capture), the step runs eager and
  the row's `graphs` says so with the reason.
On CUDA each row also records the peak memory allocated (`peak_bytes`).
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import List

import torch
from omegaconf import MISSING
from torch import nn

from headprune.bench import render
from headprune.report import Column
from headprune.bench.llm import one_origin
from headprune.bench.llm import exports as llm_exports
from headprune.bench.origin import export_name, load_dense, origin_of
from headprune.bench.sections import Section, SectionInputs, one_of, register
from headprune.costs.kv_bytes import cache_bytes, model_bytes, native_windows
from headprune.costs.timing import Case, Clock, interleaved
from headprune.deploy.hf import load_pruned
from headprune.deploy.static_cache import repeat_rows, restore, snapshot, static_cache
from headprune.tasks import max_positions

log = logging.getLogger(__name__)
GRAPHS = ("none", "cuda_graph", "compile")
GiB = 2 ** 30


@dataclass
class ServeSettings:
    enabled: bool = MISSING
    pruned_dirs: List[str] = MISSING  # []: bench.llm.pruned_dirs, else [bench.pruned_dir]
    contexts: List[int] = MISSING
    batches: List[int] = MISSING
    new_tokens: int = MISSING
    memory_gib: float = MISSING  # weights + KV cache budget, GiB
    max_batch: int = MISSING
    graphs: str = MISSING


def weights_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def capacity(weights: int, per_sequence: int, budget: int, limit: int) -> int:
    """The largest batch B <= `limit` with weights + B x per_sequence <= budget (0: none fits)."""
    if per_sequence <= 0:
        return limit if weights <= budget else 0
    return max(0, min(limit, (budget - weights) // per_sequence))


def prefill(model: nn.Module, cache, prompt: torch.Tensor) -> torch.Tensor:
    """The next token (B, 1) after the prompt (B, T) went into the empty static `cache`."""
    positions = torch.arange(prompt.shape[1], device=prompt.device)[None]  # (1, T)
    out = model(input_ids=prompt, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


class Stepper:
    """Greedy decode steps on a static cache: `token` (B, 1) and `position` (1, 1) are fixed
    buffers each step reads and writes in place (so a captured step replays), `run(n)` does n
    steps; `graphs` is what runs (none / cuda_graph / compile, or why not)."""

    def __init__(self, model: nn.Module, cache, token: torch.Tensor, position: int, graphs: str):
        self.model, self.cache = model, cache
        self.token = token.clone()  # (B, 1)
        self.position = torch.full((1, 1), position, dtype=torch.long, device=token.device)
        self.start = (self.token.clone(), position)
        self.graph, self.graphs, self.forward = None, "none", self._step
        if graphs == "compile":
            self._try("compile", lambda: setattr(self, "forward", torch.compile(self._step)))
        elif graphs == "cuda_graph":
            self._try("cuda_graph", self._capture)

    def _step(self) -> None:
        out = self.model(input_ids=self.token, cache=self.cache, position_ids=self.position, use_cache=True)
        self.token.copy_(out.logits[:, -1:].argmax(-1))
        self.position.add_(1)

    def _try(self, name: str, make) -> None:
        saved = snapshot(self.cache)
        try:
            make()
            with torch.no_grad():
                self.run(1)  # compiled / captured here, checked to run
            self.graphs = name
        except Exception as error:  # noqa: BLE001 - recorded in the row, the step runs eager
            log.warning("serve: %s failed (%s: %s); eager steps", name, type(error).__name__, error)
            self.graph, self.forward = None, self._step
            self.graphs = f"none ({name} failed: {type(error).__name__}: {str(error)[:200]})"
        restore(self.cache, saved)
        self.reset()

    def _capture(self) -> None:
        if any(w for w in native_windows(self.model.config)):
            raise ValueError("the model's sliding layers (StaticSlidingWindowLayer) branch on Python ints, which a "
                             "captured graph does not replay")
        saved = snapshot(self.cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        restore(self.cache, saved)
        self.reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self._step()
        restore(self.cache, saved)

    def reset(self) -> None:
        self.token.copy_(self.start[0])
        self.position.fill_(self.start[1])

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.graph.replay() if self.graph is not None else self.forward()


def _models(inputs: SectionInputs) -> list[tuple[str, nn.Module]]:
    dirs = exports(inputs.bench)
    origins = {origin_of(d, inputs.bench.dense_model, "bench.serve.pruned_dirs") for d in dirs}
    models = [(export_name(d), load_pruned(d, dtype=inputs.dtype).eval().to(inputs.device)) for d in dirs]
    dense = load_dense(origins.pop(), models[0][1], dirs[0], inputs.device, inputs.dtype)
    return [("dense", dense), *models]


def exports(bench) -> list[str]:
    return list(bench.serve.pruned_dirs) or llm_exports(bench)


def run(inputs: SectionInputs) -> list[dict]:
    s = inputs.bench.serve
    models = _models(inputs)
    longest = max(s.contexts) + s.new_tokens
    if (limit := max_positions(models[0][1].config)) is not None and longest > limit:
        raise ValueError(f"bench.serve.contexts + new_tokens = {longest} exceeds the model's {limit} positions; "
                         f"allowed: at most {limit}")
    rows = []
    for context in s.contexts:
        rows += serve_rows(models, context, list(s.batches), s.new_tokens, int(s.memory_gib * GiB), s.max_batch,
                           s.graphs, inputs.clock, inputs.bench.warmup, inputs.bench.repeats, inputs.cfg.seed)
    return rows


def serve_rows(models: list[tuple[str, nn.Module]], context: int, batches: list[int], new_tokens: int, budget: int,
               max_batch: int, graphs: str, clock: Clock, warmup: int, repeats: int, seed: int = 0) -> list[dict]:
    """The rows of every model at one context (module docstring); `models` starts with dense."""
    device = next(models[0][1].parameters()).device
    prompt = torch.randint(0, models[0][1].config.vocab_size, (1, context),
                           generator=torch.Generator().manual_seed(seed)).to(device)  # (1, T)
    max_len = context + new_tokens
    info = {}
    for name, model in models:
        weights = weights_bytes(model)
        per_sequence = sum(model_bytes(model, max_len, static=True))
        info[name] = {"weights_bytes": weights, "cache_bytes_per_sequence": per_sequence,
                      "capacity": capacity(weights, per_sequence, budget, max_batch)}
    sweep = sorted({*batches, *(i["capacity"] for i in info.values() if i["capacity"])})
    rows = []
    for name, model in models:
        cache = static_cache(model, max_len)
        with torch.no_grad():
            stats = interleaved({"ttft": Case(run=lambda _: prefill(model, cache, prompt), setup=cache.reset)},
                                clock, warmup=warmup, repeats=repeats)["ttft"]
            cache.reset()
        for batch in sweep:
            rows.append({"model": name, "context": context, "batch": batch, "new_tokens": new_tokens,
                         "memory_budget_bytes": budget, **info[name], "ttft_ms": stats.median_ms,
                         "ttft_spread_ms": stats.spread(),
                         **_decode(model, prompt, max_len, batch, new_tokens, budget, info[name], graphs, clock,
                                   warmup, repeats)})
        del cache
    dense = {r["batch"]: r for r in rows if r["model"] == "dense"}
    dense_cap = info["dense"]["capacity"]
    for r in rows:
        d = dense.get(r["batch"])
        r["dense_capacity"] = dense_cap
        r["capacity_ratio"] = r["capacity"] / dense_cap if dense_cap else None
        r["tokens_per_s_ratio"] = (r["tokens_per_s"] / d["tokens_per_s"]
                                   if r["tokens_per_s"] and d and d["tokens_per_s"] else None)
    return rows


def _decode(model, prompt, max_len: int, batch: int, new_tokens: int, budget: int, info: dict, graphs: str,
            clock: Clock, warmup: int, repeats: int) -> dict:
    """One model at one batch: the counted cache, and tokens/s when the batch fits."""
    predicted = info["cache_bytes_per_sequence"] * batch
    if info["weights_bytes"] + predicted > budget:
        return {"fits": False, "cache_bytes": None, "predicted_cache_bytes": predicted, "tokens_per_s": None,
                "per_step_ms": None, "graphs": None, "peak_bytes": None}
    cuda = prompt.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = static_cache(model, max_len)
    with torch.no_grad():
        token = prefill(model, cache, prompt)
    repeat_rows(cache, batch)
    counted = cache_bytes(cache)
    stepper = Stepper(model, cache, token.expand(batch, 1), prompt.shape[1], graphs)
    saved = snapshot(cache)

    def setup():
        restore(cache, saved)
        stepper.reset()

    stats = interleaved({"decode": Case(run=lambda _: stepper.run(new_tokens), setup=setup)}, clock, warmup=warmup,
                        repeats=repeats)["decode"]
    peak = torch.cuda.max_memory_allocated() if cuda else None
    ran = stepper.graphs
    del stepper, cache, saved
    gc.collect()
    return {"fits": True, "cache_bytes": counted, "predicted_cache_bytes": predicted,
            "tokens_per_s": batch * new_tokens / (stats.median_ms / 1000), "per_step_ms": stats.median_ms / new_tokens,
            "decode_spread_ms": stats.spread(), "repeats": stats.n, "graphs": ran,
            "peak_bytes": peak}


def check(settings, bench) -> None:
    one_of("bench.serve.graphs", settings.graphs, GRAPHS)
    for name in ("contexts", "batches"):
        if not settings[name] or min(settings[name]) < 1:
            raise ValueError(f"bench.serve.{name}={list(settings[name])} is not allowed; allowed: a non-empty list "
                             "of positive integers")
    for name in ("new_tokens", "max_batch"):
        if settings[name] < 1:
            raise ValueError(f"bench.serve.{name}={settings[name]} is not allowed; allowed: an integer >= 1")
    if not settings.memory_gib > 0:
        raise ValueError(f"bench.serve.memory_gib={settings.memory_gib} is not allowed; allowed: GiB > 0")
    if settings.enabled:
        if settings.graphs == "cuda_graph" and not (bench.device in ("auto", "cuda") and torch.cuda.is_available()):
            raise ValueError("bench.serve.graphs=cuda_graph needs a CUDA device; allowed here: none, compile")
        dirs = exports(bench)
        if not dirs:
            raise ValueError("bench.serve.enabled=true needs pruned exports: bench.serve.pruned_dirs=[<folder>,...], "
                             "bench.llm.pruned_dirs or bench.pruned_dir")
        one_origin(dirs, "bench.serve.pruned_dirs", bench.dense_model)


def summary(rows: list[dict], results: dict) -> dict:
    """Per export and context: sequences that fit against dense's, tokens/s against dense at
    dense's capacity batch and at each one's own capacity, batch-1 step and time to first token."""
    out = {}
    for r in rows:
        if r["model"] == "dense":
            continue
        key = f"{r['model']}/context{r['context']}"
        mine = [x for x in rows if x["model"] == r["model"] and x["context"] == r["context"]]
        dense = [x for x in rows if x["model"] == "dense" and x["context"] == r["context"]]
        at = {x["batch"]: x for x in mine}
        dense_at = {x["batch"]: x for x in dense}
        cap, dcap = r["capacity"], r["dense_capacity"]
        entry = {"capacity": cap, "dense_capacity": dcap, "capacity_ratio": r["capacity_ratio"],
                 "ttft_ratio": dense[0]["ttft_ms"] / r["ttft_ms"], "graphs": sorted({x["graphs"] for x in mine if x["fits"]})}
        if dcap and at.get(dcap, {}).get("tokens_per_s") and dense_at[dcap]["tokens_per_s"]:
            entry["tokens_per_s_ratio_at_dense_capacity"] = at[dcap]["tokens_per_s"] / dense_at[dcap]["tokens_per_s"]
        if cap and dcap and at.get(cap, {}).get("tokens_per_s") and dense_at[dcap]["tokens_per_s"]:
            entry["tokens_per_s_ratio_at_capacity"] = at[cap]["tokens_per_s"] / dense_at[dcap]["tokens_per_s"]
        if 1 in at and at[1]["per_step_ms"] and dense_at[1]["per_step_ms"]:
            entry["batch1_step_ratio"] = dense_at[1]["per_step_ms"] / at[1]["per_step_ms"]
        out[key] = entry
    return out


def summary_lines(block: dict) -> list[str]:
    lines = []
    for key, d in block.items():
        parts = [f"- serve {key}: {d['capacity']} sequences fit against dense's {d['dense_capacity']}"]  # targets: issue 54's
        if d["capacity_ratio"] is not None:
            parts.append(f"({d['capacity_ratio']:.2f}x; target >= 2.5x: {'hit' if d['capacity_ratio'] >= 2.5 else 'miss'})")
        if "tokens_per_s_ratio_at_dense_capacity" in d:
            ratio = d["tokens_per_s_ratio_at_dense_capacity"]
            parts.append(f"; tokens/s at dense's capacity batch {ratio:.2f}x dense (target >= 2x: "
                         f"{'hit' if ratio >= 2 else 'miss'})")
        if "tokens_per_s_ratio_at_capacity" in d:
            parts.append(f"; at its own capacity {d['tokens_per_s_ratio_at_capacity']:.2f}x dense's at dense's")
        if "batch1_step_ratio" in d:
            ratio = d["batch1_step_ratio"]
            parts.append(f"; batch-1 step {ratio:.2f}x dense (target no worse: {'hit' if ratio >= 1 else 'miss'})")
        parts.append(f"; time to first token {d['ttft_ratio']:.2f}x dense; steps: {', '.join(d['graphs'])}")
        lines.append(" ".join(parts))
    return lines


def table(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    heading = (f"## Serving (static caches, {r0['new_tokens']} new tokens per round, budget "
               f"{r0['memory_budget_bytes'] / GiB:.2f} GiB for weights + KV cache)")
    opt = lambda key, f: (lambda r: format(r[key], f) if r[key] is not None else "–")  # noqa: E731
    return render.table(heading, rows, [
        Column("model", lambda r: r["model"], False), render.fmt("context", "d"), render.fmt("batch", "d"),
        Column("fits", lambda r: "yes" if r["fits"] else "no", False), render.fmt("capacity", "d"),
        Column("KV MiB", lambda r: f"{r['cache_bytes'] / 2 ** 20:,.1f}" if r["cache_bytes"] is not None else "–", True),
        Column("tokens/s", opt("tokens_per_s", ",.1f"), True), Column("step ms", opt("per_step_ms", ".2f"), True),
        Column("tokens/s x", opt("tokens_per_s_ratio", ".2f"), True), Column("TTFT ms", opt("ttft_ms", ".1f"), True),
        Column("steps", lambda r: str(r["graphs"]).split(" (")[0] if r["graphs"] else "–", False)])


SECTION = register(Section("serve", ServeSettings, run, table, summary, summary_lines, check=check))
