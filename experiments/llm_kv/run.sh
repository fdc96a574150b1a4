#!/usr/bin/env bash
# SmolLM2-135M-Instruct pruned to a KV-cache budget without retraining (issue 24), experiment=llm_kv:
# calibration 16 x 512 tokens of Tiny Shakespeare's training part, whole KV groups, the same layout in
# every layer (layer_policy=uniform), then perplexity at seq 128 and 2048 over the same 8,192 held-out
# tokens, SST-2 zero-shot (first 200 validation sentences) and greedy chat answers.
# Arms, at 2 of 3 KV groups kept (budget.target=0.67), at 1 of 3 (budget.target=0.34) and at 50% of
# the query heads kept, placed globally (q50: budget=heads layer_policy=global):
#   random_s{0,1,2}  random scores (3 seeds), no tuning
#   magnitude        weight magnitude, no tuning
#   taylor           Taylor (first-order) importance, no tuning
#   fisher           Fisher information of the head mask, no tuning
#   fisher_re        + mask rearrangement by the block Fisher
#   fisher_re_ls     + least-squares scales and bias (Kwon et al.), streamed layer by layer
#   fisher_re_bias   + bias compensation (FLAP) instead
#   fisher_re_refit  + the output projection refit on the kept heads (issue 30; target: residual)
#   fisher_re_refit_att  the same, refit to the dense attention output (target: attention)
#   refit_rank_refit  removal ranked by the refit's leftover error (whole KV groups), then the refit
#   refit_rank_head_refit  the same ranking per query head (q50)
#   fisher_lora      Fisher + LoRA, no rearrangement (q50, where rearrangement hurt)
#   fisher_re_lora   + LoRA (rank 8, every projection) for $STEPS steps of 2 x 512 training tokens, merged
#   fisher_re_lora_kd  the same, trained on the KL to the unpruned model's next-token distribution
#   fisher_re_distill  the same KL, every weight trained (no adapters)
#   fisher_re_refit_kl  the refit of O, then that KL, in one run (recovery=chain)
# and `dense`: lora_only, the LoRA steps on the unpruned model (budget.target=1.0 prunes nothing), the
# reference for what training on Tiny Shakespeare alone does to the held-out perplexity.
# The dense model is evaluated once, in the first run (`dense.json`). One torch thread per run; run
# from the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data:
#   bash experiments/llm_kv/run.sh [kv67|kv34|q50|dense|collect]   (no argument: all)
set -euo pipefail
OUT=${OUT:-experiments/llm_kv/runs}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
declare -A ARM=(
    [random_s0]="metric=random metric.seed=0 pruning.rearrange=false recovery=none"
    [random_s1]="metric=random metric.seed=1 pruning.rearrange=false recovery=none"
    [random_s2]="metric=random metric.seed=2 pruning.rearrange=false recovery=none"
    [magnitude]="metric=magnitude pruning.rearrange=false recovery=none"
    [taylor]="metric=taylor pruning.rearrange=false recovery=none"
    [fisher]="metric=fisher pruning.rearrange=false recovery=none"
    [fisher_re]="metric=fisher pruning.rearrange=true recovery=none"
    [fisher_re_ls]="metric=fisher pruning.rearrange=true recovery=least_squares"
    [fisher_re_bias]="metric=fisher pruning.rearrange=true recovery=bias_compensation"
    [fisher_re_refit]="metric=fisher pruning.rearrange=true recovery=refit recovery.target=residual"
    [fisher_re_refit_att]="metric=fisher pruning.rearrange=true recovery=refit recovery.target=attention"
    [refit_rank_refit]="metric=refit_error metric.unit=kv_group pruning.rearrange=false recovery=refit"
    [refit_rank_head_refit]="metric=refit_error metric.unit=head pruning.rearrange=false recovery=refit"
)
STEPS=${STEPS:-50}
TRAIN="data.max_train_samples=null data.batch_size=2 recovery.steps=$STEPS"
ARM[lora_only]="metric=magnitude pruning.rearrange=false recovery=lora $TRAIN"  # for `dense`: nothing pruned
ARM[fisher_lora]="metric=fisher pruning.rearrange=false recovery=lora $TRAIN"
ARM[fisher_re_lora]="metric=fisher pruning.rearrange=true recovery=lora $TRAIN"
ARM[fisher_re_lora_kd]="metric=fisher pruning.rearrange=true recovery=lora recovery.alpha=1.0 $TRAIN"
ARM[fisher_re_distill]="metric=fisher pruning.rearrange=true recovery=distill recovery.alpha=1.0 recovery.temperature=1.0 $TRAIN"
# the refit, then the same KL with every weight (recovery=chain: stages [refit, distill]); the distill
# stage takes its steps from recovery.options.distill, so the same $STEPS steps of 2 x 512 tokens
ARM[fisher_re_refit_kl]="metric=fisher pruning.rearrange=true recovery=chain recovery.options.distill.steps=$STEPS recovery.options.distill.alpha=1.0 recovery.options.distill.temperature=1.0 data.max_train_samples=null data.batch_size=2"
# two streams side by side: ORDER="fisher_re_ls fisher_re fisher taylor" ... & ORDER="..." DENSE=false ...
# 50% of the query heads, wherever the scores put them (KV groups shrink only where all 3 heads go)
Q50="budget=heads layer_policy=global schedule.target_sparsity=0.5"
ORDER=${ORDER:-"fisher_re_ls fisher_re_bias fisher_re fisher taylor magnitude random_s0 random_s1 random_s2"}
one() {  # one <run name> <overrides...>
    local dir=$OUT/$1; shift
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    local start end
    start=$(date +%s.%N)
    headprune-train experiment=llm_kv hydra.run.dir=$dir overwrite=true "$@"
    end=$(date +%s.%N)
    python -c "import json; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS}, open('$dir/wall.json', 'w'))"
}
budget() {  # budget <tag> <budget overrides...>
    local dense=${DENSE:-true} tag=$1; shift
    for arm in $ORDER; do
        one "${arm}_$tag" ${ARM[$arm]} "$@" evaluation.dense=$dense
        dense=false
    done
}
collect() { python experiments/llm_kv/collect.py --runs $OUT --out experiments/llm_kv; }
case ${1:-all} in
    kv67) budget kv67 budget.target=0.67 ;;
    kv34) budget kv34 budget.target=0.34 ;;
    q50) budget q50 $Q50 ;;
    dense) ORDER=lora_only budget dense budget.target=1.0 ;;  # the same LoRA steps on the unpruned model
    collect) collect ;;
    all) budget kv67 budget.target=0.67; budget kv34 budget.target=0.34; budget q50 $Q50; collect ;;
esac
