#!/usr/bin/env bash
# Issue 38, "scale": seconds and peak resident memory of each stage of the LLM pipeline (load, dense
# evaluation, Fisher scoring, the measured allocation under budget=kv, refit, KL steps, export) on
# random-init Llama-family models at SmolLM2-135M's shape, SmolLM2-360M's and Llama-3.2-1B's (with a
# 32,768-token vocabulary), 4 x 128 calibration tokens, 3 KL steps (bench.scale in conf/bench.yaml;
# the ~1B KL stage is skipped there: ~5 x 3.9 GiB in float32). Each stage runs alone in its own child
# process: never two stages at once. One torch thread, lowest priority, from the repository root
# with the venv's bin on PATH:
#   bash experiments/scale/run.sh          # writes experiments/scale/bench.json, bench.md and bench.log
#   python experiments/scale/collect.py    # README.md's tables from bench.json
set -euo pipefail
OUT=${OUT:-experiments/scale}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
nice -n 19 headprune-bench hydra.run.dir="$OUT" hydra.output_subdir=null \
    bench.device=cpu bench.threads=1 bench.scale.enabled=true \
    bench.encoder.enabled=false bench.train_step.enabled=false bench.onnxruntime.enabled=false \
    bench.decoder.enabled=false "$@"
rm -f "$OUT/bench.png"  # no panel: the tables are the result
