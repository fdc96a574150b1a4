"""kv_modes.granularity=layer layouts of the default chooser (kv_modes=measured_retrieval, removal=last)
derived from the committed rises instead of measured again (about 40 minutes of choice on 2 cores):

    python experiments/llm_kv_modes/layer_layout.py   # writes results/layer_given{,_85,_sink0}_layout.json

results/measured_retrieval_last.json (the arm measured end to end) records the values its knapsack read:
`full_value` (a unit full is worth its clamped removal rise) and `window_value` (removal rise - window rise),
per layer and unit. The rises do not depend on the budget or the granularity: only the knapsack does. So
`mode_choices(..., removal="last", granularity=...)` and `allocate_modes` over SmolLM2-135M's KV mode table
give the layout at any target and granularity; the arms layer_given, layer_given_85 and layer_given_sink0
evaluate the layer-granular ones (kv_modes=given). As a check the script first derives the unit-granular
layout at the run's own target and refuses to write anything unless it equals the run's recorded layout, and
says whether at 85% removed it gives measured_retrieval_clamped_85_last's (the unit arm layer_given_85 is read
against; it does).
layer_given_sink0 is layer_given's choice evaluated with a window of the last 512 tokens and no sink (the same
bytes as 64 + 448): its rises were measured with the sink, so it is that layout without sinks, not the
choice a sink-free measurement would make.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from headprune.heads.surgery import kv_group_heads
from headprune.models.gguf import converted, gguf_source
from headprune.selection.budgets import KVBudget, allocate_modes
from headprune.selection.kv_modes import mode_choices

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "results" / "measured_retrieval_last.json"
# arm: (budget.target or None for the run's own, granularity, sink, window or None for the run's own)
OUT = {"layer_given": (None, "layer", None, None), "layer_given_85": (0.15, "layer", None, None),
       "layer_given_sink0": (None, "layer", 0, 512)}


def derive(model_folder: str | Path, target: float | None, granularity: str, sink: int | None = None,
           window: int | None = None) -> dict:
    """The layout measured_retrieval_last's values give at `target` (None: the run's) and `granularity`,
    written with `sink` + `window` (None: the run's), and what it came from."""
    data = json.loads(SOURCE.read_text())
    budget = data["rounds"][0]["budget"]
    report = budget["kv_modes"]
    target = data["budget"]["target"] if target is None else target
    seq, removal = data["budget"]["seq"], report["removal"]
    config = transformers.AutoConfig.from_pretrained(model_folder)
    with torch.device("meta"):  # the shapes only: the KV mode table needs no weights
        model = transformers.AutoModelForCausalLM.from_config(config)
    costs = KVBudget(target=target, seq=seq).mode_table(model, report["sink"], report["window"])
    units = kv_group_heads(model)
    caps = [config.num_attention_heads] * config.num_hidden_layers  # layer_policy=global, min_heads_per_layer 0
    choices, fits = mode_choices(costs, units, caps, target, removal, granularity)
    layout, chosen = allocate_modes(report["full_value"], report["window_value"], costs, target,
                                    report["sink"] if sink is None else sink,
                                    report["window"] if window is None else window, choices=choices)
    flat = [m for layer in layout.modes for m in layer]
    return {"final": {"kv_layout": layout.to_json()}, "removal": removal, "target": target, "granularity": granularity,
            "choice_sink_window": [report["sink"], report["window"]], "derived_from": ["results/measured_retrieval_last.json"],
            "all_windowed_fits": fits, "modes_count": {m: flat.count(m) for m in ("full", "window", "removed")},
            "predicted_share": chosen["predicted_share"], "retained_value": chosen["retained_value"]}


def main() -> None:
    folder = converted(gguf_source("smollm2"))
    recorded = json.loads(SOURCE.read_text())["final"]["kv_layout"]
    check = derive(folder, None, "unit")["final"]["kv_layout"]
    if check != recorded:
        raise SystemExit(f"{SOURCE}: its values do not give back its own layout at unit granularity; nothing written")
    print("unit granularity at the run's target gives back", SOURCE.name, "'s layout")
    at_85 = json.loads((HERE / "results" / "measured_retrieval_clamped_85_last_layout.json").read_text())
    same = derive(folder, 0.15, "unit")["final"]["kv_layout"] == at_85["final"]["kv_layout"]
    print("unit granularity at 0.15 gives measured_retrieval_clamped_85_last's layout (the 85% unit arm):", same)
    for arm, args in OUT.items():
        out = derive(folder, *args)
        path = HERE / "results" / f"{arm}_layout.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(path, out["modes_count"], f"share {out['predicted_share']:.4f}", f"retained {out['retained_value']:.4f}")


if __name__ == "__main__":
    main()
