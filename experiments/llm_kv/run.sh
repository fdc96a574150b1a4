#!/usr/bin/env bash
# SmolLM2-135M-Instruct pruned to a KV-cache budget without retraining (issue 24), experiment=llm_kv:
# calibration 16 x 512 tokens of Tiny Shakespeare's training part, whole KV groups, the same layout in
# every layer (layer_policy=uniform), then perplexity at seq 128 and 2048 over the same 8,192 held-out
# tokens, SST-2 zero-shot (first 200 validation sentences) and greedy chat answers.
# Arms are entries of conf/experiment/llm_kv/arms.yaml (each says what it runs: metric, rearrangement,
# recovery; the trained ones 50 steps of 2 x 512 training tokens), run at 2 of 3 KV groups kept
# (budget.target=0.67), at 1 of 3 (budget.target=0.34) and at 50% of the query heads kept, placed
# globally (q50: budget=heads layer_policy=global):
#   headprune-train experiment=llm_kv/fisher_re_ls budget.target=0.34
#   headprune-train -m experiment=llm_kv/fisher,llm_kv/fisher_re budget.target=0.67   # several arms
# and `dense`: lora_only, the LoRA steps on the unpruned model (budget.target=1.0 prunes nothing), the
# reference for what training on Tiny Shakespeare alone does to the held-out perplexity.
# The dense model is evaluated once, in the first run (`dense.json`). One torch thread per run; run
# from the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data:
#   bash experiments/llm_kv/run.sh [kv67|kv34|q50|dense|collect]   (no argument: all)
set -euo pipefail
OUT=${OUT:-experiments/llm_kv/runs}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ARMS=$(python -m headprune.apps.arms llm_kv)  # every arm of conf/experiment/llm_kv/arms.yaml
# two streams side by side: ORDER="fisher_re_ls fisher_re fisher taylor" ... & ORDER="..." DENSE=false ...
# 50% of the query heads, wherever the scores put them (KV groups shrink only where all 3 heads go)
Q50="budget=heads layer_policy=global schedule.target_sparsity=0.5"
ORDER=${ORDER:-"fisher_re_ls fisher_re_bias fisher_re fisher taylor magnitude random_s0 random_s1 random_s2"}
one() {  # one <arm> <run name> <overrides...>
    local arm=$1 dir=$OUT/$2; shift 2
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    local start end
    start=$(date +%s.%N)
    headprune-train experiment=llm_kv/$arm hydra.run.dir=$dir overwrite=true "$@"
    end=$(date +%s.%N)
    python -c "import json; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS}, open('$dir/wall.json', 'w'))"
}
budget() {  # budget <tag> <budget overrides...>
    local dense=${DENSE:-true} tag=$1 arm; shift
    for arm in $ORDER; do  # refused before any run: a name without a config
        echo "$ARMS" | grep -qx "$arm" || { echo "ORDER: no arm $arm; conf/experiment/llm_kv/arms.yaml has:" $ARMS >&2; exit 2; }
    done
    for arm in $ORDER; do
        one "$arm" "${arm}_$tag" "$@" evaluation.dense=$dense
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
