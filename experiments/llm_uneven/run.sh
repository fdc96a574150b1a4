#!/usr/bin/env bash
# Uneven KV layouts for SmolLM2-135M-Instruct without retraining (issue 29, section 4): at 2 of 3 and
# 1 of 3 KV groups kept (budget.target=0.67 / 0.34), experiment=llm_kv's protocol (calibration 16 x 512
# tokens of Tiny Shakespeare's training part, Fisher scores, perplexity at seq 128 and 2048 on the same
# 8,192 held-out tokens and on SST-2's validation sentences; zero-shot and chat answers off: EVAL below), one allocation
# per arm, each with bias compensation (stream a, b) and with the output-projection refit (stream refit:
# the uniform layout's best repair in experiments/llm_kv since recovery=refit landed); a budget
# without a uniform run of its own here is read from experiments/llm_kv/results (collect.py):
#   uniform         layer_policy=uniform + rearrangement (the same groups lost in every layer)
#   global          layer_policy=global min_heads_per_layer=0 + rearrangement (Fisher + knapsack)
#   measured        layer_policy=measured (cost curves on 1 calibration sequence, knapsack, 2 greedy passes)
#   attention_drop  layer_policy=attention_drop (He et al. 2024: whole attention layers by 1 - cos)
# Two bias-compensation streams side by side at one torch thread each (the machine is shared):
#   bash experiments/llm_uneven/run.sh a & bash experiments/llm_uneven/run.sh b; wait
# the refit runs one after another (REPAIR=recovery=refit, run dirs <arm>_refit_<budget>):
#   bash experiments/llm_uneven/run.sh refit
#   bash experiments/llm_uneven/run.sh collect
# From the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data. Raw results:
# experiments/llm_uneven/results/<arm>_<budget>.json and <arm>_refit_<budget>.json (copied from the
# run dirs by collect.py). One run: [REPAIR=recovery=refit|recovery=chain] bash experiments/llm_uneven/run.sh one <arm> <budget>
# (recovery=chain: the refit, then 50 KL steps; run dirs <arm>_refit_kl_<budget>; with EVAL="" for zero-shot and answers)
set -euo pipefail
OUT=${OUT:-../llmruns/llm_uneven}  # run dirs (exports: hundreds of MB) outside the repository
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
REPAIR=${REPAIR:-recovery=bias_compensation}
case $REPAIR in  # the run dir's repair tag: none for bias compensation (the first rows' names)
    recovery=bias_compensation) TAG="" ;;
    recovery=refit) TAG=_refit ;;
    # the refit, then $STEPS steps of the KL to the unpruned model with every weight trained on 2 x 512
    # training tokens per step (recovery=chain, as experiments/llm_kv's fisher_re_refit_kl)
    recovery=chain) TAG=_refit_kl; REPAIR="recovery=chain recovery.options.distill.steps=${STEPS:-50} recovery.options.distill.alpha=1.0 recovery.options.distill.temperature=1.0 data.max_train_samples=null data.batch_size=2" ;;
    *) echo "run.sh: REPAIR=$REPAIR has no run-dir tag (recovery=bias_compensation, recovery=refit or recovery=chain)" >&2; exit 2 ;;
esac
# perplexity only (both corpora, seq 128 and 2048): the shared 2-core machine ran these at ~1/8 of a core
# each, so zero-shot and the chat answers were left out (EVAL="" runs experiment=llm_kv's full block)
EVAL=${EVAL-"evaluation.zero_shot_tasks=[] evaluation.generate=false"}
declare -A ARM=(
    [uniform]="layer_policy=uniform pruning.rearrange=true"
    [global]="layer_policy=global layer_policy.min_heads_per_layer=0 pruning.rearrange=true"
    [measured]="layer_policy=measured layer_policy.profile_samples=1 layer_policy.passes=2 pruning.rearrange=false"
    [attention_drop]="layer_policy=attention_drop pruning.rearrange=false"
)
declare -A BUDGET=([kv67]="budget.target=0.67" [kv34]="budget.target=0.34")
one() {  # one <arm> <budget tag> <evaluate the dense model: true|false>
    local dir=$OUT/$1${TAG}_$2
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    local start end
    start=$(date +%s.%N)
    headprune-train experiment=llm_kv hydra.run.dir=$dir overwrite=true ${ARM[$1]} ${BUDGET[$2]} $REPAIR \
        evaluation.dense=$3 $EVAL
    end=$(date +%s.%N)
    python -c "import json, os; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS, 'load_average_end': os.getloadavg()}, open('$dir/wall.json', 'w'))"
}
case ${1:-all} in
    a) one measured kv67 false; one measured kv34 false; one global kv34 false; one uniform kv34 false ;;
    b) one attention_drop kv67 true; one attention_drop kv34 false; one global kv67 false; one uniform kv67 false ;;
    refit) export REPAIR=recovery=refit; for b in kv67 kv34; do for arm in attention_drop measured global; do
               "$0" one $arm $b; done; done ;;
    one) one "$2" "$3" false ;;
    collect) python experiments/llm_uneven/collect.py ;;
    all) "$0" a; "$0" b; "$0" collect ;;
esac
