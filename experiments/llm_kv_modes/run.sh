#!/usr/bin/env bash
# Per-unit KV modes without training (issue 40): experiment=llm_kv_modes (conf/experiment/llm_kv_modes.yaml:
# SmolLM2-135M-Instruct, 2/3 of the KV bytes at a 4096-token context removed, budget=kv target 0.34 seq 4096,
# one calibration block of 4096 Tiny Shakespeare tokens, no repair; perplexity at seq 4096 on held-out Tiny
# Shakespeare and SST-2 sentences, passkey at 4096 tokens, chat answers; dense and export). Arms:
#   attention_mass  modes by the Fisher unit score x attention share within sink 64 + window 448 (training-free),
#                   removal weighed like windows (kv_modes.removal=any; the preset's default is now last)
#   attention_mass_85  the same at 85% of the KV bytes at 4096 removed (budget.target=0.15)
#   attention_mass_last  attention_mass with kv_modes.removal=last: no unit removed while every unit windowed fits
#   attention_mass_85_last  the same at 85% removed (every unit windowed is 1/8 of the bytes: it fits)
#   attention_mass_33_last  the same at 1/3 removed (budget.target=0.67)
#   measured        modes by each unit's measured loss rise windowed / removed (one block of 4096 tokens)
#   removal         kv_modes=none: whole KV groups removed by the budget's own knapsack over Fisher unit scores
#   removal_refit   kv_modes=none layer_policy=attention_drop recovery=refit: experiments/llm_uneven's best
#                   removal-only arm without training (whole attention layers out, then the refit)
# Two streams side by side, one torch thread each (the machine has 2 cores, shared):
#   bash experiments/llm_kv_modes/run.sh a & bash experiments/llm_kv_modes/run.sh b; wait
#   python experiments/llm_kv_modes/collect.py
# One arm: bash experiments/llm_kv_modes/run.sh one <arm> [dense: true|false]
# From the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data. Raw results:
# experiments/llm_kv_modes/results/<arm>.json (copied from the run dirs by collect.py --copy).
set -euo pipefail
OUT=${OUT:-../llmruns/llm_kv_modes}  # run dirs (exports: hundreds of MB) outside the repository
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
declare -A ARM=(
    [attention_mass]="kv_modes=attention_mass kv_modes.removal=any"
    [attention_mass_85]="kv_modes=attention_mass kv_modes.removal=any budget.target=0.15"
    [attention_mass_last]="kv_modes=attention_mass kv_modes.removal=last"
    [attention_mass_85_last]="kv_modes=attention_mass kv_modes.removal=last budget.target=0.15"
    [attention_mass_33_last]="kv_modes=attention_mass kv_modes.removal=last budget.target=0.67"
    [measured]="kv_modes=measured"
    [removal]="kv_modes=none"
    [removal_refit]="kv_modes=none layer_policy=attention_drop recovery=refit"
)
one() {  # one <arm> <evaluate the dense model: true|false>
    local dir=$OUT/$1
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    local start end
    start=$(date +%s.%N)
    headprune-train experiment=llm_kv_modes hydra.run.dir=$dir ${ARM[$1]} evaluation.dense=$2 overwrite=true
    end=$(date +%s.%N)
    python -c "import json, os; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS, 'load_average_end': os.getloadavg()}, open('$dir/wall.json', 'w'))"
}
case ${1:-all} in
    a) one attention_mass true; one removal false ;;
    b) one measured false ;;
    one) one "$2" "${3:-false}" ;;
    all) "$0" a; "$0" b ;;
esac
