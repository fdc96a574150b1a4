"""table.md from the raw last_word*.json files of this folder (written by measure.py): one row per
model measured, with the accuracy, its standard error, the items and the check against the
committed llm_kv arm.

    python experiments/llm_kv/last_word/table.py
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(folder: Path = HERE) -> list[dict]:
    """One row per (file, model), files in name order, models in measuring order."""
    out = []
    for path in sorted(folder.glob("last_word*.json")):
        data = json.loads(path.read_text())
        arms = data["settings"]["arms"]
        for name, model in data["models"].items():
            row = model["zero_shot"]["last_word_local"]
            metric, target = arms.get(name, ("-", 1.0))
            out.append({"model": name, "metric": metric, "kv_kept": target, "acc": row["acc"],
                        "stderr": row["acc_stderr"], "n": row["n"],
                        "same_heads": model.get("same_heads_as_committed"), "seconds": model["seconds"],
                        "file": path.name, "commit": data["commit"]})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model | metric | KV kept | last-word acc | ± stderr | passages | heads = committed arm | seconds | raw file |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "-" if r["same_heads"] is None else ("yes" if r["same_heads"] else "NO")
        lines.append(f"| {r['model']} | {r['metric']} | {r['kv_kept']:.2f} | {r['acc']:.3f} | {r['stderr']:.3f} | "
                     f"{r['n']} | {same} | {r['seconds']:.0f} | {r['file']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    (HERE / "table.md").write_text(table(rows()))


if __name__ == "__main__":
    main()
