#!/usr/bin/env bash
# Iterative vs one-shot pruning of SmolLM2-135M-Instruct to 1 of 3 KV groups per layer (issue 38, item 5):
# experiment=llm_iterative (conf/experiment/llm_iterative.yaml: llm_kv's calibration and evaluation,
# budget.target=0.34, after each round the refit then KL steps, bf16-mixed), two allocations x two schedules,
# the same 150 KL steps in all. Arms are a grid, conf/experiment/llm_iterative/arms.yaml, <alloc>_<schedule> (each
# says what it runs), each run into the run dir of its name:
#   <alloc>_one_shot    one round to 1 of 3 groups, refit, 150 KL steps
#   <alloc>_iterative   2 of 3 groups, refit, 75 KL steps; then 1 of 3, refit, 75 KL steps
# alloc: uniform (layer_policy=uniform + rearrangement) or attention_drop (layer_policy=attention_drop,
# He et al. 2024, the best uneven allocation of experiments/llm_uneven). Perplexity (both corpora, seq 128
# and 2048) and the chat answers; zero-shot off in the arms: on this shared 2-core machine its 600
# log-likelihood requests took ~6 s each (an hour a model).
#   headprune-train experiment=llm_iterative/uniform_iterative      # one arm (run.sh adds its run dir)
# Two streams side by side, one torch thread each (the machine has 2 cores):
#   bash experiments/llm_iterative/run.sh a & bash experiments/llm_iterative/run.sh b; wait
#   bash experiments/llm_iterative/run.sh collect
# One arm: bash experiments/llm_iterative/run.sh one <arm> [dense: true|false]
# A killed arm continues from its newest recovery checkpoint when run again (ckpt_path=<dir>/recovery/last.ckpt).
# From the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data. Raw results:
# experiments/llm_iterative/results/<arm>.json (copied from the run dirs by collect.py).
set -euo pipefail
OUT=${OUT:-../llmruns/llm_iterative}  # run dirs (exports: hundreds of MB) outside the repository
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ARMS=$(python -m headprune.apps.arms llm_iterative)  # every arm of conf/experiment/llm_iterative/arms.yaml
one() {  # one <arm> <evaluate the dense model: true|false>
    local arm=$1 dir=$OUT/$1 resume="" start end
    echo "$ARMS" | grep -qx "$arm" || { echo "run.sh: no arm $arm; conf/experiment/llm_iterative/arms.yaml has:" $ARMS >&2; exit 2; }
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    [ -f "$dir/recovery/last.ckpt" ] && resume="ckpt_path=$dir/recovery/last.ckpt"
    [ -z "$resume" ] && resume="overwrite=true"
    start=$(date +%s.%N)
    headprune-train experiment=llm_iterative/$arm hydra.run.dir=$dir evaluation.dense=$2 $resume
    end=$(date +%s.%N)
    python -c "import json, os; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS, 'load_average_end': os.getloadavg(), 'resumed': '$resume'.startswith('ckpt_path')}, open('$dir/wall.json', 'w'))"
}
case ${1:-all} in
    a) one attention_drop_one_shot true; one uniform_one_shot false ;;
    b) one attention_drop_iterative false; one uniform_iterative false ;;
    one) one "$2" "${3:-false}" ;;
    collect) python experiments/llm_iterative/collect.py ;;
    all) "$0" a; "$0" b; "$0" collect ;;
    *) echo "run.sh: $1: a, b, one <arm> [true|false], collect or all" >&2; exit 2 ;;
esac
