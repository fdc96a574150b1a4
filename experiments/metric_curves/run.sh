#!/usr/bin/env bash
# Michel et al. (2019) curves: accuracy vs share of heads masked, no retraining, per metric and
# layer policy (random: 3 seeds). Run from the repository root with HEADPRUNE_DATA_DIR pointing at
# a folder with sst2/.
set -euo pipefail
OUT=experiments/metric_curves/runs
# 1. fine-tune MiniLM on SST-2 (one epoch over 66,837 sentences) and export it
[ -f $OUT/finetune/export/config.json ] || headprune-train experiment=sst2_finetune hydra.run.dir=$OUT/finetune
FT=$OUT/finetune/export
# 2. mask 10%..90% of the heads, re-scoring the masked model before every step, one run per metric
for policy in global uniform; do
    headprune-train -m experiment=metric_curves model.pretrained=$FT layer_policy=$policy \
        metric=taylor,entropy,lrp,fisher,confidence,magnitude hydra.sweep.dir=$OUT/$policy/metrics
    headprune-train -m experiment=metric_curves model.pretrained=$FT layer_policy=$policy \
        metric=random metric.seed=0,1,2 hydra.sweep.dir=$OUT/$policy/random
done
# 3. gather per policy: runs.csv, results.md, curves.md (random: mean +- std over the seeds), the plot
for policy in global uniform; do
    headprune-collect $OUT/$policy --out experiments/metric_curves/$policy --label metric metric.seed \
        --mean-over metric.seed
done
