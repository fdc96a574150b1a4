"""Which removed layers break Gemma-3-270M at 2/3 of its KV bytes removed at 4096: perplexity of a few
hand-made layouts, beside the one kv_modes=retrieval chose (results/gemma3_270m/retrieval_uniform.json).

    HEADPRUNE_DATA_DIR=../shared/data OMP_NUM_THREADS=1 python experiments/llm_kv_modes/gemma_removal.py

writes results/gemma3_270m/removal_probe.json: per layout, the removed (and windowed) layers, the KV bytes
held at 4096 (`costs.kv_bytes.model_bytes`, static: sliding layers at the 512 tokens they keep, as the
budget prices them) as a share of dense's, and
Tiny Shakespeare held-out perplexity at seq 4096 with BOS on the first 8192 tokens (the experiment's
evaluation: 2 windows). Gemma-3-270M has one KV head per layer, so a unit is a layer; 15 of its 18 layers
slide a 512-token window of their own and can only be kept full or removed. Why: kv_modes=retrieval with
unit_value=uniform values every unit full at 1, so between sliding layers it removes the first ones
(layers 0 and 1: ties broken by index); this says whether that, or removing the three global layers, is
what the model cannot lose.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch
import transformers

from headprune.costs.kv_bytes import model_bytes
from headprune.data.corpora import corpus_ids
from headprune.evaluation.perplexity import Windows, perplexity
from headprune.heads.windows import KVLayout, apply_kv_layout
from headprune.models.gguf import converted, gguf_source

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "gemma3_270m" / "removal_probe.json"
SEQ, TOKENS = 4096, 8192
GLOBAL = [5, 11, 17]
LAYOUTS = {  # name: (removed layers, windowed layers (64 + 448 tokens), why)
    "dense": ([], [], "nothing removed (the run's dense evaluation: 30.41)"),
    "retrieval_choice": ([0, 1, *GLOBAL], [], "what kv_modes=retrieval chose at 0.34 (ties among sliding layers by index)"),
    "global_only": (GLOBAL, [], "the three global layers only (over the 0.34 budget)"),
    "first_two": ([0, 1], [], "layers 0 and 1 only"),
    "layer_0": ([0], [], "layer 0 only"),
    "layer_5": ([5], [], "the first global layer only"),
    "layer_17": ([17], [], "the last global layer only"),
    "global_low_fisher": ([13, 14, *GLOBAL], [], "the global layers and the two sliding layers of least summed Fisher "
                                                "score (the run's rounds[0].scores)"),
    "global_late": ([15, 16, *GLOBAL], [], "the global layers and the two last sliding layers"),
    "window5_late": ([11, 14, 15, 16, 17], [5], "layer 5 windowed, the two later global layers and three late sliding "
                                                "ones removed (0.34 without removing layer 5)"),
}


def main() -> None:
    folder = converted(gguf_source("gemma3_270m"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = corpus_ids("tinyshakespeare", "held_out", tokenizer, os.environ.get("HEADPRUNE_DATA_DIR"))
    windows = Windows.cut(ids, SEQ, tokenizer.bos_token_id, TOKENS)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    rows = {}
    for name, (removed, windowed, why) in LAYOUTS.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="sdpa").eval()
        dense_bytes = sum(model_bytes(model, SEQ, modes=[["full"]] * 18, sink=0, window=1, static=True))
        layout = KVLayout([["removed" if l in removed else "window" if l in windowed else "full"] for l in range(18)],
                          sink=64, window=448)
        apply_kv_layout(model, layout)
        start = time.perf_counter()
        result = perplexity(model, windows, batch_size=1)
        rows[name] = {"removed_layers": removed, "windowed_layers": windowed, "why": why,
                      "kv_share": sum(model_bytes(model, SEQ, static=True)) / dense_bytes,
                      "perplexity": result, "seconds": round(time.perf_counter() - start, 1)}
        print(name, rows[name]["kv_share"], result["ppl"], flush=True)
    OUT.write_text(json.dumps({"model": "gemma3_270m", "seq": SEQ, "tokens": TOKENS, "corpus": "tinyshakespeare held_out",
                               "commit": commit, "threads": torch.get_num_threads(), "load_average_end": os.getloadavg(),
                               "layouts": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
