"""The layout kv_modes=measured with one retrieval block chooses since a6f4654 (retrieval rises clamped at 0,
`selection.kv_modes.with_retrieval`), computed from committed raw files instead of measured again (that
measurement takes minutes on a GPU, hours on 2 cores):

    python experiments/llm_kv_modes/clamped_layout.py   # writes results/measured_retrieval_clamped{,_last,_85,_85_last}_layout.json

results/measured_retrieval.json (H200, code before a6f4654) holds the rises on the calibration block and the
retrieval block together, as one token-weighted mean; results/measured.json (CPU) holds them on the same
calibration block alone (the same data config: the first 4096-token block of Tiny Shakespeare's training part).
So the retrieval block's own rises are ((Nc + Nr) x together - Nc x calibration) / Nr, with Nc = 4095 scored
targets of the calibration block and Nr = 4096 - period (1024) = 3072 of the retrieval block (its first copy
unscored). From them `with_retrieval` and the knapsack (`allocate_modes` over SmolLM2-135M's KV mode table at
budget.seq 4096, target 0.34; every option a layer has, as layer_policy=global with min_heads_per_layer 0 allows)
give the layout; the arm measured_retrieval_clamped evaluates it (kv_modes=given). With kv_modes.removal=last (no
unit removed while every unit windowed fits) the same values give measured_retrieval_clamped_last's layout, and
at budget.target 0.15 (85% of the bytes removed) measured_retrieval_clamped_85's (removal any) and
measured_retrieval_clamped_85_last's.
GPU and CPU rises agree to about 1e-5 (README.md, retrieval_85 run on both), far below the differences that
decide the knapsack here.
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
from headprune.selection.measured_values import with_retrieval

HERE = Path(__file__).resolve().parent
# arm: (kv_modes.removal, budget.target or None for the measured runs' own 0.34), its layout file
OUT = {"measured_retrieval_clamped": ("any", None), "measured_retrieval_clamped_last": ("last", None),
       "measured_retrieval_clamped_85": ("any", 0.15), "measured_retrieval_clamped_85_last": ("last", 0.15)}


def layout_path(arm: str) -> Path:
    return HERE / "results" / f"{arm}_layout.json"


def rises(path: Path) -> dict:
    data = json.loads(path.read_text())
    report = data["rounds"][0]["budget"]["kv_modes"]
    return {"report": report, "target": data["budget"]["target"], "seq": data["budget"]["seq"]}


def derive(model_folder: str | Path, removal: str = "any", target: float | None = None) -> dict:
    """The layout under `kv_modes.removal=removal` at `budget.target=target` (None: the measured runs' own)
    and what it came from (what main writes), SmolLM2's shapes read from `model_folder` (a converted
    checkpoint's config). The rises do not depend on the target: only the knapsack does."""
    together, alone = rises(HERE / "results" / "measured_retrieval.json"), rises(HERE / "results" / "measured.json")
    rt, ra = together["report"], alone["report"]
    if (rt["sink"], rt["window"], rt["seq"], together["target"]) != (ra["sink"], ra["window"], ra["seq"], alone["target"]):
        raise ValueError("measured_retrieval.json and measured.json were not measured alike (sink, window, seq, target)")
    seq, period = rt["seq"], rt["retrieval_period"]
    target = together["target"] if target is None else target
    nc, nr = float(seq - 1), float(seq - period)

    def retrieval_part(both: list[list[float]], calibration: list[list[float]]) -> list[list[float]]:
        return [[((nc + nr) * b - nc * c) / nr for b, c in zip(bs, cs)] for bs, cs in zip(both, calibration)]

    removed = retrieval_part(rt["removed_rise"], ra["removed_rise"])
    window = retrieval_part(rt["window_rise"], ra["window_rise"])
    mixed_removed = with_retrieval(ra["removed_rise"], removed, nc, nr)
    mixed_window = with_retrieval(ra["window_rise"], window, nc, nr)
    windowed = [[r - w for r, w in zip(rs, ws)] for rs, ws in zip(mixed_removed, mixed_window)]
    config = transformers.AutoConfig.from_pretrained(model_folder)
    with torch.device("meta"):  # the shapes only: the KV mode table needs no weights
        model = transformers.AutoModelForCausalLM.from_config(config)
    costs = KVBudget(target=target, seq=seq).mode_table(model, rt["sink"], rt["window"])
    units = kv_group_heads(model)  # a KV group's query heads
    caps = [config.num_attention_heads] * config.num_hidden_layers  # a layer may lose every unit
    choices, _ = mode_choices(costs, units, caps, target, removal)
    layout, report = allocate_modes(mixed_removed, windowed, costs, target, rt["sink"], rt["window"],
                                    choices=choices)
    flat = [m for layer in layout.modes for m in layer]
    out = {"final": {"kv_layout": layout.to_json()}, "removal": removal, "target": target,
           "derived_from": ["results/measured_retrieval.json", "results/measured.json"],
           "scored_targets": {"calibration": nc, "retrieval": nr},
           "retrieval": {"base_loss": ((nc + nr) * rt["base_loss"] - nc * ra["base_loss"]) / nr,
                         "removed_rise": removed, "window_rise": window,
                         "negative_removal_rises": sum(v < 0 for layer in removed for v in layer)},
           "modes_count": {m: flat.count(m) for m in ("full", "window", "removed")},
           "predicted_share": report["predicted_share"], "retained_value": report["retained_value"]}
    return out


def main() -> None:
    folder = converted(gguf_source("smollm2"))
    for arm, (removal, target) in OUT.items():
        out = derive(folder, removal, target)
        path = layout_path(arm)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(path, out["modes_count"], f"share {out['predicted_share']:.4f}",
              f"retrieval base loss {out['retrieval']['base_loss']:.4f}",
              f"negative retrieval removal rises {out['retrieval']['negative_removal_rises']}")


if __name__ == "__main__":
    main()
