"""Last-word accuracy (`last_word_local`: 2,009 held-out passages of Tiny Shakespeare and SST-2, see
headprune.evaluation.last_word) of the dense SmolLM2 and of each arm's export, one model at a time,
under the runs' precision (bf16 autocast, as their perplexities), written to
results/last_word/<model>.json:

    OMP_NUM_THREADS=1 python experiments/llm_iterative/last_word.py --runs ../llmruns/llm_iterative

The arms' runs left it out (`EVAL` in run.sh): lm-eval's requests at batch 2 were too slow beside
the KL steps; run alone at batch 8 a model takes minutes. A model whose file exists is skipped, so an
interrupted run continues; `--limit` evaluates the first n passages (recorded).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ARMS = [f"{alloc}_{schedule}" for alloc in ("attention_drop", "uniform") for schedule in ("one_shot", "iterative")]


def load(name: str, runs: Path):
    """(model, tokenizer) of the dense SmolLM2 (`dense`) or of an arm's export."""
    from transformers import AutoTokenizer

    if name == "dense":
        from headprune.models.build import build_model, resolve_pretrained

        folder = resolve_pretrained("smollm2")
        return build_model("smollm2", task="causal_lm"), AutoTokenizer.from_pretrained(folder)
    from headprune.deploy.hf import load_pruned

    export = runs / name / "export"
    return load_pruned(export), AutoTokenizer.from_pretrained(export)


def evaluate(name: str, runs: Path, data_dir: str, limit: int | None, batch_size: int) -> dict:
    from headprune.evaluation.zero_shot import zero_shot

    model, tokenizer = load(name, runs)
    model.eval()
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = zero_shot(model, tokenizer, ["last_word_local"], data_dir=data_dir, limit=limit,
                           batch_size=batch_size)["last_word_local"]
    return {"model": name, "last_word_local": scores, "limit": limit, "batch_size": batch_size,
            "autocast": "bfloat16", "seconds": round(time.perf_counter() - start, 1),
            "threads": torch.get_num_threads(), "load_average_at_end": round(os.getloadavg()[0], 2),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=HERE).stdout.strip()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, required=True, help="the arms' run dirs (each with export/)")
    parser.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR", "../shared/data"))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "last_word")
    args = parser.parse_args(argv)
    missing = [arm for arm in ARMS if not (args.runs / arm / "export" / "config.json").is_file()]
    if missing:
        parser.error(f"--runs {args.runs}: no export/ for {', '.join(missing)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ["dense", *ARMS]:
        target = args.out / f"{name}.json"
        if target.exists():
            continue
        record = evaluate(name, args.runs, args.data_dir, args.limit, args.batch_size)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(target)
        print(f"{name}: {record['last_word_local']} in {record['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
