#!/usr/bin/env bash
# llama.cpp decode of SmolLM2-135M-Instruct against its exports (exports.py: kv67, kv34 uniform;
# drop10 and the six layouts of experiments/llm_uneven's allocations, uneven, deci GGUFs; LAYOUTS
# names a subset), F16 GGUF weights, contexts 512/2048/4096, THREADS llama.cpp threads (default 1), 16 decode
# steps per round, 1 warm-up + 3 timed rounds: the bench's llamacpp section (docs/bench.md).
# The GGUF files (~270 MB each) go to the scratch run dir; bench.json/md/png are copied here.
# Usage (repository root, venv with the llamacpp extra): experiments/llm_kv/decode/llamacpp/run.sh [EXPORTS] [SCRATCH]
set -euo pipefail
here=experiments/llm_kv/decode/llamacpp
exports=${1:-/tmp/llamacpp_exports}
scratch=${2:-/tmp/llamacpp_bench}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
layouts=${LAYOUTS:-kv67 kv34 drop10 global_kv67 measured_kv67 attention_drop_kv67 global_kv34 measured_kv34 attention_drop_kv34}
missing=() dirs=()
for name in $layouts; do
  [ -f "$exports/$name/export/config.json" ] || missing+=("$name")
  dirs+=("$exports/$name/export")
done
[ ${#missing[@]} -eq 0 ] || python "$here/exports.py" "$exports" "${missing[@]}"
headprune-bench bench.device=cpu \
  bench.encoder.enabled=false bench.train_step.enabled=false bench.onnxruntime.enabled=false \
  bench.decoder.enabled=false bench.llm.enabled=false bench.llamacpp.enabled=true \
  "bench.llamacpp.pruned_dirs=[$(IFS=,; echo "${dirs[*]}")]" \
  bench.llamacpp.weights=f16 "bench.llamacpp.contexts=[512,2048,4096]" "bench.llamacpp.threads=[${THREADS:-1}]" \
  bench.llamacpp.new_tokens=16 bench.warmup=1 bench.repeats=3 \
  hydra.run.dir="$scratch" hydra.output_subdir=null "${@:3}"
cp "$scratch"/bench.json "$scratch"/bench.md "$scratch"/bench.png "$here"/
ls -l "$scratch"/llamacpp/*.gguf > "$here"/gguf_files.txt
