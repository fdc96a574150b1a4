"""headprune's KV layouts (or dense) over the same RULER samples and loop as run_press.py, in
headprune's venv (transformers 5.x): the layout of an llm_kv_modes arm put on the model without
training (`Layout.apply`: removed units physically removed, windowed units restricted), each
sample's context prefilled into generate()'s kind of cache (its windowed layers keep only sink +
window), then the question and greedy tokens (run_press.decode). `held_bytes` is what the cache holds
after the prefill (headprune.costs.kv_bytes.cache_bytes, the one counter: full units' keys and values plus the
windowed units' kept ones), read from the cache, not priced; `kept` is its share of what the dense model's own
cache holds (`native_bytes`: run_press.native_tokens, every layer's context where no layer slides).

    PYTHONPATH=src nice /work/main/.venv/bin/python experiments/peers_kvpress/run_ours.py \\
        --layout experiments/llm_kv_modes/results/measured_retrieval_clamped_last_layout.json \\
        --samples experiments/peers_kvpress/samples/smollm2_4096.jsonl \\
        --model ~/.cache/headprune/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f \\
        --out experiments/peers_kvpress/raw --name ours_measured_retrieval_last_0.34 --threads 1
    (--layout dense: the dense model, the check of run_press.py's dense under kvpress's transformers;
    several --layout / --name pairs: each sample through each in turn, one model copy per layout)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_press import cache_bytes, decode, load_samples, native_tokens, split_prompt  # noqa: E402


def layout_of(path: Path):
    """The Layout an llm_kv_modes raw file holds (`final.kv_layout`)."""
    from headprune.deploy.layout_file import read_layout

    return read_layout(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", nargs="+", required=True,
                        help="llm_kv_modes results jsons with final.kv_layout, or dense")
    parser.add_argument("--samples", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder: <name>.json")
    parser.add_argument("--name", nargs="+", required=True, help="one raw file name per --layout")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tasks", nargs="*", default=None)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    if len(args.name) != len(args.layout):
        parser.error(f"{len(args.layout)} --layout but {len(args.name)} --name: allowed: one name per layout")
    layouts = [None if spec == "dense" else layout_of(Path(spec)) for spec in args.layout]
    samples = load_samples(args.samples, args.tasks, args.limit)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.utils import logging as hf_logging

    from headprune.costs.kv_bytes import cache_bytes as counted_bytes

    hf_logging.disable_progress_bar()
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    runs = []
    for spec, name, layout in zip(args.layout, args.name, layouts):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
        config = model.config  # the dense model's (read before the layout removes anything)
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
        layer_token = per_token // config.num_hidden_layers  # one layer's K + V bytes a token
        if layout is not None:
            layout.apply(model)
        record = {"press": name, "layout": spec, "kept": None, "samples_file": str(args.samples), "model": str(args.model),
                  "threads": args.threads, "versions": {n: version(n) for n in ("torch", "transformers")},
                  "python": platform.python_version(), "dense_bytes_per_token": per_token, "prefill": "its own",
                  "models_in_process": len(layouts), "results": []}
        if layout is not None:
            record["layout_modes"] = {m: sum(layer.count(m) for layer in layout.modes) for m in ("full", "window", "removed")}
            record["window"] = {"sink": layout.sink, "window": layout.window}
        runs.append((name, layout, model, per_token, layer_token, record))
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    args.out.mkdir(parents=True, exist_ok=True)
    for i, sample in enumerate(samples):
        context, question = split_prompt(sample)
        context_ids = tokenizer.encode(context, return_tensors="pt", add_special_tokens=False)
        question_ids = tokenizer.encode(question, return_tensors="pt", add_special_tokens=False)
        n = int(context_ids.shape[1])
        for name, layout, model, per_token, layer_token, record in runs:
            begin = time.perf_counter()
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                model.model(input_ids=context_ids, past_key_values=cache)
                prefill_s = time.perf_counter() - begin
                held = counted_bytes(cache)
                lengths = cache_bytes(cache)[1] if layout is None else None
                result = {"task": sample["task"], "index": sample["index"], "context_tokens": n,
                          "native_bytes": native_tokens(model.config, n) * layer_token,
                          "question_tokens": int(question_ids.shape[1]), "compression_ratio": 1 - held / (n * per_token),
                          "held_bytes": held, "cache_tokens_per_layer": lengths, "masked_entries": 0}
                result.update(decode(model, tokenizer, sample, n, question_ids, cache, [None] * len(model.model.layers)))
            result.update(prefill_s=round(prefill_s, 2), decode_s=round(time.perf_counter() - begin - prefill_s, 2))
            record["results"].append(result)
            record.update(kept=round(sum(r["held_bytes"] for r in record["results"])
                                     / sum(r["native_bytes"] for r in record["results"]), 4),
                          wall_s=round(time.time() - start, 1), done=i + 1, of=len(samples),
                          ru_maxrss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                          rss_after_load_kib=rss_after_load, loadavg=list(os.getloadavg()))
            path = args.out / f"{name}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)
            print(f"{i + 1}/{len(samples)} {name} {sample['task']}#{sample['index']}: {result['prediction'][:40]!r} "
                  f"({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
