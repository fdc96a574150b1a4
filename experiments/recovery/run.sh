#!/usr/bin/env bash
# Recovery after pruning (issue 18): does one-shot collapse with a short budget after the prune, and
# how much does distillation from the unpruned model recover at high sparsity?
# MiniLM on 4,000 SST-2 sentences exactly as in iterative_vs_one_shot (experiment=iterative_vs_one_shot:
# 2 baseline epochs, Taylor scores, global ranking, 10% of the heads per iterative round, 1 epoch each),
# heads kept masked until the export (pruning.physical=false: the code path of the committed
# iterative_vs_one_shot runs, which arms (b) and (c) reuse at seed 0). Arms:
#   (a) one_shot_short   one-shot, then 1 epoch
#   (b) one_shot_long    one-shot, then as many epochs as the iterative arm has rounds   (seed 0: reused)
#   (c) iterative        10% per round, 1 epoch each                                      (seed 0: reused)
#   (d) distill          (c) + recovery=distill (teacher: the model after the 2 baseline epochs)
#   (d') distill_hidden  (d) + per-layer hidden-state MSE (recovery.hidden_weight=1.0), 90%, seeds 0 and 1
#   (e) dense            no pruning, trained as many epochs as (b)/(c)/(d) (2 + rounds)
# Run from the repository root, two lanes side by side on a 2-core machine, one torch thread each:
#   bash experiments/recovery/run.sh lane1 &  bash experiments/recovery/run.sh lane2 &  wait
#   bash experiments/recovery/run.sh collect
# (or one arm: bash experiments/recovery/run.sh arm dense 0.9 1)
set -euo pipefail
OUT=${OUT:-experiments/recovery/runs}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

arm() {  # arm <name> <target> <seed>
    local name=$1 t=$2 seed=$3 rounds dir
    rounds=$(python -c "print(round($2 / 0.1))")
    dir=$OUT/${name}_${t}_s${seed}
    [ -f "$dir/results.json" ] && grep -q '"stop_reason"' "$dir/results.json" && return 0
    python -m headprune.apps.arms recovery "$name" >/dev/null || exit 2  # an arm of conf/experiment/recovery/arms.yaml
    # each arm an entry of conf/experiment/recovery/arms.yaml; the run adds its seed, its target and, for
    # one_shot_long / dense, the epochs the iterative arm's rounds take
    local args=(experiment=recovery/$name seed=$seed hydra.run.dir=$dir trainer.enable_progress_bar=false overwrite=true)
    case $name in
        one_shot_long) args+=(schedule.target_sparsity=$t schedule.epochs_per_round=$rounds) ;;
        dense)         args+=(schedule.baseline_epochs=$((2 + rounds))) ;;
        *)             args+=(schedule.target_sparsity=$t) ;;
    esac
    local start end
    start=$(date +%s)
    headprune-train "${args[@]}"
    end=$(date +%s)
    echo "{\"wall_seconds\": $((end - start))}" > "$dir/wall.json"
}

case ${1:-all} in
    lane1) arm distill 0.9 0; arm distill 0.7 0; arm distill 0.9 1; arm distill 0.9 2 ;;
    lane2) arm one_shot_short 0.7 0; arm one_shot_short 0.9 0; arm dense 0.9 0; arm dense 0.7 0
           arm iterative 0.9 1; arm iterative 0.9 2; arm dense 0.9 1; arm dense 0.9 2 ;;
    lane3) arm distill_hidden 0.9 0 ;;
    lane4) arm distill_hidden 0.9 1 ;;
    arm) shift; arm "$@" ;;  # one arm: arm <name> <target> <seed>
    collect) python experiments/recovery/collect.py --runs $OUT --reuse experiments/iterative_vs_one_shot/results \
                 --out experiments/recovery ;;
    all) "$0" lane1; "$0" lane2; "$0" lane3; "$0" lane4; "$0" collect ;;
esac
