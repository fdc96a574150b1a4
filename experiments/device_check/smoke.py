"""CUDA smoke of the KV-mode pipeline on the tiny Llama of tests/helpers.py: one headprune-train process
per case with trainer.accelerator=gpu (SMOKE_ACCEL=cpu: the same on CPU). Cases: the measured choice with a
synthetic retrieval block and the LLM evaluation (perplexity, passkey, greedy answers); KL steps with
activation checkpointing and a checkpoint; self-generated calibration; bf16-true; removal with one fine-tuning epoch (a
Trainer fit, whose teardown moves the module to the CPU) then the export's LLM evaluation. Prints one line per case
(exit status, seconds, the device and dtype results.json records, val), the output of a failed case, then
SMOKE OK or SMOKE FAILED (exit status 1).

    HEADPRUNE_DATA_DIR=../shared/data PYTHONPATH=src:. python experiments/device_check/smoke.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.helpers import kv_modes_cli, tiny_llama_folder

EVAL = ["evaluation.enabled=true", "evaluation.perplexity_seqs=[32]", "evaluation.perplexity_tokens=64",
        "evaluation.zero_shot_tasks=[]", "evaluation.generate=true", "evaluation.passkey_lengths=[250]",
        "evaluation.passkey_depths=[0.5]", "evaluation.passkey_samples=1"]
CASES = {
    "measured_eval": ["kv_modes=measured", "kv_modes.retrieval_blocks=1", "data.block_size=64", "budget.seq=64", *EVAL],
    "kl_ckpt": ["kv_modes=attention_mass", "recovery=distill", "recovery.steps=3", "recovery.alpha=1.0",
                "recovery.lr=1e-3", "recovery.checkpoint_every=2", "data.max_train_samples=6", "data.batch_size=2",
                "model.gradient_checkpointing=true"],
    "self_cal": ["kv_modes=retrieval", "data.calibration=self", "data.block_size=64", "budget.seq=64"],
    "bf16": ["kv_modes=attention_mass", "trainer.precision=bf16-true"],
    "trained": ["kv_modes=none", "schedule.epochs_per_round=1", "recovery=finetune",
                "data.max_train_samples=4", "data.batch_size=2", "trainer.num_sanity_val_steps=0", *EVAL],
}


def main() -> int:
    accelerator = os.environ.get("SMOKE_ACCEL", "gpu")
    want = "cuda" if accelerator == "gpu" else "cpu"
    print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    root = Path(tempfile.mkdtemp())
    llama = tiny_llama_folder(root / "llama")
    ok = True
    for name, extra in CASES.items():
        out = root / name
        cmd = [sys.executable, "-m", "headprune.apps.train", *kv_modes_cli(llama, 2, 6, *extra),
               f"data.data_dir={os.environ['HEADPRUNE_DATA_DIR']}", f"hydra.run.dir={out}",
               f"trainer.accelerator={accelerator}"]
        start = time.time()
        done = subprocess.run(cmd, capture_output=True, text=True)
        res = out / "results.json"
        info = json.loads(res.read_text()) if res.is_file() else {}
        runtime = info.get("runtime", {})
        print(f"== {name}: rc {done.returncode} {time.time() - start:.1f}s device {runtime.get('device')} "
              f"{runtime.get('device_name')} dtype {runtime.get('dtype')} val {info.get('final', {}).get('val')}")
        if done.returncode or not str(runtime.get("device", "")).startswith(want):
            ok = False
            print(done.stdout[-3000:], done.stderr[-6000:])
    print("SMOKE", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
