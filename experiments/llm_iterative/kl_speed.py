"""KL steps per second on SmolLM2-135M-Instruct: the hand-written loop the recoveries used before
issue 38 (recovery/training_steps.py at commit 2b83522, read from git, not kept in the package)
against the Lightning fit that replaced it (engine/step_fit.py), float32 and bf16-mixed, with the
live teacher and with its cached top-64 distributions. Every variant trains the same student from
the same weights on the same blocks (2 x 512 tokens of Tiny Shakespeare's training part a step,
the experiment's batch); the variants are interleaved round by round so that the machine's load
falls on all of them alike; medians over the rounds.

    OMP_NUM_THREADS=1 python experiments/llm_iterative/kl_speed.py --rounds 3 --steps 3 \
        --out experiments/llm_iterative/kl_speed.json
    python experiments/llm_iterative/kl_speed.py --table experiments/llm_iterative/kl_speed.json

The student is the dense model (no heads removed): the loop's cost, not the pruned layout's, is
what differs between the variants. The cache is built once, outside the timed steps (its cost is
one teacher forward per training block, once per run: reported separately).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

OLD_LOOP = ("2b83522", "src/headprune/recovery/training_steps.py")
VARIANTS = ("loop_fp32_live", "fit_fp32_live", "fit_bf16_live", "fit_bf16_cached")


def old_loop():
    """The pre-issue-38 `train_steps`, executed from git's copy of its module."""
    source = subprocess.run(["git", "show", f"{OLD_LOOP[0]}:{OLD_LOOP[1]}"], check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType("old_training_steps")
    exec(compile(source, f"{OLD_LOOP[0]}:{OLD_LOOP[1]}", "exec"), module.__dict__)
    return module.train_steps


def measure(rounds: int, steps: int, data_dir: str) -> dict:
    import torch

    from headprune.engine import FitPlan, Runtime, fit_steps
    from headprune.models.build import build_model, load_tokenizer
    from headprune.recovery.distill import forward_outputs, kd_loss
    from headprune.recovery.teacher_cache import build_teacher_cache, cached_kd_loss
    from headprune.tasks import CAUSAL_LM
    from tests.helpers import compose_train  # the experiment's data config, as headprune-train composes it
    from hydra.utils import instantiate

    import headprune.apps.train  # noqa: F401  (registers the schemas)

    cfg = compose_train("/tmp/kl_speed", data_dir, "experiment=llm_iterative")
    tokenizer = load_tokenizer("smollm2")
    datamodule = instantiate(cfg.data, tokenizer=tokenizer)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()  # batch 2 x 512
    batches = []
    for batch in loader:
        batches.append({k: v for k, v in batch.items()})
        if len(batches) == steps:
            break
    student = build_model("smollm2", task="causal_lm")
    teacher = build_model("smollm2", task="causal_lm").eval().requires_grad_(False)
    start_state = {k: v.clone() for k, v in student.state_dict().items()}

    def live(model, batch):
        logits, _ = forward_outputs(model, batch)
        with torch.no_grad():
            target, _ = forward_outputs(teacher, batch)
        return kd_loss(logits, target, batch, 1.0, CAUSAL_LM).mean()

    begin = time.perf_counter()
    cache = build_teacher_cache(teacher, batches, CAUSAL_LM, 1.0, 64)
    cache_seconds = time.perf_counter() - begin

    def cached(model, batch):
        logits, _ = forward_outputs(model, batch)
        return cached_kd_loss(logits, cache, batch, 1.0, CAUSAL_LM).mean()

    train_steps = old_loop()
    fp32 = Runtime.of({"accelerator": "cpu", "precision": "32-true", "enable_progress_bar": False})
    bf16 = Runtime.of({"accelerator": "cpu", "precision": "bf16-mixed", "enable_progress_bar": False})
    runs = {
        "loop_fp32_live": lambda: train_steps(student, batches, live, steps, 1e-5),
        "fit_fp32_live": lambda: fit_steps(student, batches, live, steps, 1e-5, plan=FitPlan(runtime=fp32)),
        "fit_bf16_live": lambda: fit_steps(student, batches, live, steps, 1e-5, plan=FitPlan(runtime=bf16)),
        "fit_bf16_cached": lambda: fit_steps(student, batches, cached, steps, 1e-5, plan=FitPlan(runtime=bf16)),
    }
    seconds = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name in VARIANTS:
            student.load_state_dict(start_state)
            t0 = time.perf_counter()
            runs[name]()
            seconds[name].append(round((time.perf_counter() - t0) / steps, 3))
            print(f"round {r + 1} {name}: {seconds[name][-1]} s/step", flush=True)
    first = batches[0]
    tokens = int(first["attention_mask"].sum()) if "attention_mask" in first else first["input_ids"].numel()
    return {"steps_per_run": steps, "rounds": rounds, "tokens_per_step": tokens,
            "seconds_per_step": seconds, "cache_build_seconds": round(cache_seconds, 3), "cache_blocks": len(batches),
            "threads": torch.get_num_threads(), "load_average_end": list(os.getloadavg()),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "old_loop": f"{OLD_LOOP[0]}:{OLD_LOOP[1]}", "cpu": _cpu()}


def _cpu() -> str:
    from headprune.engine.runtime import device_name
    import torch

    return device_name(torch.device("cpu"))


def table(raw: dict) -> list[str]:
    """Markdown rows: median seconds per KL step of each variant and its speed-up over the old loop."""
    base = statistics.median(raw["seconds_per_step"]["loop_fp32_live"])
    lines = ["| variant | s / step (median) | steps / s vs the old loop |", "|---|---:|---:|"]
    for name in VARIANTS:
        median = statistics.median(raw["seconds_per_step"][name])
        lines.append(f"| {name} | {median:.2f} | {base / median:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR", "../shared/data"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, help="print the table of a raw file instead of measuring")
    args = parser.parse_args(argv)
    if args.table is not None:
        print("\n".join(table(json.loads(args.table.read_text()))))
        return 0
    raw = measure(args.rounds, args.steps, args.data_dir)
    if args.out is not None:
        args.out.write_text(json.dumps(raw, indent=1) + "\n")
    print("\n".join(table(raw)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
