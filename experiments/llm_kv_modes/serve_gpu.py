"""The serving sweep (bench/serve.py) of SmolLM2-135M's shape and two committed KV layouts, for a lent GPU.

    python experiments/llm_kv_modes/serve_gpu.py --out $OUT/serve_gpu.json [--device cuda] [--dtype bfloat16]
        [--contexts 4096 8192 16384] [--batches 1 8 32 128] [--memory-gib 60] [--graphs cuda_graph]

Why random weights: throughput, capacity, time to first token and cache bytes do not depend on the
values (bench/decoder.py builds its decoders the same way), and a GPU machine here reaches nothing, so
no checkpoint is needed. The model: SmolLM2-135M's shape (bench.scale.shapes.smollm2_135m: 30 layers,
9 query / 3 KV heads of 64) with 16,400 positions so that 16k contexts fit (rotary needs no table).
The layouts: `final.kv_layout` of the committed runs measured_retrieval_last (2/3 of the KV bytes
removed at 4096, 64 + 448 windows) and retrieval_85_w192 (85% removed, 64 + 192), read from
experiments/llm_kv_modes/results/, applied with `apply_kv_layout` (removed units cut, windowed ones
restricted). Per context: `serve_rows` (dense first), its rows and the device written to `--out`
after each context (a killed run keeps what finished). `--graphs cuda_graph` captures each decode
step; where capture fails the rows say so and the step runs eager.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from headprune.bench.serve import GRAPHS, serve_rows
from headprune.costs.timing import Clock
from headprune.heads.windows import KVLayout, apply_kv_layout

HERE = Path(__file__).resolve().parent
SHAPE = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, max_position_embeddings=16400, tie_word_embeddings=True)
LAYOUTS = ("measured_retrieval_last", "retrieval_85_w192")


def layout_of(run: str) -> KVLayout:
    data = json.loads((HERE / "results" / f"{run}.json").read_text())
    kv = data["budget"]["kv_modes"]
    return KVLayout(tuple(tuple(layer) for layer in data["final"]["kv_layout"]["modes"]), kv["sink"], kv["window"])


def models(device: torch.device, dtype: torch.dtype, attn: str) -> list:
    config = AutoConfig.for_model("llama", **SHAPE)
    out = []
    for name in ("dense", *LAYOUTS):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
        if name != "dense":
            apply_kv_layout(model, layout_of(name))
        out.append((name, model.to(device, dtype)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--memory-gib", type=float, default=60.0)
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--graphs", default="cuda_graph" if torch.cuda.is_available() else "none", choices=GRAPHS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if max(args.contexts) + args.new_tokens > SHAPE["max_position_embeddings"]:
        parser.error(f"--contexts: at most {SHAPE['max_position_embeddings'] - args.new_tokens}")
    if args.graphs == "cuda_graph" and args.device != "cuda":
        parser.error("--graphs cuda_graph needs --device cuda")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "dtype": args.dtype, "attn": args.attn, "threads": torch.get_num_threads(),
            "commit": commit or None, "args": {k: str(v) for k, v in vars(args).items()}, "weights": "random init"}
    every = models(device, dtype, args.attn)
    rows, start = [], time.time()
    for context in args.contexts:
        rows += serve_rows(every, context, args.batches, args.new_tokens, int(args.memory_gib * 2 ** 30), args.max_batch,
                           args.graphs, Clock(device), args.warmup, args.repeats)
        meta["seconds"] = round(time.time() - start, 1)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"context {context}: {len(rows)} rows, {meta['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
