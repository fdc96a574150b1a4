#!/usr/bin/env bash
# Iterative (10% of the heads per round, 1 epoch after each) vs one-shot pruning to the same target
# with the same total training budget, at 30/50/70/90% of the heads, plus a dense control.
# Run from the repository root. Each target is a Hydra multirun over the two arms' settings;
# on a 2-core machine give each lane one torch thread and run two lanes side by side:
#   bash experiments/iterative_vs_one_shot/run.sh 0.9 0.7 &  bash experiments/iterative_vs_one_shot/run.sh 0.3 &
# With no arguments it runs every target, one after another.
set -euo pipefail
OUT=experiments/iterative_vs_one_shot/runs
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
TARGETS=${*:-0.3 0.5 0.7 0.9}
for t in $TARGETS; do
    rounds=$(python -c "print(round($t / 0.1))")
    headprune-train -m experiment=iterative_vs_one_shot schedule.target_sparsity=$t \
        hydra.sweep.dir=$OUT/iterative_$t
    headprune-train -m experiment=iterative_vs_one_shot schedule=one_shot schedule.target_sparsity=$t \
        schedule.epochs_per_round=$rounds hydra.sweep.dir=$OUT/one_shot_$t
done
# The dense control: as many epochs as the 50% arms (2 + 5), no pruning; then the table and plot.
if [ $# -eq 0 ]; then
    headprune-train -m experiment=iterative_vs_one_shot schedule=one_shot schedule.target_sparsity=0.0 \
        schedule.baseline_epochs=7 schedule.epochs_per_round=0 hydra.sweep.dir=$OUT/dense_7_epochs
    python experiments/iterative_vs_one_shot/collect.py --gather $OUT --out experiments/iterative_vs_one_shot
fi
