#!/usr/bin/env bash
# Layer sensitivity of MiniLM fine-tuned on SST-2 (the model from experiments/metric_curves, stage 1):
# 1. the per-layer profile (a share of one layer's weakest Taylor heads masked, dev accuracy);
# 2. the layer-policy comparison: mask 10% of the heads per step to 70%, no training, Taylor scores.
# Run from the repository root with HEADPRUNE_DATA_DIR pointing at a folder with sst2/.
set -euo pipefail
OUT=experiments/layer_sensitivity
FT=${FT:-experiments/metric_curves/runs/finetune/export}
python $OUT/layer_profile.py --model $FT --out $OUT
headprune-train -m experiment=layer_sensitivity model.pretrained=$FT \
    layer_policy=uniform,global,sensitivity,depth_prior hydra.sweep.dir=$OUT/runs/policies
headprune-collect $OUT/runs/policies --out $OUT --label layer_policy
