"""One training step's forward and backward of SmolLM2-135M at `seq` tokens with windowed KV units
(layers 2-29: groups 0 and 2 windowed, 64 + 448 tokens), with or without activation checkpointing
(`headprune.models.build.checkpoint_activations`, what model.gradient_checkpointing=true applies):
the wall seconds and the process's peak resident memory, as one JSON line on stdout.
    OMP_NUM_THREADS=2 python experiments/llm_kv_modes/kl_memory/probe.py 4096 checkpointing
"""
import json
import os
import resource
import subprocess
import sys
import time

import torch

from headprune.heads.windows import KVLayout, KVWindows
from headprune.models.build import build_model, checkpoint_activations

seq, mode = int(sys.argv[1]), sys.argv[2]
if mode not in ("checkpointing", "none"):
    raise SystemExit("mode: checkpointing or none")
torch.manual_seed(0)
model = build_model("smollm2", task="causal_lm", attn_implementation="sdpa")
modes = tuple(("full",) * 3 if layer < 2 else ("window", "full", "window") for layer in range(30))
KVWindows(KVLayout(modes, 64, 448)).attach(model)
if mode == "checkpointing":
    checkpoint_activations(model)
model.train()
ids = torch.randint(10, 40000, (1, seq))  # (1, T)
start = time.perf_counter()
loss = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1).mean()
loss.backward()
reached = sum(p.grad is not None for p in model.model.layers.parameters())
print(json.dumps({"seq": seq, "mode": mode, "seconds": round(time.perf_counter() - start, 1),
                  "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                  "layer_params_with_grad": reached, "layer_params": len(list(model.model.layers.parameters())),
                  "threads": torch.get_num_threads(), "load_average_end": os.getloadavg(),
                  "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()}))
