#!/usr/bin/env bash
# Uneven KV layouts for SmolLM2-135M-Instruct without retraining (issue 29, section 4): at 2 of 3 and
# 1 of 3 KV groups kept (budget.target=0.67 / 0.34), experiment=llm_kv's protocol (calibration 16 x 512
# tokens of Tiny Shakespeare's training part, Fisher scores, perplexity at seq 128 and 2048 on the same
# 8,192 held-out tokens and on SST-2's validation sentences). Arms are
# a grid, conf/experiment/llm_uneven/arms.yaml, <allocation>[_refit|_refit_kl] (each level says what it runs), run at each budget
# into the run dir <arm>_<budget> (kv67 or kv34):
#   allocations  uniform         layer_policy=uniform + rearrangement (the same groups lost in every layer)
#                global          layer_policy=global min_heads_per_layer=0 + rearrangement (Fisher + knapsack)
#                measured        layer_policy=measured (cost curves on 1 calibration sequence, knapsack, 2 greedy passes)
#                attention_drop  layer_policy=attention_drop (He et al. 2024: whole attention layers by 1 - cos)
#   repairs      <allocation>             bias compensation; perplexity only (zero-shot and chat answers off)
#                <allocation>_refit       the output-projection refit; zero-shot and chat answers too
#                <allocation>_refit_kl    the refit, then 50 KL steps (recovery=chain, every weight trained on
#                                         2 x 512 training tokens a step); zero-shot and chat answers too
#   headprune-train experiment=llm_uneven/measured_refit budget.target=0.34   # one arm (run.sh adds its run dir)
# A budget without a uniform run of its own here is read from experiments/llm_kv/results (collect.py).
# Two bias-compensation streams side by side at one torch thread each (the machine is shared):
#   bash experiments/llm_uneven/run.sh a & bash experiments/llm_uneven/run.sh b; wait
#   bash experiments/llm_uneven/run.sh refit        # the refit arms of attention_drop, measured, global, one at a time
#   bash experiments/llm_uneven/run.sh refit_kl     # the same with the 50 KL steps
#   bash experiments/llm_uneven/run.sh one <arm> <kv67|kv34>
#   bash experiments/llm_uneven/run.sh collect
# From the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data. Raw results:
# experiments/llm_uneven/results/<arm>_<budget>.json (copied from the run dirs by collect.py).
set -euo pipefail
OUT=${OUT:-../llmruns/llm_uneven}  # run dirs (exports: hundreds of MB) outside the repository
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ARMS=$(python -m headprune.apps.arms llm_uneven)  # every arm of conf/experiment/llm_uneven/arms.yaml
target() {  # target <budget tag>: the run's budget.target
    case $1 in
        kv67) echo 0.67 ;;
        kv34) echo 0.34 ;;
        *) echo "run.sh: budget $1: kv67 or kv34" >&2; return 2 ;;
    esac
}
one() {  # one <arm> <budget tag> <evaluate the dense model: true|false>
    local arm=$1 dir=$OUT/$1_$2 budget start end
    echo "$ARMS" | grep -qx "$arm" || { echo "run.sh: no arm $arm; conf/experiment/llm_uneven/arms.yaml has:" $ARMS >&2; exit 2; }
    budget=$(target "$2")
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    start=$(date +%s.%N)
    headprune-train experiment=llm_uneven/$arm hydra.run.dir=$dir overwrite=true budget.target=$budget evaluation.dense=$3
    end=$(date +%s.%N)
    python -c "import json, os; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS, 'load_average_end': os.getloadavg()}, open('$dir/wall.json', 'w'))"
}
case ${1:-all} in
    a) one measured kv67 false; one measured kv34 false; one global kv34 false; one uniform kv34 false ;;
    b) one attention_drop kv67 true; one attention_drop kv34 false; one global kv67 false; one uniform kv67 false ;;
    refit|refit_kl) for b in kv67 kv34; do for alloc in attention_drop measured global; do
                        one "${alloc}_$1" $b false; done; done ;;
    one) one "$2" "$3" false ;;
    collect) python experiments/llm_uneven/collect.py ;;
    all) "$0" a; "$0" b; "$0" collect ;;
    *) echo "run.sh: $1: a, b, refit, refit_kl, one <arm> <budget>, collect or all" >&2; exit 2 ;;
esac
