#!/usr/bin/env bash
# Iterative (10% steps, 1 epoch each) vs one-shot pruning to the same sparsity with the same total
# fine-tuning budget (2 baseline epochs + 5 more), plus a dense control trained as long.
# The iterative arm at 50% is experiments/quickstart. Run from the repository root.
set -euo pipefail
OUT=experiments/iterative_vs_one_shot/runs
export OMP_NUM_THREADS=1
DATA="data.max_train_samples=4000 data.score_samples=512 data.max_length=64"  # as experiment=quickstart
headprune-train $DATA schedule=one_shot schedule.target_sparsity=0.5 \
    schedule.baseline_epochs=2 schedule.epochs_per_round=5 hydra.run.dir=$OUT/one_shot_0.5 &
headprune-train $DATA schedule=one_shot schedule.target_sparsity=0.0 \
    schedule.baseline_epochs=7 schedule.epochs_per_round=0 hydra.run.dir=$OUT/dense_7_epochs &
wait
mkdir -p experiments/iterative_vs_one_shot/results
for r in one_shot_0.5 dense_7_epochs; do cp $OUT/$r/results.json experiments/iterative_vs_one_shot/results/$r.json; done
