"""The "Layer granularity" table of README.md (issue 54 item 3), from the raw files results/<arm>.json:
each layer-granular arm beside the unit-granular arm of the same chooser and budget.

    python experiments/llm_kv_modes/layer_table.py   # prints the markdown table

Perplexity at seq 4096 on held-out Tiny Shakespeare (TS) and SST-2 sentences, passkey at 4096 (10 prompts),
RULER's plain mean over its 11 tasks at 4096 (1 sample a task: a coarse signal), all against results/dense.json
(its dense evaluation: no RULER). "gap": layer's TS perplexity minus unit's, in perplexity and in points of
the change over dense. Arms missing from results/ are listed as not run.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (chooser, KV kept, unit arm, [layer arms])
PAIRS = [("retrieval", 0.34, "retrieval_uniform", ["retrieval_layer", "retrieval_layer_sink0"]),
         ("retrieval", 0.15, "retrieval_85", ["layer_given_85"]),
         ("measured_retrieval", 0.34, "measured_retrieval_last", ["layer_given", "layer_given_sink0"]),
         ("measured_retrieval", 0.15, "measured_retrieval_clamped_85_last", ["layer_given_85"])]


def ppl(block: dict, corpus: str) -> float:
    return (block["perplexity"] if corpus == "ts" else block["perplexity_other"]["sst2"])["seq4096"]["ppl"]


def row(arm: str, data: dict, dense: dict, unit_ts: float | None) -> str:
    pruned = data["evaluation"]["pruned"]
    layout = data["final"]["kv_layout"]
    flat = [m for layer in layout["modes"] for m in layer]
    ts, sst = ppl(pruned, "ts"), ppl(pruned, "sst")
    ts0, sst0 = ppl(dense, "ts"), ppl(dense, "sst")
    ruler = pruned.get("ruler")
    ruler_mean = (sum(t["4096"]["score"] for t in ruler["tasks"].values()) / len(ruler["tasks"])) if ruler else None
    granularity = data["config"]["kv_modes"].get("granularity", "unit")
    gap = (f"{ts - unit_ts:+.2f} ({100 * (ts - unit_ts) / ts0:+.1f} pt)" if unit_ts is not None else "")
    return (f"| {arm} | {granularity} | {layout['sink']}+{layout['window']} | {flat.count('full')}/{flat.count('window')}"
            f"/{flat.count('removed')} | {data['final']['cost_share']:.3f} | {ts:.2f} ({100 * (ts / ts0 - 1):+.1f}%) | "
            f"{sst:.2f} ({100 * (sst / sst0 - 1):+.1f}%) | {pruned['passkey']['accuracy']:.2f} | "
            f"{'' if ruler_mean is None else f'{ruler_mean:.2f}'} | {gap} |")


def table() -> tuple[list[str], list[str]]:
    """(the table's markdown lines, the arms without a raw file)."""
    dense = json.loads((HERE / "results" / "dense.json").read_text())["evaluation"]["dense"]
    lines = ["| arm | granularity | sink+window | full/windowed/removed | KV kept | TS ppl (vs dense) | "
             "SST-2 ppl (vs dense) | passkey | RULER mean | TS gap layer - unit |", "|" + "---|" * 10,
             f"| dense | | | | 1.000 | {ppl(dense, 'ts'):.2f} | {ppl(dense, 'sst'):.2f} | "
             f"{dense['passkey']['accuracy']:.2f} | | |"]
    missing = []
    for chooser, kept, unit, layers in PAIRS:
        lines.append(f"| *{chooser}, KV kept {kept}* | | | | | | | | | |")
        path = HERE / "results" / f"{unit}.json"
        unit_ts = None
        if path.is_file():
            data = json.loads(path.read_text())
            unit_ts = ppl(data["evaluation"]["pruned"], "ts")
            lines.append(row(unit, data, dense, None))
        else:
            missing.append(unit)
        for arm in layers:
            path = HERE / "results" / f"{arm}.json"
            if path.is_file():
                lines.append(row(arm, json.loads(path.read_text()), dense, unit_ts))
            else:
                missing.append(arm)
    return lines, list(dict.fromkeys(missing))


def main() -> None:
    lines, missing = table()
    print("\n".join(lines))
    if missing:
        print("\nnot run yet:", ", ".join(dict.fromkeys(missing)))


if __name__ == "__main__":
    main()
