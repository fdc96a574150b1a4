#!/usr/bin/env bash
# First the serving sweep (serve_gpu.sh: throughput, capacity and time to first token with static caches; issue 54),
# then the llm_kv_modes arms on one CUDA GPU (issue 40; for a lent GPU; ran on an H200 on 2026-12-04): `trainer.accelerator:
# auto` puts each run on the GPU, in float32 as on CPU (precision 32-true), every arm's config unchanged (results.json
# `runtime` records the device). The arms run side by side (the GPU and the cores shared: choice and wall seconds are
# not comparable to the CPU rows) under one deadline; then decode.py --device cuda on the dense model and the
# exports, alone on the machine (decode_h200.json). Check the machine first: experiments/device_check/smoke.py.
# The arms: FIRST (default: measured_retrieval_8192, with the dense model: at 8192 it has no CPU evaluation), then
# ARMS (default: retrieval_uniform_kl_self); decode on those exports that exist, for DECODE_SECONDS at most (default
# 150). (2026-12-04's lease ran measured_retrieval, measured_self, retrieval_uniform_kl_self, retrieval_2048_kl and
# retrieval_85 at 9b74e30: ARMS and the first arm named those; measured_retrieval_last then ran on the CPU.)
#   OUT=../llmruns/llm_kv_modes_gpu bash experiments/llm_kv_modes/gpu.sh [seconds for every arm together]
#   python experiments/llm_kv_modes/collect.py --runs ../llmruns/llm_kv_modes_gpu
set -uo pipefail
OUT=${OUT:-../llmruns/llm_kv_modes_gpu}
LIMIT=${1:-300}  # seconds for every arm together (a later arm gets what is left)
DEADLINE=$((SECONDS + LIMIT))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
HERE=experiments/llm_kv_modes
mkdir -p "$OUT"
# First the serving sweep (needs no checkpoint: serve_gpu.sh), SERVE_SECONDS of the machine (0: skipped)
[ "${SERVE_SECONDS:-420}" -gt 0 ] && OUT=$OUT bash $HERE/serve_gpu.sh
DEADLINE=$((SECONDS + LIMIT))
arm() {  # arm <name> <dense: true|false>: one run, its log beside the run dirs
    OUT=$OUT timeout $((DEADLINE - SECONDS)) bash $HERE/run.sh one "$1" "$2" > "$OUT/$1.log" 2>&1
    echo "$1: rc $?" | tee -a "$OUT/arms.txt"
}
arm ${FIRST:-measured_retrieval_8192} true &  # it also evaluates the dense model on this GPU
for a in ${ARMS:-retrieval_uniform_kl_self}; do
    arm "$a" false &
done
wait
exports=()
for a in ${FIRST:-measured_retrieval_8192} ${ARMS:-retrieval_uniform_kl_self}; do
    [ -f "$OUT/$a/export/headprune_kv_modes.json" ] && exports+=("$OUT/$a/export")
done
[ ${#exports[@]} -gt 0 ] && timeout ${DECODE_SECONDS:-150} python $HERE/decode.py "${exports[@]}" --contexts 4096 8192 --repeats 5 \
    --device cuda --out decode_h200.json > "$OUT/decode.log" 2>&1
echo "decode: rc $?" | tee -a "$OUT/arms.txt"
