#!/usr/bin/env bash
# Scoring cost of every metric relative to one forward+backward pass (prints a markdown table).
set -euo pipefail
cd "$(dirname "$0")/../.."
HF_HUB_OFFLINE=1 HEADPRUNE_DATA_DIR="${HEADPRUNE_DATA_DIR:-../shared/data}" \
    python experiments/metric_cost/bench_metric_cost.py --samples 256 --repeats 3 "$@"
