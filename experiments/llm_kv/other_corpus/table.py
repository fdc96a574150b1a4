"""table.md from other_corpus.json (written by measure.py): per model, perplexity on Tiny
Shakespeare's held-out part (the calibration corpus) and on SST-2's validation sentences (not
calibrated on), each as a ratio to dense, and the committed llm_kv number of the same arm.

    python experiments/llm_kv/other_corpus/table.py
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(path: Path = HERE / "other_corpus.json") -> list[dict]:
    data = json.loads(path.read_text())
    dense = data["models"]["dense"]
    out = []
    for name, model in data["models"].items():
        for key, main in model["perplexity"].items():
            other = model["perplexity_other"]["sst2"][key]["ppl"]
            out.append({"model": name, "seq": main["seq"], "main": main["ppl"],
                        "main_ratio": main["ppl"] / dense["perplexity"][key]["ppl"],
                        "other": other, "other_ratio": other / dense["perplexity_other"]["sst2"][key]["ppl"],
                        "committed": model.get("committed_perplexity", {}).get(key)})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model | seq | Tiny Shakespeare ppl | x dense | SST-2 ppl | x dense | committed llm_kv ppl |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        committed = "-" if r["committed"] is None else f"{r['committed']:.2f}"
        lines.append(f"| {r['model']} | {r['seq']} | {r['main']:.2f} | {r['main_ratio']:.2f} | {r['other']:.2f} | "
                     f"{r['other_ratio']:.2f} | {committed} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    (HERE / "table.md").write_text(table(rows()))


if __name__ == "__main__":
    main()
