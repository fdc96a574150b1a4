"""The heads-budget runs again after the Pruner refactor (issue 22) and the streamed Kwon-style
least squares (issue 24), beside the committed runs: same heads? same accuracy?

    python experiments/retraining_free/streaming_ls.py --runs <rerun run dirs> --out experiments/retraining_free

Copies each finished re-run (`<runs>/<arm>_heads_<s>/results.json`, `wall.json` added) to
`<out>/rerun/<name>.json`, then writes `<out>/streaming_ls.md` from `<out>/results/` (the
committed runs) and `<out>/rerun/` alone: per arm and share of heads removed, whether the same
heads were removed, the accuracy before any tuning and the final accuracy in both, and the
tuning's seconds. Arms (a) and (b) do no tuning, so they must match exactly; arm (c)'s tuning
changed from per-layer scales fitted against the dense outputs to scales plus an output bias
fitted on the pruned model's own inputs (`fisher_ls_nobias`: the same without the bias).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from headprune.atomic import write_json_atomic, write_text_atomic

ARMS = {"taylor": "(a) Taylor", "fisher": "(b) Fisher + rearrangement", "fisher_ls": "(c) (b) + least squares",
        "fisher_ls_nobias": "(c) with recovery.bias=false (committed: (c))"}


def gather(runs: Path, out: Path) -> None:
    (out / "rerun").mkdir(parents=True, exist_ok=True)
    for run in sorted(p for p in runs.iterdir() if p.is_dir() and "_heads_" in p.name):
        if not (run / "results.json").is_file():
            continue
        res = json.loads((run / "results.json").read_text())
        if "export_dir" not in res["final"]:
            continue
        if (run / "wall.json").is_file():
            res["wall_seconds"] = json.loads((run / "wall.json").read_text())["wall_seconds"]
        write_json_atomic(out / "rerun" / f"{run.name}.json", res)


def table(out: Path) -> str:
    lines = ["| arm | heads removed | same heads | acc before tuning (committed / re-run) | final acc (committed / re-run) "
             "| tuning s (committed / re-run) |", "|---|---:|:---:|---:|---:|---:|"]
    for path in sorted((out / "rerun").glob("*.json")):
        arm, share = path.stem.split("_heads_")
        committed = out / "results" / path.name.replace("_nobias", "")
        old, new = (json.loads(p.read_text()) for p in (committed, path))
        (ro,), (rn,) = old["rounds"], new["rounds"]
        tuning = [((r.get("mask_tuning") or {}).get("seconds")) for r in (ro, rn)]
        lines.append(f"| {ARMS[arm]} | {float(share):.0%} | {'yes' if ro['pruned'] == rn['pruned'] else 'no'} "
                     f"| {100 * ro['val_before_finetune']['acc']:.2f} / {100 * rn['val_before_finetune']['acc']:.2f} "
                     f"| {100 * old['final']['val']['acc']:.2f} / {100 * new['final']['val']['acc']:.2f} "
                     f"| {' / '.join('–' if t is None else f'{t:.0f}' for t in tuning)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.runs is not None and args.runs.is_dir():
        gather(args.runs, args.out)
    write_text_atomic(args.out / "streaming_ls.md", table(args.out))


if __name__ == "__main__":
    main()
