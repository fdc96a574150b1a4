"""Decode speed in ONNX Runtime of KV-mode exports' decode graphs (windowed units in fixed rings)
against the dense model's decode graph, and the past each holds.

    python experiments/llm_kv_modes/onnx_decode_speed.py ../llmruns/llm_kv_modes/<arm>/export [...] \
        --graphs ../llmruns/onnx_ring [--contexts 4096 8192] [--new-tokens 16] [--repeats 3] [--threads 1]

The measurement is headprune-bench's `ort_decode` section (headprune.bench.ort_decode: the graphs
written and checked against PyTorch, the chunked prefill, the interleaved greedy steps, the past's
bytes); this script runs it over exports of runs kept elsewhere, with `<graphs>/<name>.onnx` named
`dense` for the dense origin and after the run dir for each export, and keeps every context's rows
in onnx_decode.json beside it (one entry per context and graph, replacing an earlier one; threads,
load average). Through the app: `headprune-bench bench.ort_decode.enabled=true
bench.ort_decode.pruned_dirs=[<exports>] bench.ort_decode.graphs=<dir>`.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from headprune.bench.ort_decode import graph_sessions, time_graphs
from headprune.bench.origin import load_dense, origin_of
from headprune.costs.timing import Clock
from headprune.deploy.hf import load_pruned

HERE = Path(__file__).resolve().parent


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
    loaders = {"dense": lambda: load_dense(origin, first, str(args.exports[0]), torch.device("cpu"), torch.float32).eval()}
    loaders.update({e.parent.name: (lambda e=e: load_pruned(e).eval()) for e in args.exports})
    sessions, paths, checks = graph_sessions(loaders, args.graphs, args.threads)
    out = HERE / args.out
    rows = json.loads(out.read_text()) if out.is_file() else []
    for context in args.contexts:  # one at a time, written after each: a later one may be stopped
        new = time_graphs(sessions, first.config.vocab_size, [context], args.new_tokens, args.chunk, Clock("cpu"),
                          warmup=1, repeats=args.repeats)
        for r in new:
            r.update(graph=str(paths[r["model"]]), check=checks[r["model"]], device="cpu", runtime="onnxruntime",
                     threads=args.threads, load_average_end=list(os.getloadavg()))
            print(json.dumps(r))
        taken = {(r["model"], r["context"]) for r in new}
        rows = [r for r in rows if (r["model"], r["context"]) not in taken] + new
        out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
