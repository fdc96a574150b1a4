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

DROP10 = (4, 6, 9, 12, 17, 22, 25, 26, 28, 29)  # the layers the one-layer profile ranks cheapest (issue 29)
UNEVEN = Path(__file__).resolve().parents[3] / "llm_uneven" / "results"


def layouts(config, uneven: Path = UNEVEN) -> dict[str, dict[int, list[int]]]:
    """{layout name: layer -> the KV groups removed there}, the layers and KV groups read from the
    model's config: kv67 / kv34 remove the first third / two thirds of the groups of every layer,
    drop10 every group of the DROP10 layers, <arm>_<budget> what llm_uneven's run kept per layer."""
    layers, groups = config.num_hidden_layers, config.num_key_value_heads
    if max(DROP10) >= layers:
        raise ValueError(f"drop10 names layer {max(DROP10)}; the model has layers 0..{layers - 1}")
    out = {"kv67": {layer: list(range(groups - round(2 * groups / 3))) for layer in range(layers)},
           "kv34": {layer: list(range(groups - round(groups / 3))) for layer in range(layers)},
           "drop10": {layer: list(range(groups)) for layer in DROP10}}
    for arm in ("global", "measured", "attention_drop"):
        for budget in ("kv67", "kv34"):
            kept = json.loads((uneven / f"{arm}_refit_{budget}.json").read_text())["rounds"][0]["budget"]["kept_units_per_layer"]
            if len(kept) != layers:
                raise ValueError(f"{arm}_refit_{budget}.json keeps groups in {len(kept)} layers; the model has {layers}")
            out[f"{arm}_{budget}"] = {layer: list(range(groups - k)) for layer, k in enumerate(kept) if k < groups}
    return out


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    dense, tokenizer = build_model("smollm2", task="causal_lm").eval(), load_tokenizer("smollm2")
    table = layouts(dense.config)
    for name in argv[1:] or list(table):  # optional: only these layouts
        model = prune_heads(copy.deepcopy(dense), heads_of_kv_groups(dense, table[name]))
        saved = save_pruned(model, out / name / "export", tokenizer=tokenizer, origin="smollm2", overwrite=True)
        print(name, saved, "plain transformers checkpoint" if saved.plain_hf else "load_pruned folder")


if __name__ == "__main__":
    main(sys.argv[1:])
