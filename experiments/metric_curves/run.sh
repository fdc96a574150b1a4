#!/usr/bin/env bash
# Michel et al. (2019) curves: accuracy vs share of heads masked, no retraining, per metric.
# Run from the repository root with HEADPRUNE_DATA_DIR pointing at a folder with sst2/.
set -euo pipefail
OUT=experiments/metric_curves/runs
# 1. fine-tune MiniLM on SST-2 (one epoch over 66,837 sentences) and export it
headprune-train experiment=sst2_finetune hydra.run.dir=$OUT/finetune
FT=$OUT/finetune/export
# 2. mask 10%..90% of the heads, re-scoring before every step, one run per metric
headprune-train -m experiment=metric_curves model.pretrained=$FT \
    metric=taylor,entropy,lrp,fisher,confidence,magnitude layer_policy=global hydra.sweep.dir=$OUT/global
headprune-train -m experiment=metric_curves model.pretrained=$FT \
    metric=random metric.seed=0,1,2 layer_policy=global hydra.sweep.dir=$OUT/random
headprune-train -m experiment=metric_curves model.pretrained=$FT \
    metric=taylor,entropy layer_policy=uniform hydra.sweep.dir=$OUT/uniform
# 3. gather
headprune-collect $OUT/global $OUT/random $OUT/uniform --out experiments/metric_curves \
    --label metric metric.seed layer_policy
