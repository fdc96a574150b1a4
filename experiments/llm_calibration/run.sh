#!/usr/bin/env bash
# Calibration that generalizes (issue 40, section 2): SmolLM2-135M-Instruct at 1/3 of the KV cache removed
# (budget.target=0.67), experiment=llm_kv's protocol without training, two allocations x two repairs x three
# calibration sources, judged in domain (held-out Tiny Shakespeare) and out of domain (SST-2's validation
# sentences), perplexity at seq 128 and 2048 over the same 8,192 tokens of each (zero-shot and chat answers off).
# Arms are a grid, conf/experiment/llm_calibration/arms.yaml, <allocation>_<repair>_<calibration> (each level says what
# it runs), each run into the run dir of its name:
#   allocations  uniform         layer_policy=uniform, Fisher + rearrangement (experiment=llm_kv's default)
#                attention_drop  layer_policy=attention_drop (He et al. 2024)
#   repairs      refit           recovery=refit (the output projection re-solved on the kept heads)
#                ls              recovery=least_squares (per-head scales and a bias)
#   calibration  corpus          16 x 512 tokens of Tiny Shakespeare's training part (the default)
#                self            16 x 512 tokens sampled from the dense model itself (data.calibration=self:
#                                BOS, then temperature 1.0, top-p 0.95, seed 0; cached in the run dir)
#                mix             8 blocks of each (data.calibration=mix)
#   headprune-train experiment=llm_calibration/uniform_refit_self      # one arm (run.sh adds its run dir)
# One run:  bash experiments/llm_calibration/run.sh one <arm> [evaluate dense: true|false]
# All:      bash experiments/llm_calibration/run.sh all        then   bash experiments/llm_calibration/run.sh collect
# From the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data; run dirs (exports) under $OUT,
# outside the repository; collect.py copies each results.json (+ wall.json) into experiments/llm_calibration/results.
set -euo pipefail
OUT=${OUT:-../llmruns/llm_calibration}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ARMS=$(python -m headprune.apps.arms llm_calibration)  # every arm of conf/experiment/llm_calibration/arms.yaml
one() {  # one <arm> <evaluate the dense model: true|false>
    local arm=$1 dir=$OUT/$1 start end
    echo "$ARMS" | grep -qx "$arm" || { echo "run.sh: no arm $arm; conf/experiment/llm_calibration/arms.yaml has:" $ARMS >&2; exit 2; }
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    start=$(date +%s.%N)
    headprune-train experiment=llm_calibration/$arm hydra.run.dir=$dir overwrite=true evaluation.dense=$2
    end=$(date +%s.%N)
    python -c "import json, os; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS, 'load_average_end': os.getloadavg()}, open('$dir/wall.json', 'w'))"
}
case ${1:-all} in
    one) one "$2" "${3:-false}" ;;
    all) dense=true
         for cal in corpus self mix; do for alloc in uniform attention_drop; do for repair in refit ls; do
             one "${alloc}_${repair}_$cal" $dense; dense=false; done; done; done ;;
    collect) python experiments/llm_calibration/collect.py ;;
    *) echo "run.sh: $1: one <arm> [true|false], all or collect" >&2; exit 2 ;;
esac
