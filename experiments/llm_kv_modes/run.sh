#!/usr/bin/env bash
# Per-unit KV modes without training (issue 40): experiment=llm_kv_modes (conf/experiment/llm_kv_modes.yaml:
# SmolLM2-135M-Instruct, 2/3 of the KV bytes at a 4096-token context removed, budget=kv target 0.34 seq 4096,
# one calibration block of 4096 Tiny Shakespeare tokens, no repair; perplexity at seq 4096 on held-out Tiny
# Shakespeare and SST-2 sentences, passkey at 4096 tokens, chat answers; dense and export). Each arm is an
# entry of conf/experiment/llm_kv_modes/arms.yaml (its about says what it sets; docs/arms/llm_kv_modes.md):
#   attention_mass, attention_mass_85                  Fisher unit score x attention share within the window,
#                                                      removal weighed like windows (removal=any), 2/3 and 85%
#   attention_mass_last, _85_last, _33_last            the same with removal=last, at 2/3, 85% and 1/3
#   retrieval, retrieval_85, retrieval_33              kv_modes=retrieval: a window loses the larger of the
#                                                      attention mass and the retrieval score, at 2/3, 85%, 1/3
#   retrieval_85_w192                                  retrieval_85 with a 64 + 192 window (1/16 of a full unit), more units full
#   retrieval_2048, retrieval_33_2048                  the same at a 2048-token context, 2/3 and 1/3 removed
#   retrieval_uniform                                  retrieval with kv_modes.unit_value=uniform (every unit full
#                                                      worth 1, not its Fisher score), 2/3 removed
#   retrieval_uniform_kl                               retrieval_uniform's choice, then 12 KL steps with the windows on
#   measured                                           each unit's measured loss rise windowed / removed
#   measured_retrieval                                 the same on the calibration block and one synthetic retrieval block
#   measured_retrieval_clamped                         the layout measured_retrieval's rises give with each retrieval
#                                                      rise clamped at 0 (clamped_layout.py; kv_modes=given)
#   measured_retrieval_clamped_last                    the same values with kv_modes.removal=last (no unit removed)
#   measured_retrieval_clamped_85                      the same values at 85% removed, removal any (clamped_layout.py)
#   measured_retrieval_clamped_85_last                 the same values at 85% removed, removal=last
#   measured_retrieval_clamped_kl                      measured_retrieval_clamped's layout, then measured_kl's 12 KL steps
#   measured_retrieval_last                            kv_modes=measured_retrieval measured end to end (its clamped rises,
#                                                      removal=last): what measured_retrieval_clamped_last derived
#   measured_retrieval_8192                            the same preset at an 8192-token context (for a GPU: gpu.sh)
#   measured_kl                                        measured's layout (kv_modes=given, from results/measured.json), then
#                                                      retrieval_uniform_kl's 12 KL steps
#   retrieval_33_kl, retrieval_85_kl, retrieval_2048_kl  retrieval_33's / _85's / _2048's layouts (kv_modes=given), then
#                                                      the same KL steps (24 of 2048 tokens at 2048)
#   retrieval_uniform_kl_self                          retrieval_uniform's layout (kv_modes=given), then the 12 KL steps on
#                                                      blocks the dense model sampled itself (data.calibration=self)
#   retrieval_uniform_self, measured_self              their choice on a self-generated calibration block (data.calibration=self)
#   removal                                            kv_modes=none: the budget's own knapsack removes KV groups
#   layer, layer_85, layer_sink0                       measured_retrieval_last with kv_modes.granularity=layer (whole layers
#                                                      windowed) at 2/3 and 85%, and without sinks (window 512); not run yet
#   removal_refit                                      kv_modes=none, attention_drop + refit (2 calibration blocks)
# One arm (the dense model evaluated too with true):
#   bash experiments/llm_kv_modes/run.sh one <arm> [true|false]
# Streams (one torch thread each; the machine has 2 shared cores):
#   bash experiments/llm_kv_modes/run.sh a & bash experiments/llm_kv_modes/run.sh b; wait
#   python experiments/llm_kv_modes/collect.py --runs ../llmruns/llm_kv_modes
# From the repository root with HEADPRUNE_DATA_DIR pointing at ../shared/data. Raw results:
# experiments/llm_kv_modes/results/<arm>.json (copied from the run dirs by collect.py --runs).
set -euo pipefail
OUT=${OUT:-../llmruns/llm_kv_modes}  # run dirs (exports: hundreds of MB) outside the repository
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
one() {  # one <arm> <evaluate the dense model: true|false>
    local dir=$OUT/$1
    python -m headprune.apps.arms llm_kv_modes "$1" >/dev/null || exit 2  # an arm of conf/experiment/llm_kv_modes/arms.yaml
    [ -f "$dir/results.json" ] && grep -q '"export_dir"' "$dir/results.json" && return 0
    local start end
    start=$(date +%s.%N)
    headprune-train experiment=llm_kv_modes/$1 hydra.run.dir=$dir evaluation.dense=$2 overwrite=true
    end=$(date +%s.%N)
    python -c "import json, os; json.dump({'wall_seconds': round($end - $start, 1), 'threads': $OMP_NUM_THREADS, 'load_average_end': os.getloadavg()}, open('$dir/wall.json', 'w'))"
}
case ${1:-all} in
    a) one attention_mass true; one removal false; one attention_mass_last false; one attention_mass_85_last false
       one attention_mass_33_last false; one attention_mass_85 false ;;
    b) one retrieval false; one retrieval_85 false; one retrieval_33 false; one removal_refit false; one measured false ;;
    c) one retrieval_2048 true; one retrieval_33_2048 false; one retrieval_uniform false ;;
    one) one "$2" "${3:-false}" ;;
    all) "$0" a; "$0" b; "$0" c ;;
esac
