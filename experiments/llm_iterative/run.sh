#!/usr/bin/env bash
# Iterative vs one-shot pruning of SmolLM2-135M-Instruct to 1 of 3 KV groups per layer (issue 38, item 5):
# experiment=llm_iterative (conf/experiment/llm_iterative.yaml: llm_kv's calibration and evaluation,
# budget.target=0.34, after each round the refit then KL steps, bf16-mixed), two allocations x two schedules,
# the same 150 KL steps in all:
#   <alloc>_one_shot    one round to 1 of 3 groups, refit, 150 KL steps
#   <alloc>_iterative   2 of 3 groups, refit, 75 KL steps; then 1 of 3, refit, 75 KL steps
# alloc: uniform (layer_policy=uniform + rearrangement) or attention_drop (layer_policy=attention_drop,
# He et al. 2024, the best uneven allocation of experiments/llm_uneven).
# Two streams side by side, one torch thread each (the machine has 2 cores):
#   bash experiments/llm_iterative/run.sh a & bash experiments/llm_iterative/run.sh b; wait
#   bash experiments/llm_iterative/run.sh collect
# One arm: bash experiments/llm_iterative/run.sh one <alloc> <schedule> [dense: true|false]
# A killed arm continues from its newest recovery checkpoint when run again (ckpt_path=<dir>/recovery/last.ckpt).
# From the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data. Raw results:
# experiments/llm_iterative/results/<alloc>_<schedule>.json (copied from the run dirs by collect.py).
set -euo pipefail
OUT=${OUT:-../llmruns/llm_iterative}  # run dirs (exports: hundreds of MB) outside the repository
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
declare -A ALLOC=(
    [uniform]="layer_policy=uniform pruning.rearrange=true"
    [attention_drop]="layer_policy=attention_drop pruning.rearrange=false"
)
declare -A SCHEDULE=(
    [one_shot]="schedule=one_shot recovery.options.distill.steps=150"
    [iterative]="schedule=iterative schedule.target_sparsity=0.66 schedule.step=0.33 recovery.options.distill.steps=75"
)
# perplexity (both corpora, seq 128 and 2048) and the chat answers; zero-shot left out: on this shared
# 2-core machine its 600 log-likelihood requests took ~6 s each (an hour a model). EVAL="" runs them.
EVAL=${EVAL-"evaluation.zero_shot_tasks=[]"}
one() {  # one <alloc> <schedule> <evaluate the dense model: true|false>
    local dir=$OUT/$1_$2 resume=""
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    [ -f "$dir/recovery/last.ckpt" ] && resume="ckpt_path=$dir/recovery/last.ckpt"
    [ -z "$resume" ] && resume="overwrite=true"
    local start end
    start=$(date +%s.%N)
    headprune-train experiment=llm_iterative hydra.run.dir=$dir ${ALLOC[$1]} ${SCHEDULE[$2]} evaluation.dense=$3 $EVAL $resume
    end=$(date +%s.%N)
    python -c "import json, os; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS, 'load_average_end': os.getloadavg(), 'resumed': '$resume'.startswith('ckpt_path')}, open('$dir/wall.json', 'w'))"
}
case ${1:-all} in
    a) one attention_drop one_shot true; one uniform one_shot false ;;
    b) one attention_drop iterative false; one uniform iterative false ;;
    one) one "$2" "$3" "${4:-false}" ;;
    collect) python experiments/llm_iterative/collect.py ;;
    all) "$0" a; "$0" b; "$0" collect ;;
esac
