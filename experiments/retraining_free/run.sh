#!/usr/bin/env bash
# Retraining-free pruning of the SST-2 fine-tuned MiniLM (issue 14; Kwon et al. 2022), no training:
#   (a) taylor:   Taylor scores, global ranking, masking only (the no-retraining baseline so far)
#   (b) fisher:   Fisher information of the mask + mask rearrangement by the block Fisher
#   (c) fisher_ls: (b) + least-squares tuning of the surviving heads' scales
# at 50/60/70/80% of the heads removed (budget=heads) and at latency budgets of 0.9/0.8/0.7 of the
# dense forward (batch 32; seq 64 and 128), 2,048 calibration sentences from the training file.
# Run from the repository root on an otherwise idle machine (latency is measured), default threads:
#   FT=<the sst2_finetune export> bash experiments/retraining_free/run.sh [heads|latency|collect]
# (no argument: everything, then the tables).
set -euo pipefail
OUT=${OUT:-experiments/retraining_free/runs}
FT=${FT:-experiments/metric_curves/runs/finetune/export}
CACHE=${CACHE:-$OUT/latency_cache}
declare -A ARM=(
    [taylor]="metric=taylor pruning.rearrange=false recovery=none"
    [fisher]="metric=fisher pruning.rearrange=true recovery=none"
    [fisher_ls]="metric=fisher pruning.rearrange=true recovery=least_squares"
)
one() {  # one <name> <overrides...>
    local dir=$OUT/$1; shift
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    local start end
    start=$(date +%s.%N)
    headprune-train experiment=retraining_free model.pretrained=$FT hydra.run.dir=$dir overwrite=true "$@"
    end=$(date +%s.%N)
    python -c "import json,sys; json.dump({'wall_seconds': round($end - $start, 1)}, open('$dir/wall.json', 'w'))"
}
heads() {
    for arm in taylor fisher fisher_ls; do
        for s in 0.5 0.6 0.7 0.8; do
            one "${arm}_heads_${s}" ${ARM[$arm]} budget=heads schedule.target_sparsity=$s
        done
    done
}
latency() {
    for seq in 64 128; do
        for t in 0.9 0.8 0.7; do
            for arm in taylor fisher fisher_ls; do
                one "${arm}_latency_${t}_seq${seq}" ${ARM[$arm]} budget=latency budget.target=$t budget.seq=$seq \
                    budget.cache_dir=$CACHE
            done
        done
    done
}
collect() { python experiments/retraining_free/collect.py --runs $OUT --out experiments/retraining_free \
              --beside experiments/recovery/results; }
case ${1:-all} in
    heads) heads ;;
    latency) latency ;;
    collect) collect ;;
    all) heads; latency; collect ;;
esac
