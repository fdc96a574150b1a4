#!/usr/bin/env bash
# Michel et al. (2019) on bert-base-uncased, SST-2 and MNLI: fine-tune 3 epochs, then mask 10% of
# the heads per step (Taylor, layer-normalised, global ranking) down to 90%, no retraining.
# NOT RUN on this project's machines: it needs a GPU and a network (hub model and hub data).
set -euo pipefail
OUT=experiments/michel2019_bert/runs
headprune-train -m experiment=michel2019_bert_sst2,michel2019_bert_mnli hydra.sweep.dir=$OUT
headprune-collect $OUT --out experiments/michel2019_bert --label experiment
