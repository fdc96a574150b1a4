#!/usr/bin/env bash
# The serving sweep (experiments/llm_kv_modes/serve_gpu.py, bench/serve.py) on a lent GPU, first of the GPU work
# (gpu.sh runs it before its arms). One short script for one device call: it needs no checkpoint and no data
# (SmolLM2-135M's shape with random weights, the committed layouts of measured_retrieval_last and
# retrieval_85_w192), only python3 with torch and this project's Python needs. On the offline machines here
# those are wheels in .whl/ (experiments/device_check/README.md says how to build them; carry .whl), installed
# into /tmp/site when `import hydra` fails. Writes $OUT/serve_gpu.json (rows + device, rewritten after each
# context) and $OUT/serve_gpu.log. Fits 15 minutes of device time with room for a rerun: the sweep is cut at
# SERVE_SECONDS (default 420).
#   run(command="OUT=$OUT bash experiments/llm_kv_modes/serve_gpu.sh", carry=[".whl"], timeout_s=540)
#   (locally, on a CUDA machine: OUT=/tmp/serve bash experiments/llm_kv_modes/serve_gpu.sh)
set -uo pipefail
OUT=${OUT:?set OUT to the folder for serve_gpu.json}
mkdir -p "$OUT"
R=$PWD
if ! python3 -c "import hydra, omegaconf, transformers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$R/src:$R HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/serve_gpu.log" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))" \
    >> "$OUT/serve_gpu.log" 2>&1 || exit 3
timeout ${SERVE_SECONDS:-420} python3 experiments/llm_kv_modes/serve_gpu.py --out "$OUT/serve_gpu.json" \
    --device cuda --dtype bfloat16 --graphs ${GRAPHS:-cuda_graph} --contexts ${CONTEXTS:-4096 8192 16384} \
    --memory-gib ${MEMORY_GIB:-60} >> "$OUT/serve_gpu.log" 2>&1
echo "serve_gpu: rc $?" | tee -a "$OUT/serve_gpu.log"
