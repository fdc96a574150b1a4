"""How long RULER takes on SmolLM2-135M-Instruct (dense, in memory) on this machine: the samples
built, then each task scored, with the seconds per sample, so evaluation.ruler_samples of
experiment=llm_kv_modes can be sized to the time at hand (issue 53: dense + export within ~15 min
on 2 cores). Writes ruler_timing.json beside this file.

    python experiments/llm_kv_modes/ruler_timing.py --samples 2 --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from headprune.evaluation import ruler
from headprune.models.build import build_model, load_tokenizer

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tasks", nargs="+", default=list(ruler.TASKS))
    parser.add_argument("--out", type=Path, default=HERE / "ruler_timing.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = build_model("smollm2", task="causal_lm").eval(), load_tokenizer("smollm2")
    start = time.perf_counter()
    samples = ruler.ruler_samples(tok, args.tasks, [args.context], args.samples, 0, os.environ.get("HEADPRUNE_DATA_DIR"),
                                  True)
    built = time.perf_counter() - start
    tasks = {}
    for task in args.tasks:
        start = time.perf_counter()
        scores = ruler.ruler_scores(model, tok, [s for s in samples if s["task"] == task])
        seconds = time.perf_counter() - start
        cell = scores["tasks"][task][str(args.context)]
        tasks[task] = {"seconds": round(seconds, 2), "seconds_per_sample": round(seconds / args.samples, 2),
                       "score": cell["score"], "predictions": [c["prediction"] for c in cell["cases"]],
                       "prompt_tokens": [c["prompt_tokens"] for c in cell["cases"]]}
        print(task, tasks[task], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    out = {"model": "smollm2", "context": args.context, "samples": args.samples, "threads": args.threads,
           "build_seconds": round(built, 2), "tasks": tasks,
           "score_seconds_per_sample": round(sum(t["seconds"] for t in tasks.values()) / (args.samples * len(tasks)), 2),
           "load_average_end": list(os.getloadavg()), "commit": commit,
           "command": f"python experiments/llm_kv_modes/ruler_timing.py --samples {args.samples} --threads {args.threads}"}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "tasks"}))


if __name__ == "__main__":
    main()
