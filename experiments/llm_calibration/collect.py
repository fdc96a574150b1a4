"""The llm_calibration experiment's tables, from the runs' results.json (issue 40, section 2).

    python experiments/llm_calibration/collect.py [--runs ../llmruns/llm_calibration]

Copies each finished run (`<runs>/<allocation>_<repair>_<calibration>/results.json`, with the run's
`wall.json` added as `wall`) to `results/<allocation>_<repair>_<calibration>.json`; everything else is
built from `results/*.json` alone (and, for a corpus row no run here has, the raw file of the experiment
that measured it under this protocol: `ELSEWHERE`): `results.md` (per allocation, repair and calibration source: the
calibration blocks (corpus / generated) and tokens, perplexity at seq 128 and 2048 on held-out Tiny
Shakespeare and on SST-2's validation sentences (never calibrated on) with their change from dense, the
ratio of the two changes (issue 40's target: SST-2's change within 1.5x of the in-domain one), the
sampling's seconds and the run's wall seconds) and `best.md` (per allocation and repair, and over all
rows, the calibration with the lowest SST-2 perplexity at seq 2048, beside the corpus row).
The dense model's numbers come from the run that evaluated it (`evaluation.dense`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from headprune.report import DASH, column, gather, markdown, text, write
from headprune.run_record import Evaluation, dense_of, record, records

HERE = Path(__file__).resolve().parent
ALLOCATIONS = {"uniform": "uniform (Fisher + rearrangement)", "attention_drop": "attention drop (He et al. 2024)"}
REPAIRS = {"refit": "output-projection refit", "ls": "least squares (scales, bias)"}
CALIBRATIONS = {"corpus": "Tiny Shakespeare", "self": "self-generated", "mix": "mix (half each)"}
OTHER = "sst2"  # the corpus not calibrated on
SEQS = ("seq128", "seq2048")
RATIO_TARGET = 1.5  # issue 40: every arm's SST-2 change within 1.5x of its in-domain change
# a corpus row measured by another experiment under this protocol (experiment=llm_kv, budget.target=0.67, 16 x 512
# Tiny Shakespeare calibration tokens, the same evaluation windows), read from its raw file when no run here has it
ELSEWHERE = {"attention_drop_refit_corpus": HERE.parent / "llm_uneven" / "results" / "attention_drop_refit_kv67.json"}


def copy_runs(runs: Path, out: Path) -> list[str]:
    """results/<name>.json for every finished run in `runs` (its export evaluated), `wall.json` as `wall`."""
    names = [p.name for p in sorted(runs.iterdir()) if split(p.name) is not None]
    return gather(runs, out / "results", lambda res: "pruned" in res.get("evaluation", {}), names)


def split(stem: str) -> tuple[str, str, str] | None:
    """(allocation, repair, calibration) of a run name, or None for another name."""
    for alloc in ALLOCATIONS:
        for repair in REPAIRS:
            for cal in CALIBRATIONS:
                if stem == f"{alloc}_{repair}_{cal}":
                    return alloc, repair, cal
    return None


def load(results: Path) -> dict[str, dict]:
    """{run name: results} of results/ and, for a name it lacks, of ELSEWHERE (`source` added: the file read)."""
    runs = {p.stem: {**json.loads(p.read_text()), "source": p.name} for p in sorted(results.glob("*.json"))
            if split(p.stem)}
    for stem, path in ELSEWHERE.items():
        if stem not in runs and path.is_file():
            runs[stem] = {**json.loads(path.read_text()), "source": str(path.relative_to(HERE.parent.parent))}
    return runs


def dense(runs: dict[str, dict]) -> dict:
    """{(corpus, seq): ppl} of the dense model, from the run that evaluated it."""
    return _ppl(dense_of(records(runs)))


def _ppl(block: Evaluation) -> dict:
    """{(corpus, seq): ppl}; "ts": the run's main corpus (config.data.name, Tiny Shakespeare here)."""
    return {(corpus, s): block.ppl(s, None if corpus == "ts" else corpus) for corpus in ("ts", OTHER) for s in SEQS}


def _calibration(res: dict) -> tuple[str, str, float | None]:
    """(blocks as 'corpus + generated', tokens, the sampling's seconds or None when the cache gave them)."""
    cal = res.get("calibration")
    if cal is None:  # a run of the code before data.calibration (f502f53): the corpus, data.score_samples blocks
        data = res["config"]["data"]
        return f"{data['score_samples']} + 0", str(data["score_samples"] * data["block_size"]), None
    blocks = cal["score_blocks"]
    made = cal.get("generated") or {}
    corpus = sum(v for k, v in blocks.items() if k != "self")
    seconds = None if made.get("reused", True) else made.get("seconds")
    return f"{corpus} + {blocks.get('self', 0)}", str(cal["tokens"]), seconds


def rows(runs: dict[str, dict]) -> list[dict]:
    base = dense(runs)
    out = []
    for stem, res in runs.items():
        alloc, repair, cal = split(stem)
        ppl = _ppl(record(res, stem, res["source"]).evaluation["pruned"])
        change = {k: 100 * (v / base[k] - 1) for k, v in ppl.items()}
        blocks, tokens, seconds = _calibration(res)
        wall = res.get("wall") or {}
        out.append({"stem": stem, "allocation": alloc, "repair": repair, "calibration": cal, "blocks": blocks,
                    "tokens": tokens, "ppl": ppl, "change": change,
                    "ratio": change[(OTHER, "seq2048")] / change[("ts", "seq2048")],
                    "sampling_s": seconds, "wall_s": wall.get("wall_seconds"), "source": res["source"],
                    "load": wall.get("load_average_end")})
    order = {k: i for i, k in enumerate([*ALLOCATIONS, *REPAIRS, *CALIBRATIONS])}
    return sorted(out, key=lambda r: (order[r["allocation"]], order[r["repair"]], order[r["calibration"]]))


def _ppl_column(heading: str, key: tuple):
    return column(heading, lambda r: r["ppl"][key])


def _change_column(key: tuple):
    return column("change", lambda r: r["change"][key], "+.1f", unit="%")


def results_table(table: list[dict], base: dict) -> str:
    lines = [f"Dense: Tiny Shakespeare perplexity {base[('ts', 'seq128')]:.2f} (seq 128), "
             f"{base[('ts', 'seq2048')]:.2f} (seq 2048); SST-2 sentences {base[(OTHER, 'seq128')]:.2f} (seq 128), "
             f"{base[(OTHER, 'seq2048')]:.2f} (seq 2048).", ""]
    columns = [text("allocation", lambda r: ALLOCATIONS[r["allocation"]]), text("repair", lambda r: REPAIRS[r["repair"]]),
               text("calibration", lambda r: CALIBRATIONS[r["calibration"]]),
               text("blocks (corpus + generated)", "blocks", right=True), text("tokens", right=True),
               _ppl_column("TS ppl 128", ("ts", "seq128")), _ppl_column("TS ppl 2048", ("ts", "seq2048")),
               _change_column(("ts", "seq2048")), _ppl_column("SST-2 ppl 128", (OTHER, "seq128")),
               _ppl_column("SST-2 ppl 2048", (OTHER, "seq2048")), _change_column((OTHER, "seq2048")),
               column("SST-2 / TS change (target <= 1.5)", "ratio"), column("sampling s", "sampling_s", ".0f"),
               column("wall s", "wall_s", ".0f"),
               text("load average at end", lambda r: DASH if r["load"] is None else " / ".join(f"{x:.1f}" for x in r["load"])),
               text("raw file", "source")]
    return "\n".join(lines + markdown(columns, table)) + "\n"


def best_table(table: list[dict]) -> str:
    """Per allocation and repair, and over every row: the lowest SST-2 perplexity at seq 2048."""
    groups: dict[tuple, list[dict]] = {}
    for r in table:
        groups.setdefault((r["allocation"], r["repair"]), []).append(r)
    groups[("all", "all")] = table
    bests = []
    for (alloc, repair), group in groups.items():
        best = min(group, key=lambda r: r["ppl"][(OTHER, "seq2048")])
        corpus = [r for r in group if r["calibration"] == "corpus" and
                  (r["allocation"], r["repair"]) == (best["allocation"], best["repair"])]
        bests.append({**best, "any": alloc == "all", "ref": corpus[0]["ppl"][(OTHER, "seq2048")] if corpus else None})

    def versus(r):
        return DASH if r["ref"] is None else f"{r['ppl'][(OTHER, 'seq2048')] / r['ref']:.2f}x"
    columns = [text("allocation", lambda r: f"**any** ({ALLOCATIONS[r['allocation']]})" if r["any"]
                    else ALLOCATIONS[r["allocation"]]),
               text("repair", lambda r: f"**any** ({REPAIRS[r['repair']]})" if r["any"] else REPAIRS[r["repair"]]),
               text("best calibration out of domain", lambda r: CALIBRATIONS[r["calibration"]]),
               _ppl_column("SST-2 ppl 2048", (OTHER, "seq2048")), _change_column((OTHER, "seq2048")),
               _ppl_column("TS ppl 2048", ("ts", "seq2048")), _change_column(("ts", "seq2048")),
               column("corpus row's SST-2 ppl 2048", "ref"), text("SST-2 ppl vs the corpus row", versus, right=True)]
    return "\n".join(markdown(columns, bests)) + "\n"


def render(folder: Path = HERE) -> dict[str, str]:
    """results.md and best.md from `folder`/results (and ELSEWHERE)."""
    runs = load(folder / "results")
    table = rows(runs)
    return {"results.md": results_table(table, dense(runs)), "best.md": best_table(table)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=None, help="run dirs to copy results from first")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    if args.runs is not None:
        copy_runs(args.runs, args.out)
    write(args.out, render(args.out))


if __name__ == "__main__":
    main()
