"""results.md of experiments/scale/model_device from its raw files: <model_device>_<round>/bench.json,
the bench.scale rows of scoring, allocation and refit at SmolLM2-135M's shape with the models whole
(model_device=run) and their blocks streamed (cpu), interleaved run_1, cpu_1, run_2, cpu_2.

    python experiments/scale/model_device/collect.py   # rewrite results.md

Columns: the host's figures measured by the bench (seconds of the stage, peak resident memory and
its net over the child's base per model byte), then what a device would hold by each row's
residency trace (bench.scale's info.device: the most blocks of the pruned model / the dense copy on
the device at once, and device_ratio: the bytes the device holds of both over the model's bytes);
built with headprune.report (`render`).
"""
from __future__ import annotations

from pathlib import Path

from headprune.report import column, markdown, read_json, text, write

HERE = Path(__file__).resolve().parent
RUNS = ["run_1", "cpu_1", "run_2", "cpu_2"]
MIB = 2 ** 20


def blocks(row: dict, name: str) -> str:
    """'1 of 30' for a streamed model, 'all' for a whole one, '' when the stage has no such model."""
    device = row["info"]["device"].get(name)
    if device is None:
        return ""
    return f"{device['peak_resident_blocks']} of {device['blocks']}" if device["streamed"] else "all"


def rows(folder: Path) -> list[dict]:
    out = []
    for run in RUNS:
        bench = read_json(folder / run / "bench.json")
        for r in bench["scale"]:
            out.append({**r, "run": run, "commit": bench["meta"]["commit"], "threads": bench["meta"]["threads"],
                        "date": bench["meta"]["date"]})
    return out


COLUMNS = [text("run"), text("stage"), text("model_device"), column("seconds", "seconds", ".1f"),
           column("peak RSS MiB", "peak_rss_mib", ",.0f"), column("peak / model", "peak_ratio", ".2f", unit="x"),
           text("pruned model's blocks on the device", lambda r: blocks(r, "model"), right=True),
           text("dense copy's blocks on the device", lambda r: blocks(r, "dense"), right=True),
           column("device bytes / model", "device_ratio", ".2f", unit="x"), column("load before", "load_before", ".2f")]


def render(folder: Path) -> dict[str, str]:
    table = rows(folder)
    first = table[0]
    lines = [f"SmolLM2-135M's shape ({first['params'] / 1e6:.1f}M parameters, {first['model_bytes'] / MIB:,.0f} MiB in "
             f"{first['dtype']}), {first['tokens']} calibration tokens.", "", *markdown(COLUMNS, table), "",
             "Conditions: " + "; ".join(sorted({f"{r['run']}: {r['date']}, commit {r['commit']}, {r['threads']} torch "
                                                f"thread(s)" for r in table}))]
    return {"results.md": "\n".join(lines) + "\n"}


def main() -> None:
    files = render(HERE)
    write(HERE, files)
    print(files["results.md"])


if __name__ == "__main__":
    main()
