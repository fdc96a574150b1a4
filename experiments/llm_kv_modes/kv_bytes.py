"""The KV cache an export really holds after a prefill, against what its layout predicts.

    python experiments/llm_kv_modes/kv_bytes.py ../llmruns/llm_kv_modes/attention_mass/export [--seq 4096]

loads the export as a user does (`load_pruned`: its windows attached from its headprune_layout.json),
prefills `seq` held-out-free random token ids (batch 1) into generate()'s kind of cache (an empty
DynamicCache, whose windowed layers become `WindowedCacheLayer`s), and writes kv_bytes.json beside
this script (one entry per export folder name's parent): the bytes the cache holds
(`costs.kv_bytes.cache_bytes`), the layout's price at batch 1 x seq (`costs.kv_bytes.model_bytes`,
in the model's dtype), and the dense model's price at the same context (every unit full).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from headprune.costs.kv_bytes import cache_bytes, model_bytes
from headprune.deploy.hf import load_pruned
from headprune.heads.windows import FULL, KV_LAYOUT_ATTR

HERE = Path(__file__).resolve().parent


def measure(export: Path, seq: int) -> dict:
    model = load_pruned(export).eval()
    layout = getattr(model, KV_LAYOUT_ATTR)
    config = model.config
    predicted = sum(model_bytes(model, seq))
    dense = sum(model_bytes(model, seq, modes=[[FULL] * len(layer) for layer in layout.modes]))
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=config)
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    held = cache_bytes(cache)
    return {"export": str(export), "seq": seq, "held_bytes": held, "predicted_bytes": predicted,
            "dense_bytes": dense, "held_share": held / dense, "prefill_seconds": round(time.perf_counter() - start, 1),
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    out = HERE / "kv_bytes.json"
    data = json.loads(out.read_text()) if out.is_file() else {}
    data[args.export.resolve().parent.name] = measure(args.export, args.seq)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
