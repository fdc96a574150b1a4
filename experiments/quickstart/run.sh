#!/usr/bin/env bash
# The README quickstart: MiniLM, 4,000 SST-2 sentences, 2 baseline epochs, then iterative Taylor
# pruning (global ranking) by 10% of the heads per round with one epoch of fine-tuning, to 50%.
# Run from the repository root; offline, HEADPRUNE_DATA_DIR must hold sst2/.
set -euo pipefail
OUT=${1:-experiments/quickstart/run}
/usr/bin/time -v headprune-train experiment=quickstart hydra.run.dir="$OUT" trainer.enable_progress_bar=false overwrite=true
cp "$OUT/results.json" experiments/quickstart/results.json
cp "$OUT/head_mask.png" experiments/quickstart/head_mask.png
python experiments/quickstart/table.py experiments/quickstart/results.json > experiments/quickstart/rounds.md
