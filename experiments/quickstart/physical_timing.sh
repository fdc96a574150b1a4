#!/usr/bin/env bash
# The quickstart with pruned heads masked until the export (pruning.physical=false, what every run
# did before physical shrink) and with them removed after each round (the default), back to back on
# the same machine, default torch threads; then the comparison table. Run from the repository root
# on an otherwise idle machine:  bash experiments/quickstart/physical_timing.sh
set -euo pipefail
OUT=${OUT:-experiments/quickstart/runs}
for arm in masked physical; do
    physical=$([ $arm = physical ] && echo true || echo false)
    start=$(date +%s.%N)
    headprune-train experiment=quickstart pruning.physical=$physical hydra.run.dir=$OUT/$arm \
        trainer.enable_progress_bar=false
    end=$(date +%s.%N)
    python - "$OUT/$arm" "$start" "$end" <<'PY'
import json, os, sys
run_dir, start, end = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
json.dump({"wall_seconds": round(end - start, 1), "load_average_after": os.getloadavg()},
          open(os.path.join(run_dir, "wall.json"), "w"))
PY
done
python experiments/quickstart/physical_timing.py $OUT --out experiments/quickstart
