"""Measured latency of one attention layer with 0..U units kept: the lookup table behind
`budget=latency`.

For k = 0..U a copy of the model is pruned to its first k units (KV groups; heads without GQA)
in every layer, one forward records the exact inputs of layer 0's attention calls (the bench's
replay: core, and the output projection where it sits outside), and the replays of every k and
one whole dense forward are timed together, interleaved (`costs.timing.interleaved`), at the
budget's batch x seq on random token ids. k = 0 times the headless layer that replaces an
attention with no heads left, so removing a whole layer saves its fixed cost too.

Tables are cached as JSON under `budget.cache_dir` (default ~/.cache/headprune/latency), keyed by
the model config, device, dtype, torch threads, batch and seq: a table measured for another
machine or shape is never reused, and a cache file that is not a usable table (truncated, edited)
is named in a warning and measured again.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

from headprune.atomic import write_json_atomic
from headprune.costs.replay import attention_parts, record_attention_calls, replay
from headprune.costs.timing import Clock, interleaved
from headprune.heads.adapters import model_shape
from headprune.heads.surgery import heads_of_kv_groups, kv_group_heads, prune_heads

log = logging.getLogger(__name__)


def cache_key(model: nn.Module, batch: int, seq: int) -> dict:
    param = next(model.parameters())
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    return {"config": config, "device": str(param.device), "device_name": _device_name(param.device),
            "dtype": str(param.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "batch": batch, "seq": seq, "torch": torch.__version__}


def latency_table(model: nn.Module, batch: int, seq: int, cache_dir: str | Path | None = None, warmup: int = 1,
                  repeats: int = 5, seed: int = 0) -> dict:
    """{"layer_ms": {k: ms}, "forward_ms": ms, "key": ..., "cached": bool, "path": str, "seconds": s}
    for `model` (unpruned, no HeadMask hooks), measured or read from the cache."""
    key = cache_key(model, batch, seq)
    folder = Path(os.path.expanduser(cache_dir or "~/.cache/headprune/latency"))
    path = folder / (hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16] + ".json")
    if path.is_file():
        cached = read_cached(path, json.loads(json.dumps(key, default=str)), len(kv_group_heads(model)))
        if cached is not None:
            return {**cached, "cached": True, "path": str(path), "seconds": 0.0}
    start = time.perf_counter()
    table = measure(model, batch, seq, warmup, repeats, seed)
    saved = {"key": key, **table}
    write_json_atomic(path, json.loads(json.dumps(saved, default=str)))
    return {**saved, "cached": False, "path": str(path), "seconds": time.perf_counter() - start}


def read_cached(path: Path, key: dict, n_units: int) -> dict | None:
    """The table cached in `path` for `key` (layer_ms keyed by int k = 0..n_units), or None: for
    another key (measure anew), or for a file that is not a usable table (truncated by a kill, not
    a JSON object, a unit count missing, an entry that is not a finite number >= 0), which is
    named in a warning and then overwritten by the new measurement."""
    def bad(why: str) -> None:
        log.warning("latency cache %s %s; measuring again (the file will be overwritten)", path, why)

    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return bad(f"is not valid JSON (truncated?): {err}")
    if not isinstance(saved, dict):
        return bad(f"holds a {type(saved).__name__}, not a table (a JSON object)")
    if saved.get("key") != key:
        return None
    layer_ms, forward_ms = saved.get("layer_ms"), saved.get("forward_ms")
    if not isinstance(layer_ms, dict) or set(layer_ms) != {str(k) for k in range(n_units + 1)}:
        return bad(f"has layer_ms {str(layer_ms)[:80]}; expected one entry per kept unit count 0..{n_units}")
    for name, value in [*((f"layer_ms[{k}]", v) for k, v in layer_ms.items()), ("forward_ms", forward_ms)]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return bad(f"has {name}={value!r}; allowed: a finite number of milliseconds >= 0")
    return {**saved, "layer_ms": {int(k): float(v) for k, v in layer_ms.items()}}


@torch.no_grad()
def measure(model: nn.Module, batch: int, seq: int, warmup: int = 1, repeats: int = 5, seed: int = 0) -> dict:
    """Time layer 0's attention with k = 0..U units and one dense forward, interleaved."""
    device = next(model.parameters()).device
    n_layers, n_units = model_shape(model)[0], len(kv_group_heads(model))
    parts_per_layer = len(attention_parts(model)) // n_layers
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(device)  # (B, T)
    was_training = model.training
    model.eval()
    cases = {"forward": lambda: model(input_ids=ids)}
    for k in range(n_units + 1):
        twin = copy.deepcopy(model).eval()
        prune_heads(twin, heads_of_kv_groups(twin, {layer: range(k, n_units) for layer in range(n_layers)}))
        calls = record_attention_calls(twin, ids)[:parts_per_layer]  # layer 0's calls
        cases[str(k)] = lambda c=calls: replay(c)
        del twin  # the recorded calls keep layer 0's modules and inputs alive, nothing else
    try:
        stats = interleaved(cases, Clock(device), warmup=warmup, repeats=repeats)
    finally:
        model.train(was_training)
    return {"layer_ms": {k: stats[str(k)].median_ms for k in range(n_units + 1)},
            "forward_ms": stats["forward"].median_ms, "warmup": warmup, "repeats": repeats,
            "spread_ms": {name: st.spread() for name, st in stats.items()}}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} {platform.processor() or ''}".strip()


@torch.no_grad()
def measured_latency(dense: nn.Module, pruned: nn.Module, budget, rounds: list[dict] | None = None) -> dict:
    """The pruned model's forward latency against the dense one's, timed together (interleaved) at
    the budget's batch x seq (`budget`: a latency budget's settings), next to what the lookup
    table predicted for its layout. Only the shapes matter: `dense` may hold any weights."""
    device = next(pruned.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dense.config.vocab_size, (budget.batch, budget.seq), generator=g).to(device)
    modes = dense.training, pruned.training
    dense.eval(), pruned.eval()
    try:
        stats = interleaved({"dense": lambda: dense(input_ids=ids), "pruned": lambda: pruned(input_ids=ids)},
                            Clock(device), warmup=budget.warmup, repeats=budget.repeats)
    finally:
        dense.train(modes[0]), pruned.train(modes[1])
    measured = stats["pruned"].median_ms / stats["dense"].median_ms
    predicted = (rounds or [{}])[-1].get("budget", {}).get("predicted_share")
    out = {"dense_ms": stats["dense"].median_ms, "pruned_ms": stats["pruned"].median_ms, "measured_share": measured,
           "target_share": budget.target, "batch": budget.batch, "seq": budget.seq,
           "threads": torch.get_num_threads(), "repeats": budget.repeats}
    if predicted is not None:
        out.update(predicted_share=predicted, prediction_error=measured - predicted)
    return out
