#!/usr/bin/env bash
# The CPU measurement of experiments/llm_kv/decode/README.md: SmolLM2-135M-Instruct (dense, the
# origin both exports record) against its exports with 1/3 and 2/3 of the KV groups removed,
# fp32, prompts 512/2048/4096, batch 1 and 8, prefill timed at batch 1 only (a CPU prefill of
# 8 x 4096 tokens takes minutes), 8 decode steps per round, 1 warm-up + 3 timed rounds.
# Usage (repository root, venv active): experiments/llm_kv/decode/run.sh THREADS OUT_DIR [OVERRIDES...]
# (later Hydra overrides win, e.g. the decode-only repeat: "bench.llm.prompt_lens=[2048,4096]"
#  "bench.llm.prefill_batches=[]" bench.llm.new_tokens=16 bench.repeats=7)
# PRUNED=<dir>,<dir>,... replaces the two exports (cpu_layouts: llamacpp/exports.py's folders, the
# uniform and the llm_uneven allocations' layouts, "bench.llm.prompt_lens=[2048,4096]" "bench.llm.batches=[1]"
# "bench.llm.prefill_batches=[]" bench.llm.new_tokens=16, THREADS 1,2).
# Exports first (no recovery, ~3 min each):
#   headprune-train experiment=llm_kv metric=magnitude pruning.rearrange=false recovery=none \
#     evaluation.enabled=false hydra.run.dir=/tmp/bench_exports/kv67        # (+ budget.target=0.34 -> kv34)
set -euo pipefail
threads=${1:-1}
out=${2:-experiments/llm_kv/decode/cpu_threads${threads}}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
headprune-bench bench.device=cpu bench.dtype=float32 \
  bench.encoder.enabled=false bench.train_step.enabled=false bench.onnxruntime.enabled=false \
  bench.decoder.enabled=false bench.llm.enabled=true \
  "bench.llm.pruned_dirs=[${PRUNED:-${KV67:-/tmp/bench_exports/kv67/export},${KV34:-/tmp/bench_exports/kv34/export}}]" \
  "bench.llm.prompt_lens=[512,2048,4096]" "bench.llm.batches=[1,8]" "bench.llm.prefill_batches=[1]" \
  "bench.llm.threads=[${threads}]" bench.llm.new_tokens=8 bench.warmup=1 bench.repeats=3 \
  hydra.run.dir="$out" hydra.output_subdir=null "${@:3}"
