#!/usr/bin/env bash
# The llm_kv_modes arms on one CUDA GPU (issue 40; run on a lent H200): `trainer.accelerator: auto` puts each
# run on the GPU, in float32 as on CPU (precision 32-true), with every arm's config unchanged. The arms run side
# by side (the GPU and 16 cores shared; choice and wall seconds are not comparable to the CPU rows), then
# measured_retrieval_kl on measured_retrieval's layout once its raw file is in results_h200/, then decode.py
# --device cuda on the dense model and the exports, alone on the machine (decode_h200.json).
#   OUT=../llmruns/llm_kv_modes_h200 bash experiments/llm_kv_modes/gpu.sh [seconds for the arms]
#   python experiments/llm_kv_modes/collect.py --runs ../llmruns/llm_kv_modes_h200 --device h200
set -uo pipefail
OUT=${OUT:-../llmruns/llm_kv_modes_h200}
LIMIT=${1:-300}  # seconds for every arm together (a later arm gets what is left)
DEADLINE=$((SECONDS + LIMIT))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
HERE=experiments/llm_kv_modes
mkdir -p "$OUT" $HERE/results_h200
arm() {  # arm <name> <dense: true|false>: one run, its log beside the run dirs
    OUT=$OUT timeout $((DEADLINE - SECONDS)) bash $HERE/run.sh one "$1" "$2" > "$OUT/$1.log" 2>&1
    echo "$1: rc $?" | tee -a "$OUT/arms.txt"
}
# measured_retrieval first (it also evaluates the dense model on this GPU), then its layout with KL steps
(arm measured_retrieval true
 cp "$OUT/measured_retrieval/results.json" $HERE/results_h200/measured_retrieval.json && arm measured_retrieval_kl false) &
for a in measured measured_kl measured_self retrieval_uniform_self retrieval_33_kl retrieval_85_kl retrieval_2048_kl; do
    arm "$a" false &
done
wait
exports=()
for a in measured_retrieval measured_retrieval_kl measured_kl retrieval_85_kl retrieval_33_kl; do
    [ -f "$OUT/$a/export/headprune_kv_modes.json" ] && exports+=("$OUT/$a/export")
done
[ ${#exports[@]} -gt 0 ] && timeout 150 python $HERE/decode.py "${exports[@]}" --contexts 4096 8192 --repeats 5 \
    --device cuda --out decode_h200.json > "$OUT/decode.log" 2>&1
echo "decode: rc $?" | tee -a "$OUT/arms.txt"
