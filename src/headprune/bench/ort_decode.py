"""Decode in ONNX Runtime: each export's decode graph (`deploy.onnx_decode`: past keys and values
in, present out; a KV-modes export's windowed units in fixed rings of sink + window slots) against
the dense model's, per token at long contexts, and the bytes of the past each holds.

Why: the `llm` and `serve` sections time PyTorch; a user serving an ONNX decode graph asks whether
the rings' saving survives ONNX Runtime. Per graph (the dense origin, `bench.origin`, and each
export, `load_pruned` with its windows): written by `export_onnx_decode` and checked against
PyTorch (`check_onnx_decode`, refused when `judge_decode` fails), as `headprune-export
--onnx-decode` does; with `graphs` set they are kept in that folder and reused when their passed
check is beside them. Per context: a prompt of `context - new_tokens` seeded random ids prefilled
in chunks of `chunk` tokens (untimed: the graph takes a past and several new tokens), then,
interleaved (`costs.timing.interleaved`), `new_tokens` greedy steps from that past, each graph
feeding back its own tokens and present. Rows: median ms per token, the speed-up over dense, the
bytes of the past after the prefill (ONNX arrays, the rings' int64 slot indices included: the full
units' keys and values grow with the context, the rings do not) and their share of dense's.
"""
from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
from omegaconf import MISSING

from headprune.bench import render
from headprune.bench.llm import one_origin
from headprune.bench.llm import exports as llm_exports
from headprune.bench.origin import export_name, load_dense, origin_of
from headprune.bench.sections import Section, SectionInputs, register
from headprune.costs.timing import Case, Clock, interleaved
from headprune.report import Column
from headprune.tasks import max_positions

log = logging.getLogger(__name__)
SETTING = "bench.ort_decode.pruned_dirs"


@dataclass
class OrtDecodeSettings:
    enabled: bool = MISSING
    pruned_dirs: List[str] = MISSING  # the exports; []: bench.llm.pruned_dirs, else [bench.pruned_dir]
    contexts: List[int] = MISSING  # prompt + new tokens
    new_tokens: int = MISSING  # greedy steps per timed round
    chunk: int = MISSING  # prefill tokens per call
    graphs: Optional[str] = None  # folder keeping the graphs and their checks (None: a temporary one)


def exports(bench) -> list[str]:
    return list(bench.ort_decode.pruned_dirs) or llm_exports(bench)


def decode_graph(name: str, load, graphs: Path) -> tuple[Path, dict]:
    """`<graphs>/<name>.onnx` and its check against PyTorch (`<name>.check.json`, as headprune-export
    writes it), both written from `load()` when the graph is not there yet; a graph without a passed
    check is refused, naming the file."""
    from headprune.deploy.onnx_decode import check_onnx_decode, export_onnx_decode, judge_decode

    path, check = graphs / f"{name}.onnx", graphs / f"{name}.check.json"
    if not path.is_file():
        model = load()
        export_onnx_decode(model, path)
        report = check_onnx_decode(model, path)
        failures = judge_decode(report)
        check.write_text(json.dumps({**report, "passed": not failures, "failures": failures}, indent=2) + "\n")
    report = json.loads(check.read_text()) if check.is_file() else {}
    if not report.get("passed"):
        raise ValueError(f"{path}: no passed check against PyTorch beside it ({check}: "
                         f"{report.get('failures', 'missing')}); remove the graph to export and check it again")
    return path, {k: report[k] for k in ("prefill", "decode", "tokens_equal", "prompt", "steps")}


def empty_past(session) -> list[np.ndarray]:
    """The graph's past for a prefill at batch 1: no past token, every ring slot unused."""
    from headprune.deploy.onnx_decode import DECODE_INPUTS
    from headprune.heads.windowed_attention import EMPTY_SLOT

    out = []
    for spec in session.get_inputs()[len(DECODE_INPUTS):]:
        shape = [1 if d == "batch" else 0 if d == "past_len" else d for d in spec.shape]
        out.append(np.full(shape, EMPTY_SLOT, dtype=np.int64) if spec.name == "past_window_slots"
                   else np.zeros(shape, dtype=np.float32))
    return out


def _past_names(session) -> list[str]:
    from headprune.deploy.onnx_decode import DECODE_INPUTS

    return [i.name for i in session.get_inputs()][len(DECODE_INPUTS):]


def step(session, names: list[str], ids: np.ndarray, past: list[np.ndarray], seen: int):
    """One call: `ids` (1, T) after `seen` tokens; (logits of the last token (1, V), present)."""
    t = ids.shape[1]
    feed = {"input_ids": ids, "attention_mask": np.ones((1, seen + t), dtype=np.int64),
            "position_ids": np.arange(seen, seen + t, dtype=np.int64)[None], **dict(zip(names, past))}
    out = session.run(None, feed)
    return out[0][:, -1], out[1:]


def prefill(session, prompt: np.ndarray, chunk: int):
    """(the next greedy token (1, 1), the past, tokens seen) after `prompt` (1, T), `chunk` tokens a call."""
    names = _past_names(session)
    past, seen, last = empty_past(session), 0, None
    for start in range(0, prompt.shape[1], chunk):
        last, past = step(session, names, prompt[:, start:start + chunk], past, seen)
        seen = min(start + chunk, prompt.shape[1])
    return last.argmax(-1).reshape(1, 1).astype(np.int64), past, seen


def decode(session, token: np.ndarray, past: list[np.ndarray], seen: int, new_tokens: int) -> None:
    """`new_tokens` greedy steps from `past`, each feeding back its own token and present."""
    names = _past_names(session)
    for i in range(new_tokens):
        last, past = step(session, names, token, past, seen + i)
        token = last.argmax(-1).reshape(1, 1).astype(np.int64)


def time_graphs(sessions: dict, vocab: int, contexts: list[int], new_tokens: int, chunk: int, clock: Clock,
                warmup: int, repeats: int, seed: int = 0) -> list[dict]:
    """Rows per context and graph (module docstring); `sessions`: name -> session, "dense" among them."""
    rows = []
    for context in contexts:
        prompt = torch.randint(0, vocab, (1, context - new_tokens), generator=torch.Generator().manual_seed(seed))
        prompt = prompt.numpy()  # (1, T)
        starts = {name: prefill(s, prompt, chunk) for name, s in sessions.items()}
        cases = {name: Case(run=lambda state, s=s: decode(s, *state, new_tokens), setup=lambda start=starts[name]: start)
                 for name, s in sessions.items()}  # a graph never writes its inputs: the past is reused
        log.info("ort_decode context=%d: timing %d graphs", context, len(sessions))
        stats = interleaved(cases, clock, warmup=warmup, repeats=repeats)
        held = {name: int(sum(a.nbytes for a in start[1])) for name, start in starts.items()}
        for name in sessions:
            per_token = stats[name].scaled(new_tokens)
            rows.append({"model": name, "context": context, "new_tokens": new_tokens, "chunk": chunk,
                         "per_token_ms": per_token.median_ms, "per_token_spread_ms": per_token.spread(),
                         "speedup": stats["dense"].median_ms / stats[name].median_ms, "held_bytes": held[name],
                         "held_share": held[name] / held["dense"], "repeats": per_token.n})
    return rows


def graph_sessions(models: dict[str, callable], graphs: Path, threads: int) -> tuple[dict, dict, dict]:
    """(name -> session, name -> graph path, name -> check) for `models` (name -> loader)."""
    try:
        from headprune.deploy.onnx import onnx_session
    except ImportError as err:
        raise ImportError(f"bench.ort_decode needs the onnx extra: pip install \"headprune[onnx]\" ({err}); or set "
                          "bench.ort_decode.enabled=false") from None
    paths, checks = {}, {}
    for name, load in models.items():
        paths[name], checks[name] = decode_graph(name, load, graphs)
    return {name: onnx_session(p, threads) for name, p in paths.items()}, paths, checks


def run(inputs: SectionInputs) -> list[dict]:
    from headprune.deploy.hf import load_pruned

    s, dirs = inputs.bench.ort_decode, exports(inputs.bench)
    first = load_pruned(dirs[0]).eval()
    dense_name = origin_of(dirs[0], inputs.bench.dense_model, SETTING)
    loaders = {"dense": lambda: load_dense(dense_name, first, dirs[0], torch.device("cpu"), torch.float32).eval()}
    loaders.update({export_name(d): (lambda d=d: load_pruned(d).eval()) for d in dirs})
    with tempfile.TemporaryDirectory(prefix="headprune-ort-decode-") as scratch:
        graphs = Path(s.graphs).expanduser() if s.graphs else Path(scratch)
        graphs.mkdir(parents=True, exist_ok=True)
        sessions, paths, checks = graph_sessions(loaders, graphs, inputs.bench.threads)
        rows = time_graphs(sessions, first.config.vocab_size, list(s.contexts), s.new_tokens, s.chunk, inputs.clock,
                           inputs.bench.warmup, inputs.bench.repeats, inputs.cfg.seed)
    for r in rows:
        r.update(dense_model=dense_name, graph=str(paths[r["model"]]) if s.graphs else None, check=checks[r["model"]],
                 runtime="onnxruntime", threads=inputs.bench.threads)
    return rows


def applies(inputs: SectionInputs) -> bool:
    """ONNX Runtime's CPU sessions: not on a GPU run."""
    return inputs.device.type == "cpu"


def check(settings, bench) -> None:
    """Values, and (when enabled) causal-LM exports of one dense model within its positions, before any work."""
    if not settings.contexts or min(settings.contexts) < 1:
        raise ValueError(f"bench.ort_decode.contexts={list(settings.contexts)} is not allowed; allowed: a non-empty "
                         "list of positive integers")
    for name in ("new_tokens", "chunk"):
        if settings[name] < 1:
            raise ValueError(f"bench.ort_decode.{name}={settings[name]} is not allowed; allowed: an integer >= 1")
    if min(settings.contexts) <= settings.new_tokens:
        raise ValueError(f"bench.ort_decode.contexts={list(settings.contexts)}: each must exceed "
                         f"bench.ort_decode.new_tokens={settings.new_tokens} (the prompt is context - new_tokens)")
    if not settings.enabled:
        return
    dirs = exports(bench)
    if not dirs:
        raise ValueError("bench.ort_decode.enabled=true needs pruned exports: bench.ort_decode.pruned_dirs=[<folder>,...], "
                         "bench.llm.pruned_dirs or bench.pruned_dir")
    one_origin(dirs, SETTING, bench.dense_model)
    names = ["dense", *map(export_name, dirs)]
    if len(set(names)) != len(names):
        raise ValueError(f"{SETTING}: {list(dirs)} give the row names {names}; allowed: folders with distinct names "
                         "(a run dir's export/ is named after the run dir), none named dense")
    from headprune.deploy.hf import read_config

    limit = max_positions(read_config(dirs[0]))
    if limit is not None and max(settings.contexts) > limit:
        raise ValueError(f"bench.ort_decode.contexts={list(settings.contexts)} exceeds the model's {limit} positions; "
                         f"allowed: at most {limit}")


def summary(rows: list[dict], results: dict) -> dict:
    """Per export at the longest context: per-token speed-up over dense and the past's share of dense's."""
    longest = max(r["context"] for r in rows)
    return {f"{r['model']}/context{longest}": {"speedup": r["speedup"], "held_share": r["held_share"]}
            for r in rows if r["context"] == longest and r["model"] != "dense"}


def summary_lines(block: dict) -> list[str]:
    return [f"- ONNX Runtime decode {key}: per token {d['speedup']:.2f}x dense, past {d['held_share']:.4f} of dense's "
            f"bytes" for key, d in block.items()]


COLUMNS = [
    Column("model", lambda r: r["model"], False), render.fmt("context", "d"),
    render.timed("ms / token", "per_token_ms"), render.ratio("speed-up", "speedup"),
    Column("past bytes", lambda r: f"{r['held_bytes']:,}", True), render.fmt("held_share", ".4f", "past / dense"),
]


def table(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    heading = (f"## ONNX Runtime decode ({r0['new_tokens']} new tokens per round, prefill chunks of {r0['chunk']}, "
               f"{r0['threads']} thread(s))")
    return render.table(heading, rows, COLUMNS)


SECTION = register(Section("ort_decode", OrtDecodeSettings, run, table, summary, summary_lines, check=check,
                           applies=applies))
