#!/usr/bin/env bash
# decoder_kv: train a byte-level GPT-2 (6 layers x 8 heads) from scratch on Tiny Shakespeare,
# prune 25/50/75% of its heads with short fine-tunes, and measure validation perplexity,
# KV-cache bytes and per-token decode latency of each pruned model (headprune-bench).
# Run from the repository root with HEADPRUNE_DATA_DIR pointing at a folder with tinyshakespeare/.
# Run outputs (checkpoints, exports) stay under $OUT, which git ignores.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # 2 threads on 2 shared cores ran 4x slower here
OUT=${OUT:-experiments/decoder_kv/runs}
QUIET="trainer.enable_progress_bar=false"
# 1. train from scratch and export (~10 min on one CPU thread)
headprune-train experiment=decoder_kv_pretrain $QUIET hydra.run.dir=$OUT/pretrain
PRE=$OUT/pretrain/export
# 2. prune 25% of the heads per round, 40 fine-tuning steps after each round, to 25/50/75%
headprune-train -m experiment=decoder_kv model.pretrained=$PRE schedule.target_sparsity=0.25,0.5,0.75 $QUIET \
    hydra.sweep.dir=$OUT/prune
# 3. control: the dense model fine-tuned for the same 40/80/120 steps, nothing pruned
headprune-train -m experiment=decoder_kv model.pretrained=$PRE schedule.target_sparsity=0 \
    schedule.recover_epochs=1,2,3 $QUIET hydra.sweep.dir=$OUT/control
# 4. no fine-tuning at all: 25% more heads masked per round, re-scored each round (Michel et al.'s setting)
headprune-train experiment=decoder_kv model.pretrained=$PRE schedule.target_sparsity=0.75 schedule.epochs_per_round=0 \
    export=false $QUIET hydra.run.dir=$OUT/no_finetune
# 5. KV cache and decode latency of each pruned export against a dense model of its config
for run in "$OUT"/prune/*/; do
    headprune-bench bench.pruned_dir="${run}export" bench.encoder.enabled=false bench.repeats=20 \
        hydra.run.dir="${run}bench"
done
# 6. gather into experiments/decoder_kv/ (results.md, decoder_kv.csv, ppl_vs_sparsity.png, results/)
python experiments/decoder_kv/collect.py "$OUT" --out experiments/decoder_kv
