"""Decode speed in ONNX Runtime of KV-mode exports' decode graphs (windowed units in fixed rings)
against the dense model's decode graph, and the past each holds.

    python experiments/llm_kv_modes/onnx_decode_speed.py ../llmruns/llm_kv_modes/<arm>/export [...] \
        --graphs ../llmruns/onnx_ring [--contexts 4096 8192] [--new-tokens 16] [--repeats 3] [--threads 1]

Graphs: `<graphs>/<name>.onnx`, `dense` for the dense origin (`bench.origin`) and the run dir's
name for each export (`load_pruned`, windows attached); one that is missing is written by
`deploy.onnx_decode.export_onnx_decode` and checked against PyTorch (`check_onnx_decode`, refused
when it fails), as `headprune-export --onnx-decode` does. For each context: a prompt of `context -
new_tokens` seeded random ids prefilled in chunks of `--chunk` tokens (untimed: the graph takes a
past and several new tokens), then, interleaved (`costs.timing.interleaved`), `new_tokens` greedy
steps from that past, each graph feeding back its own tokens and present. Per graph: median ms per
token, speed-up over dense, the bytes of its past after the prefill (the full units' keys and
values grow with the context, the rings do not) and their share of dense's. Writes
onnx_decode.json beside this script (one entry per context and graph, replacing an earlier one;
threads, load average).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch

from headprune.bench.origin import load_dense, origin_of
from headprune.costs.timing import Case, Clock, interleaved
from headprune.deploy.hf import load_pruned
from headprune.deploy.onnx import onnx_session
from headprune.deploy.onnx_decode import DECODE_INPUTS, check_onnx_decode, export_onnx_decode, judge_decode
from headprune.heads.windowed_attention import EMPTY_SLOT

HERE = Path(__file__).resolve().parent


def graph(name: str, load, graphs: Path) -> tuple[Path, dict]:
    """`<graphs>/<name>.onnx` and its check against PyTorch (`<name>.check.json`, as
    headprune-export writes it): both written from `load()` when the graph is not there yet; a
    graph without a passed check is refused."""
    path, check = graphs / f"{name}.onnx", graphs / f"{name}.check.json"
    if not path.is_file():
        model = load()
        export_onnx_decode(model, path)
        report = check_onnx_decode(model, path)
        failures = judge_decode(report)
        check.write_text(json.dumps({**report, "passed": not failures, "failures": failures}, indent=2) + "\n")
    report = json.loads(check.read_text()) if check.is_file() else {}
    if not report.get("passed"):
        raise SystemExit(f"{path}: no passed check against PyTorch beside it ({check}: "
                         f"{report.get('failures', 'missing')}); remove the graph to export and check it again")
    return path, {k: report[k] for k in ("prefill", "decode", "tokens_equal", "prompt", "steps")}


def empty_past(session) -> list[np.ndarray]:
    """The graph's past for a prefill at batch 1: no past token, every ring entry unused."""
    out = []
    for spec in session.get_inputs()[len(DECODE_INPUTS):]:
        shape = [1 if d == "batch" else 0 if d == "past_len" else d for d in spec.shape]
        out.append(np.full(shape, EMPTY_SLOT, dtype=np.int64) if spec.name == "past_window_slots"
                   else np.zeros(shape, dtype=np.float32))
    return out


def step(session, names: list[str], ids: np.ndarray, past: list[np.ndarray], seen: int):
    """One call: `ids` (1, T) after `seen` tokens; (logits of the last token, present)."""
    t = ids.shape[1]
    feed = {"input_ids": ids, "attention_mask": np.ones((1, seen + t), dtype=np.int64),
            "position_ids": np.arange(seen, seen + t, dtype=np.int64)[None], **dict(zip(names, past))}
    out = session.run(None, feed)
    return out[0][:, -1], out[1:]


def prefill(session, prompt: np.ndarray, chunk: int):
    """(the next greedy token (1, 1), the past) after `prompt` (1, T), fed `chunk` tokens a call."""
    names = [i.name for i in session.get_inputs()][len(DECODE_INPUTS):]
    past, seen = empty_past(session), 0
    for start in range(0, prompt.shape[1], chunk):
        last, past = step(session, names, prompt[:, start:start + chunk], past, seen)
        seen = min(start + chunk, prompt.shape[1])
    return last.argmax(-1).reshape(1, 1).astype(np.int64), past, seen


def decode(session, token: np.ndarray, past: list[np.ndarray], seen: int, new_tokens: int) -> None:
    names = [i.name for i in session.get_inputs()][len(DECODE_INPUTS):]
    for i in range(new_tokens):
        last, past = step(session, names, token, past, seen + i)
        token = last.argmax(-1).reshape(1, 1).astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", type=Path, nargs="+")
    parser.add_argument("--graphs", type=Path, required=True, help="folder of the decode graphs (written if missing)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per call")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--out", default="onnx_decode.json", help="file name beside this script")
    args = parser.parse_args()
    for e in args.exports:
        if not (e / "config.json").is_file():
            parser.error(f"{e}: not an export folder (no config.json)")
    for name, value in (("--new-tokens", args.new_tokens), ("--repeats", args.repeats), ("--chunk", args.chunk),
                        ("--threads", args.threads), *(("--contexts", c) for c in args.contexts)):
        if value < 1:
            parser.error(f"{name} {value}: allowed: an integer >= 1")
    if any(c <= args.new_tokens for c in args.contexts):
        parser.error(f"--contexts {args.contexts}: each must exceed --new-tokens {args.new_tokens}")
    args.graphs.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    first = load_pruned(args.exports[0]).eval()
    origin = origin_of(str(args.exports[0]), None, "export")
    paths, checks = {}, {}
    paths["dense"], checks["dense"] = graph("dense", lambda: load_dense(origin, first, str(args.exports[0]),
                                                                        torch.device("cpu"), torch.float32).eval(),
                                            args.graphs)
    for e in args.exports:
        name = e.parent.name
        paths[name], checks[name] = graph(name, lambda e=e: load_pruned(e).eval(), args.graphs)
    sessions = {name: onnx_session(path, args.threads) for name, path in paths.items()}
    out = HERE / args.out
    rows = json.loads(out.read_text()) if out.is_file() else []
    for context in args.contexts:
        prompt = torch.randint(0, first.config.vocab_size, (1, context - args.new_tokens),
                               generator=torch.Generator().manual_seed(0)).numpy()  # (1, T)
        starts = {name: prefill(s, prompt, args.chunk) for name, s in sessions.items()}
        cases = {name: Case(run=lambda state, s=s: decode(s, *state, args.new_tokens),
                            setup=lambda start=starts[name]: (start[0], start[1], start[2]))
                 for name, s in sessions.items()}  # the graph never writes its inputs: the past is reused
        stats = interleaved(cases, Clock("cpu"), warmup=1, repeats=args.repeats)
        held = {name: int(sum(a.nbytes for a in start[1])) for name, start in starts.items()}
        new = []
        for name in sessions:
            per_token = stats[name].scaled(args.new_tokens)
            new.append({"model": name, "graph": str(paths[name]), "context": context, "new_tokens": args.new_tokens,
                        "per_token_ms": per_token.median_ms, "per_token_spread_ms": per_token.spread(),
                        "speedup": stats["dense"].median_ms / stats[name].median_ms, "held_bytes": held[name],
                        "held_share": held[name] / held["dense"], "repeats": per_token.n, "chunk": args.chunk,
                        "check": checks[name], "device": "cpu", "runtime": "onnxruntime", "threads": args.threads,
                        "load_average_end": list(os.getloadavg())})
            print(json.dumps(new[-1]))
        taken = {(r["model"], r["context"]) for r in new}
        rows = [r for r in rows if (r["model"], r["context"]) not in taken] + new
        out.write_text(json.dumps(rows, indent=1) + "\n")  # after each context: a later one may be stopped


if __name__ == "__main__":
    main()
