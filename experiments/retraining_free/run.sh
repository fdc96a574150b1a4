#!/usr/bin/env bash
# Retraining-free pruning of the SST-2 fine-tuned MiniLM (issue 14; Kwon et al. 2022), no training:
#   (a) taylor:   Taylor scores, global ranking, masking only (the no-retraining baseline so far)
#   (b) fisher:   Fisher information of the mask + mask rearrangement by the block Fisher
#   (c) fisher_ls: (b) + least-squares tuning of the surviving heads' scales
# at 50/60/70/80% of the heads removed (budget=heads) and at latency budgets of 0.9/0.8/0.7 of the
# dense forward (batch 32; seq 64 and 128), 2,048 calibration sentences from the training file.
# Issue 30's arms (`refit`, heads budgets only; `flops4k`: the 4k-sentence model at 30% of the
# attention FLOPs), collected into results/refit/:
#   (d) fisher_bc         (b) + bias compensation (FLAP: the removed heads' mean output into O's bias)
#   (e) fisher_refit      (b) + the output projection refit on the kept heads (ridge, closed form)
#   (f) refit_rank_refit  removal ranked by the refit's leftover error (per head), no rearrangement, + the refit
#   (g) fisher_refit_kl   (e), then 100 steps of the KL to the unpruned model (every weight, batch 32,
#                         alpha 1, temperature 1, lr 5e-5) in one run (recovery=chain)
# and, on the 4k-sentence model (`finetune4k`: experiment=sst2_finetune on 4,000 sentences, 2 epochs),
# (b), (c), (d), (e), (f), (g) at budget=flops budget.target=0.3 (batch 32, seq 128), and (`heads4k`)
# at the heads budgets as well.
# Run from the repository root on an otherwise idle machine (latency is measured), default threads:
#   FT=<the sst2_finetune export> bash experiments/retraining_free/run.sh [heads|latency|collect]
# (no argument: everything, then the tables); issue 30's, one torch thread:
#   OMP_NUM_THREADS=1 FT=<export> bash experiments/retraining_free/run.sh refit
#   OMP_NUM_THREADS=1 bash experiments/retraining_free/run.sh finetune4k   # -> $FT4K
#   OMP_NUM_THREADS=1 FT4K=<its export> bash experiments/retraining_free/run.sh flops4k
#   OMP_NUM_THREADS=1 FT4K=<its export> bash experiments/retraining_free/run.sh heads4k
# ONLY="<run name> ..." runs just those of a mode's runs (e.g. ONLY="fisher_bc_heads_0.5 fisher_bc_heads_0.6").
set -euo pipefail
OUT=${OUT:-experiments/retraining_free/runs}
FT=${FT:-experiments/metric_curves/runs/finetune/export}
FT4K=${FT4K:-$OUT/finetune4k/export}
CACHE=${CACHE:-$OUT/latency_cache}
# recorded in wall.json; set it when running from an exported copy of a commit (git archive), which has no .git
COMMIT=${COMMIT:-$(git rev-parse --short HEAD)}
# each arm an entry of conf/experiment/retraining_free/arms.yaml (its about says what it sets; the
# fisher_refit_kl arm's 100 KL steps train on the fine-tuned model's training text); a run adds its budget
one() {  # one <run name> <arm> <overrides...>   (model: $MODEL, default $FT)
    local dir=$OUT/$1 arm=$2; shift 2
    python -m headprune.apps.arms retraining_free "$arm" >/dev/null || exit 2  # an arm of conf/experiment/retraining_free/arms.yaml
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $(basename "$dir") "* ]] && return 0
    local start end load0
    start=$(date +%s.%N)
    load0=$(cut -d' ' -f1 /proc/loadavg)
    headprune-train experiment=retraining_free/$arm model.pretrained=${MODEL:-$FT} hydra.run.dir=$dir overwrite=true "$@"
    end=$(date +%s.%N)
    python -c "import json,os; json.dump({'wall_seconds': round($end - $start, 1), 'threads': os.environ.get('OMP_NUM_THREADS'),
        'load_start': $load0, 'load_end': float(open('/proc/loadavg').read().split()[0]),
        'commit': '$COMMIT'}, open('$dir/wall.json', 'w'))"
}
heads() {
    for arm in taylor fisher fisher_ls; do
        for s in 0.5 0.6 0.7 0.8; do
            one "${arm}_heads_${s}" $arm budget=heads schedule.target_sparsity=$s
        done
    done
}
latency() {
    for seq in 64 128; do
        for t in 0.9 0.8 0.7; do
            for arm in taylor fisher fisher_ls; do
                one "${arm}_latency_${t}_seq${seq}" $arm budget=latency budget.target=$t budget.seq=$seq \
                    budget.cache_dir=$CACHE
            done
        done
    done
}
refit() {
    for arm in fisher_refit refit_rank_refit fisher_bc fisher_refit_kl; do
        for s in 0.5 0.6 0.7 0.8; do
            one "${arm}_heads_${s}" $arm budget=heads schedule.target_sparsity=$s
        done
    done
}
finetune4k() {  # MiniLM, 2 epochs on 4,000 SST-2 sentences (iterative_vs_one_shot's baseline), exported
    local dir=$OUT/finetune4k
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    headprune-train experiment=sst2_finetune data.max_train_samples=4000 schedule.baseline_epochs=2 \
        trainer.enable_progress_bar=false hydra.run.dir=$dir overwrite=true
}
flops4k() {
    for arm in fisher fisher_ls fisher_refit refit_rank_refit fisher_bc fisher_refit_kl; do
        local extra=""
        [ $arm = fisher_refit_kl ] && extra="data.max_train_samples=4000"
        MODEL=$FT4K one "${arm}_flops4k_0.3" $arm budget=flops budget.target=0.3 $extra
    done
}
heads4k() {  # no tuning and the refit first, at every share; then the other repairs
    for arm in fisher fisher_refit refit_rank_refit fisher_ls fisher_bc fisher_refit_kl; do
        for s in 0.5 0.6 0.7 0.8; do
            local extra=""
            [ $arm = fisher_refit_kl ] && extra="data.max_train_samples=4000"
            MODEL=$FT4K one "${arm}_heads4k_${s}" $arm budget=heads schedule.target_sparsity=$s $extra
        done
    done
}
collect() { python experiments/retraining_free/collect.py --runs $OUT --out experiments/retraining_free \
              --beside experiments/recovery/results; }
case ${1:-all} in
    heads) heads ;;
    latency) latency ;;
    collect) collect ;;
    refit) refit ;;
    finetune4k) finetune4k ;;
    flops4k) flops4k ;;
    heads4k) heads4k ;;
    all) heads; latency; collect ;;
esac
