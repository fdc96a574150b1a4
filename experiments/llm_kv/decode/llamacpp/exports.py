"""The SmolLM2-135M-Instruct exports the llama.cpp decode bench times (run.sh): structural layouts,
no scoring and no recovery, because decode speed and KV bytes depend on the shapes only (which KV
group a layer drops changes neither). Written with save_pruned, each recording `"dense_model":
"smollm2"`, the origin the bench compares with.

  kv67    KV group 0 removed from every layer (2 of 3 kept): uniform, a `llama` GGUF
  kv34    KV groups 0 and 1 removed from every layer (1 of 3 kept): uniform, `llama`
  drop10  all attention removed from the 10 layers the one-layer profile ranks cheapest (issue 29:
          4, 6, 9, 12, 17, 22, 25, 26, 28, 29), the others dense: 1/3 of the KV cache, uneven, `deci`
  <arm>_<budget>  the KV groups per layer that experiments/llm_uneven's allocations kept (arm global,
          measured, attention_drop; budget kv67, kv34), read from its `<arm>_refit_<budget>.json`
          (`rounds[0].budget.kept_units_per_layer`): uneven, `deci`

Usage: python experiments/llm_kv/decode/llamacpp/exports.py OUT_DIR [NAME ...]   (default: every layout)
"""
import copy
import json
import sys
from pathlib import Path

from headprune import heads_of_kv_groups, prune_heads, save_pruned
from headprune.models.build import build_model, load_tokenizer

LAYOUTS = {
    "kv67": {layer: [0] for layer in range(30)},
    "kv34": {layer: [0, 1] for layer in range(30)},
    "drop10": {layer: [0, 1, 2] for layer in (4, 6, 9, 12, 17, 22, 25, 26, 28, 29)},
}
UNEVEN = Path(__file__).resolve().parents[3] / "llm_uneven" / "results"

out = Path(sys.argv[1])
dense, tokenizer = build_model("smollm2", task="causal_lm").eval(), load_tokenizer("smollm2")
groups_per_layer = dense.config.num_key_value_heads
for arm in ("global", "measured", "attention_drop"):
    for budget in ("kv67", "kv34"):
        kept = json.loads((UNEVEN / f"{arm}_refit_{budget}.json").read_text())["rounds"][0]["budget"]["kept_units_per_layer"]
        LAYOUTS[f"{arm}_{budget}"] = {layer: list(range(groups_per_layer - k))
                                      for layer, k in enumerate(kept) if k < groups_per_layer}
names = sys.argv[2:] or list(LAYOUTS)  # optional: only these layouts
for name in names:
    groups = LAYOUTS[name]
    model = prune_heads(copy.deepcopy(dense), heads_of_kv_groups(dense, groups))
    saved = save_pruned(model, out / name / "export", tokenizer=tokenizer, origin="smollm2", overwrite=True)
    print(name, saved, "plain transformers checkpoint" if saved.plain_hf else "load_pruned folder")
