#!/usr/bin/env bash
# Issue 38 item 4, "one block of both models on the device at a time": bench.scale's scoring, measured
# allocation and refit at SmolLM2-135M's shape with the pruned model and the dense copy whole
# (model_device=run) and with their blocks streamed (model_device=cpu: pruning.model_device=cpu and
# dense_device=cpu), interleaved twice: run_1, cpu_1, run_2, cpu_2 (each a bench.json, bench.md,
# bench.log). On a CPU home and device are the same memory: the resident peak is what streaming
# costs the host; info.device / device_ratio are what a device would hold, by the residency trace.
# One torch thread, lowest priority, from the repository root with the venv's bin on PATH:
#   bash experiments/scale/model_device/run.sh
set -euo pipefail
HERE=experiments/scale/model_device
for round in 1 2; do
  for where in run cpu; do
    OUT=$HERE/${where}_$round bash experiments/scale/run.sh bench.scale.models=[smollm2_135m] \
        +bench.scale.skip.smollm2_135m=[load,dense_eval,kl,export] bench.scale.model_device=$where
  done
done
