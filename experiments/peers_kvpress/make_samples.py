"""RULER samples for the kvpress comparison, from lm-eval 0.4.13's own RULER task code
(lm_eval/tasks/ruler: prepare_niah, vt_utils, fwe_utils), for one tokenizer at one length.

The tasks that need nothing from the network: niah_single_1 ("repeat" haystack), niah_multikey_2 /
niah_multikey_3 ("needle" haystack), vt, fwe. lm-eval's task functions draw 500 samples each; this
calls the same generators with `--samples` per task (each task from its own seed: Python's `random`
and NumPy's global generators seeded with `--seed` + the task's position, as lm-eval's
evaluator seeds them before building a task).

One JSON line per sample: {"task", "context", "index", "input", "gen_prefix", "outputs",
"max_gen_toks"}: `context` is the prompt lm-eval feeds a base model (`input`, a space, `gen_prefix`:
its build_qa_turn without a chat template), `max_gen_toks` the task's generation_kwargs.

    HF_HUB_OFFLINE=1 /work/main/.venv/bin/python experiments/peers_kvpress/make_samples.py \\
        --tokenizer ~/.cache/headprune/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f \\
        --length 4096 --samples 10 --out experiments/peers_kvpress/samples/smollm2_4096.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "fwe")
MAX_GEN_TOKS = {"niah_single_1": 128, "niah_multikey_2": 128, "niah_multikey_3": 128, "vt": 30, "fwe": 50}


def prompt(input_text: str, gen_prefix: str) -> str:
    """lm-eval's prompt for a base model: the input, a space unless either side has one, the prefix."""
    if not gen_prefix:
        return input_text
    joint = input_text and not (input_text[-1].isspace() or gen_prefix[0].isspace())
    return input_text + (" " if joint else "") + gen_prefix


def generate(task: str, tokenizer, length: int, samples: int) -> list[dict]:
    """`samples` RULER samples of `task` at `length` tokens, by lm-eval's generators."""
    if task.startswith("niah"):
        from lm_eval.tasks.ruler import niah_utils
        from lm_eval.tasks.ruler.prepare_niah import generate_samples, get_haystack

        haystack, k, v = {"niah_single_1": ("repeat", "words", "numbers"),
                          "niah_multikey_2": ("needle", "words", "numbers"),
                          "niah_multikey_3": ("needle", "uuids", "uuids")}[task]
        return generate_samples(get_haystack(type_haystack=haystack), max_seq_length=length,
                                template=niah_utils.TEMPLATE, type_haystack=haystack, type_needle_k=k,
                                type_needle_v=v, num_samples=samples, TOKENIZER=tokenizer)
    if task == "vt":
        from lm_eval.tasks.ruler.vt_utils import sys_vartrack_w_noise_random

        icl = sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=500, incremental=5)[0]
        return sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=samples, max_seq_length=length,
                                           icl_example=icl)
    if task == "fwe":
        from lm_eval.tasks.ruler.fwe_utils import sys_kwext

        return sys_kwext(tokenizer=tokenizer, max_seq_length=length, num_samples=samples)
    raise ValueError(f"task {task!r}: allowed: {', '.join(TASKS)}")


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder (the converted model's)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=10, help="samples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    lines = []
    for position, task in enumerate(args.tasks):
        random.seed(args.seed + position)
        np.random.seed(args.seed + position)
        for doc in generate(task, tokenizer, args.length, args.samples):
            lines.append({"task": task, "context": prompt(doc["input"], doc["gen_prefix"]), "index": doc["index"],
                          "input": doc["input"], "gen_prefix": doc["gen_prefix"], "outputs": list(doc["outputs"]),
                          "max_gen_toks": MAX_GEN_TOKS[task], "length": doc["length"], "max_length": doc["max_length"]})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{len(lines)} samples -> {args.out}")


if __name__ == "__main__":
    main()
