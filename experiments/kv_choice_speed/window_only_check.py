"""Whether kv_modes=measured_retrieval's window-only values (`selection.kv_modes`: with removal=last while
every unit windowed fits, full = window rise, windowed = 0, no removal rise measured) choose on SmolLM2 the
layout the committed three-way values chose, at each budget the experiment runs and at each granularity:

    python experiments/kv_choice_speed/window_only_check.py --out experiments/kv_choice_speed/window_only_check.json

The values are experiments/llm_kv_modes/results/measured_retrieval_last.json's (its mixed, clamped
`removed_rise` and `window_rise`, and the `full_value` / `window_value` its knapsack read); only the
knapsack runs here (no model weights): the probes themselves are unchanged (the window probes are the
same code path), so equal layouts from equal window rises is what the skip has to show.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers

from headprune.heads.surgery import kv_group_heads
from headprune.models.gguf import converted, gguf_source
from headprune.selection.budgets import KVBudget, allocate_modes
from headprune.selection.kv_modes import mode_choices, removal_unused

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "experiments/llm_kv_modes/results/measured_retrieval_last.json"
TARGETS = (0.34, 0.15, 0.67)  # 2/3, 85% and 1/3 of the KV bytes at 4096 removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = json.loads(SOURCE.read_text())["rounds"][0]["budget"]["kv_modes"]
    config = transformers.AutoConfig.from_pretrained(converted(gguf_source("smollm2")))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    units = kv_group_heads(model)
    caps = [config.num_attention_heads] * config.num_hidden_layers
    removed, window = report["removed_rise"], report["window_rise"]
    three_way = ([list(r) for r in removed], [[a - b for a, b in zip(rs, ws)] for rs, ws in zip(removed, window)])
    assert three_way[0] == report["full_value"] and all(
        abs(a - b) < 1e-12 for xs, ys in zip(three_way[1], report["window_value"]) for a, b in zip(xs, ys))
    window_only = (window, [[0.0] * len(ws) for ws in window])
    rows = []
    for target in TARGETS:
        costs = KVBudget(target=target, seq=report["seq"]).mode_table(model, report["sink"], report["window"])
        for granularity in ("unit", "layer"):
            choices, fits = mode_choices(costs, units, caps, target, "last", granularity)
            layouts = [allocate_modes(*values, costs, target, report["sink"], report["window"], choices=choices)[0]
                       for values in (three_way, window_only)]
            flat = [m for layer in layouts[0].modes for m in layer]
            rows.append({"target": target, "granularity": granularity, "all_windowed_fits": fits,
                         "removal_unused": removal_unused(choices, len(units)), "equal": layouts[0] == layouts[1],
                         "full_units": flat.count("full"), "windowed_units": flat.count("window")})
            print(rows[-1])
    recorded = json.loads(SOURCE.read_text())["final"]["kv_layout"]["modes"]
    costs = KVBudget(target=0.34, seq=report["seq"]).mode_table(model, report["sink"], report["window"])
    choices, _ = mode_choices(costs, units, caps, 0.34, "last", "unit")
    ours = allocate_modes(*window_only, costs, 0.34, report["sink"], report["window"], choices=choices)[0]
    out = {"source": str(SOURCE.relative_to(REPO)), "layouts": rows,
           "window_only_equals_recorded_layout": [list(m) for m in ours.modes] == recorded}
    print("window-only values give the recorded layout:", out["window_only_equals_recorded_layout"])
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
