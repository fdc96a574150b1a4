"""The retraining_free experiment's tables, from the runs' results.json.

    python experiments/retraining_free/collect.py --runs experiments/retraining_free/runs \\
        --out experiments/retraining_free

Copies each finished run (`<runs>/<arm>_<budget>/results.json`, with `wall.json`'s wall time
added as `wall_seconds`) to `<out>/results/<arm>_<budget>.json`; the tables are then built from
`<out>/results/*.json` alone: `results.md` (accuracy per budget and arm, the drop from the
unpruned model, heads kept, predicted and measured latency share, seconds per stage) and
`retraining_free.csv` (one row per run). With `--beside <recovery results folder>`, also
`beside.md`: the heads-budget runs next to the prune-and-fine-tune arms of experiments/recovery
(accuracy before and after pruning, wall time), from both folders' result files.

Issue 30's runs (arms (d)-(g) at the heads budgets, and the 4k-sentence model's runs at 30% of
the attention FLOPs, `<arm>_flops4k_0.3`) are copied to `<out>/results/refit/` instead, with
`wall.json`'s conditions (threads, 1-minute load average at start and end, commit) as
`run_conditions`, and `<runs>/finetune4k/results.json` to `<out>/finetune_4k.json`. The tables
show them beside (a)-(c) and beside today's least squares (this experiment's `rerun/fisher_ls_heads_*.json`,
arm (c')), and `targets.md` says hit or miss for issue 30's MiniLM targets, from these files alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from headprune.atomic import write_json_atomic
from headprune.report import DASH, column, script, text, to_csv, write
from headprune.report import markdown as markdown_table
from headprune.report import number as _num

ARMS = {"taylor": "(a) Taylor, masking only", "fisher": "(b) Fisher + rearrangement",
        "fisher_ls": "(c) (b) + least-squares tuning"}
# issue 30: today's least squares (the committed re-run) and the new repairs; kept apart from ARMS,
# whose runs are the committed ones of results/
REFIT_ARMS = {"fisher_ls_rerun": "(c') (b) + least squares, streamed with bias (re-run, b2b9405)",
              "fisher_bc": "(d) (b) + bias compensation", "fisher_refit": "(e) (b) + output-projection refit",
              "refit_rank_refit": "(f) refit-error ranking + refit",
              "fisher_refit_kl": "(g) (e), then {steps} KL steps"}
ALL_ARMS = {**ARMS, **REFIT_ARMS}
BUDGET_ORDER = {"heads": 0, "latency": 1, "flops4k": 2, "heads4k": 3}


def gather(runs: Path, out: Path) -> None:
    (out / "results" / "refit").mkdir(parents=True, exist_ok=True)
    for run in sorted(p for p in runs.iterdir() if p.is_dir() and (p / "results.json").is_file()):
        res = json.loads((run / "results.json").read_text())
        if "export_dir" not in res["final"]:
            continue  # unfinished
        if run.name == "finetune4k":
            if (run / "wall.json").is_file():
                res["wall_seconds"] = json.loads((run / "wall.json").read_text())["wall_seconds"]
            write_json_atomic(out / "finetune_4k.json", res)
            continue
        arm, budget = budget_of(run.name)
        new = arm in REFIT_ARMS or budget.split()[0] in ("flops4k", "heads4k")
        if (run / "wall.json").is_file():
            wall = json.loads((run / "wall.json").read_text())
            res["wall_seconds"] = wall["wall_seconds"]
            if new:
                res["run_conditions"] = {k: v for k, v in wall.items() if k != "wall_seconds"}
        write_json_atomic(out / "results" / ("refit" if new else "") / f"{run.name}.json", res)


def budget_of(name: str) -> tuple[str, str]:
    """(arm, budget label) from a run name: fisher_ls_latency_0.8_seq128 -> (fisher_ls, latency 0.8 seq128)."""
    for arm in sorted(ALL_ARMS, key=len, reverse=True):
        if name.startswith(arm + "_"):
            return arm, name[len(arm) + 1:].replace("_", " ")
    raise ValueError(f"{name}: no known arm prefix ({', '.join(ALL_ARMS)})")


def row(arm: str, budget: str, res: dict) -> dict:
    """One run's table row: accuracies, heads, latency and the seconds of each stage."""
    (r,) = res["rounds"]
    latency = res["final"].get("latency", {})
    repair = next((r[k] for k in ("mask_tuning", "bias_compensation", "refit") if r.get(k)), None) or {}
    stages = {"costs": res.get("budget", {}).get("seconds"), "score": r["score_seconds"],
              "rearrange": (r.get("rearranged") or {}).get("seconds"),
              "mask_tuning": (r.get("mask_tuning") or {}).get("seconds"),
              "bias_compensation": (r.get("bias_compensation") or {}).get("seconds"),
              "refit": (r.get("refit") or {}).get("seconds"), "kl": (r.get("distill") or {}).get("seconds")}
    cond = res.get("run_conditions") or {}
    return {"budget": budget, "arm": arm, "acc_unpruned": res["baseline"]["val"]["acc"],
            "acc": res["final"]["val"]["acc"],
            "acc_before_tuning": r["val_before_finetune"]["acc"],
            "acc_after_refit": (r.get("val_after_refit") or {}).get("acc") if r.get("distill") else None,
            "heads_kept": sum(res["final"]["heads_per_layer"]),
            "heads_per_layer": " ".join(map(str, res["final"]["heads_per_layer"])),
            "predicted_share": (r.get("budget") or {}).get("predicted_share"),
            "measured_share": latency.get("measured_share"), "wall_seconds": res.get("wall_seconds"),
            "latency_table_cached": res.get("budget", {}).get("table_cached"),
            **{f"{k}_seconds": v for k, v in stages.items()},
            "repair_seconds": repair.get("seconds"), "kl_steps": (r.get("distill") or {}).get("steps"),
            "threads": cond.get("threads"), "load_start": cond.get("load_start"), "load_end": cond.get("load_end"),
            "commit": cond.get("commit"), "wall_note": cond.get("wall_note")}


def _sort(out: list[dict]) -> list[dict]:
    out.sort(key=lambda x: (BUDGET_ORDER[x["budget"].split()[0]], x["budget"].split()[-1], x["budget"],
                            list(ALL_ARMS).index(x["arm"])))
    return out


def rows(results: Path) -> list[dict]:
    """The rows of the run files directly in `results` (the committed (a)-(c) runs there; issue 30's
    in `results/refit`)."""
    return _sort([row(*budget_of(path.stem), json.loads(path.read_text())) for path in sorted(results.glob("*.json"))])


RERUN = Path(__file__).resolve().parent / "rerun"


def all_rows(out: Path, rerun: Path = RERUN) -> list[dict]:
    """(a)-(c) from `<out>/results`, (c') from `<rerun>/fisher_ls_heads_*` (this experiment's
    rerun/), (d)-(g) and the 4k-sentence model's runs from `<out>/results/refit`."""
    table = rows(out / "results") + rows(out / "results" / "refit")
    for path in sorted(rerun.glob("fisher_ls_heads_*.json")):
        table.append(row("fisher_ls_rerun", "heads " + path.stem.rsplit("_", 1)[1], json.loads(path.read_text())))
    return _sort(table)


def arm_label(r: dict) -> str:
    return ALL_ARMS[r["arm"]].format(steps=r.get("kl_steps"))


def budget_label(budget: str) -> str:
    if budget.startswith("flops4k "):
        return f"4k-sentence model, attention FLOPs {budget.split()[1]}"
    if budget.startswith("heads4k "):
        return f"4k-sentence model, heads removed {budget.split()[1]}"
    return budget.replace("heads ", "heads removed ")


def _latency(r: dict) -> str:
    if r["measured_share"] is not None:
        return f"{_num(r['predicted_share'], '.3f')} / {_num(r['measured_share'], '.3f')}"
    return f"{r['predicted_share']:.3f} of the FLOPs" if r["predicted_share"] is not None else DASH


COLUMNS = [text("budget", lambda r: budget_label(r["budget"])), text("arm", arm_label), column("heads kept", "heads_kept", "d"),
           column("acc", "acc", scale=100), column("drop (points)", lambda r: r["acc_unpruned"] - r["acc"], scale=100),
           column("acc before repair", "acc_before_tuning", scale=100),
           column("acc after refit (chain)", "acc_after_refit", scale=100),
           text("predicted / measured latency share", _latency),
           text("seconds: costs, score, rearrange, repair, KL",
                lambda r: ", ".join(_num(r[f"{k}_seconds"], ".1f") for k in ("costs", "score", "rearrange", "repair", "kl"))),
           column("wall s", "wall_seconds", ".0f")]


def markdown(table: list[dict]) -> str:
    return "\n".join(markdown_table(COLUMNS, table)) + "\n"


def _pts(x: float) -> str:
    return f"{100 * x:+.2f}"


MODELS = {"heads": "the full-SST-2 model", "heads4k": "the 4k-sentence model (stand-in)"}


def targets(table: list[dict]) -> str:
    """Issue 30's MiniLM targets, hit or miss and by how much, from the rows: on the full-SST-2
    model (heads budgets), and the same comparisons on the 4k-sentence model where it was run at
    the heads budgets; the 4k-sentence model at 30% of the attention FLOPs."""
    at = {(r["budget"], r["arm"]): r for r in table}
    lines = ["| target | model | measured | hit / miss |", "|---|---|---|---|"]
    for kind, model in MODELS.items():
        shares = sorted({r["budget"] for r in table if r["budget"].split()[0] == kind})
        if not shares:
            continue
        for arm in ("fisher_refit", "refit_rank_refit", "fisher_refit_kl"):
            pairs = [(b, at[(b, arm)], at[(b, "fisher")]) for b in shares if (b, arm) in at and (b, "fisher") in at]
            what = ALL_ARMS[arm].format(steps=pairs[0][1]["kl_steps"] if pairs else "the")
            if not pairs:
                if kind == "heads":
                    lines.append(f"| {what} beats no tuning ((b)) at every heads budget | {model} | not run | not measured |")
                continue
            gains = [x["acc"] - none["acc"] for _, x, none in pairs]
            measured = "; ".join(f"{100 * float(b.split()[1]):g}%: {100 * x['acc']:.2f} vs {100 * none['acc']:.2f} "
                                 f"({_pts(x['acc'] - none['acc'])})" for b, x, none in pairs)
            full = len(pairs) == len(shares)
            verdict = (("hit" if all(g > 0 for g in gains) else "miss") + f": smallest margin {_pts(min(gains))} points"
                       if full or min(gains) <= 0 else
                       f"not judged: {len(pairs)} of {len(shares)} budgets run (smallest margin there {_pts(min(gains))})")
            lines.append(f"| {what} beats no tuning ((b)) at every heads budget | {model} | {measured} | {verdict} |")
        seventy = [r for r in table if r["budget"] == f"{kind} 0.7"]
        if seventy:
            best = max(seventy, key=lambda r: r["acc"])
            drop = best["acc_unpruned"] - best["acc"]
            note = "" if any(r["arm"] in REFIT_ARMS and r["arm"] != "fisher_ls_rerun" for r in seventy) else \
                " (arms (a)-(c') only: issue 30's not run)"
            lines.append(f"| 70% of heads removed within 1 point of dense (any arm) | {model} | best {arm_label(best)}: "
                         f"{100 * best['acc']:.2f}, {100 * drop:.2f} below {100 * best['acc_unpruned']:.2f}{note} "
                         f"| {'hit' if drop <= 0.01 else 'miss'} by {abs(100 * drop - 1):.2f} points |")
    none = at.get(("flops4k 0.3", "fisher"))
    if none is not None:
        for arms, what in ((("fisher_refit", "refit_rank_refit"), "no training"), (("fisher_refit_kl",), "with the KL steps")):
            got = [at[("flops4k 0.3", a)] for a in arms if ("flops4k 0.3", a) in at]
            if not got:
                continue
            best = max(got, key=lambda r: r["acc"])
            gain = best["acc"] - none["acc"]
            lines.append(f"| 30% of attention FLOPs: >= 1 point over no tuning ({what}) | the 4k-sentence model "
                         f"| best {arm_label(best)}: {100 * best['acc']:.2f} vs (b) {100 * none['acc']:.2f} "
                         f"({_pts(gain)}) | {'hit' if gain >= 0.01 else 'miss'} by {abs(100 * gain - 1):.2f} points |")
    return "\n".join(lines) + "\n"


SUMMARY_ARMS = {"fisher": "no tuning", "fisher_ls": "least squares", "fisher_ls_rerun": "least squares",
                "fisher_bc": "bias compensation", "fisher_refit": "the refit",
                "refit_rank_refit": "refit-error ranking + refit", "fisher_refit_kl": "the refit + {steps} KL steps"}


def summary(table: list[dict]) -> str:
    """The line the project README quotes: issue 30's repairs against no tuning and least squares,
    per model and budget, as measured."""
    parts = []
    for kind, what in (("flops4k", "the 4k-sentence model ({base}) at 30% of the attention FLOPs"),
                       ("heads", "the full-SST-2 model ({base}) at {shares} of the heads removed"),
                       ("heads4k", "the 4k-sentence model ({base}) at {shares} of the heads removed")):
        runs = [r for r in table if r["budget"].split()[0] == kind and r["arm"] in SUMMARY_ARMS
                and not (kind == "heads" and r["arm"] == "fisher_ls")]
        budgets = sorted({r["budget"] for r in runs if r["arm"] not in ("fisher", "fisher_ls", "fisher_ls_rerun")})
        by_arm = {arm: [next((r for r in runs if r["arm"] == arm and r["budget"] == b), None) for b in budgets]
                  for arm in SUMMARY_ARMS}
        if not any(v and all(x is not None for x in v) for a, v in by_arm.items()
                   if a not in ("fisher", "fisher_ls", "fisher_ls_rerun")):
            continue
        figures = [SUMMARY_ARMS[arm].format(steps=v[0]["kl_steps"]) + " " + " / ".join(f"{100 * r['acc']:.2f}" for r in v)
                   for arm, v in by_arm.items() if v and all(x is not None for x in v)]
        shares = "/".join(f"{100 * float(b.split()[1]):g}" for b in budgets) + "%"
        parts.append(what.format(base=f"{100 * runs[0]['acc_unpruned']:.2f}", shares=shares) + ": " + ", ".join(figures))
    if not parts:
        return ""
    return "Issue 30's repairs ([targets](experiments/retraining_free/README.md#issue-30-refit-ranked-removal-chain)): " + \
        "; ".join(parts) + ".\n"


def load_samples(path: Path) -> str:
    """`load.csv` (unix seconds, 1-minute load average; sampled every 30 s while issue 30's runs
    went): the range and the UTC times it covers."""
    import datetime as dt
    rows_ = [tuple(map(float, line.split(","))) for line in path.read_text().split()]
    when = [dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%H:%M") for t in (rows_[0][0], rows_[-1][0])]
    loads = [x for _, x in rows_]
    return (f" Sampled every 30 s from {when[0]} to {when[1]} UTC ({len(rows_)} samples, `results/refit/load.csv`), "
            f"the 1-minute load average was {min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f}) "
            "on the 2 cores: other work ran beside these runs, so their seconds are upper bounds.")


def conditions(table: list[dict], load_csv: Path | None = None) -> str:
    """Threads, load average range and commits of the runs that recorded them (issue 30's)."""
    recorded = [r for r in table if r["commit"] is not None]
    if not recorded:
        return ""
    loads = [x for r in recorded for x in (r["load_start"], r["load_end"]) if x is not None]
    walls = [r["wall_seconds"] for r in recorded]
    return (f"Issue 30's {len(recorded)} runs: torch threads {', '.join(sorted({str(r['threads']) for r in recorded}))}; "
            f"1-minute load average at their start and end {min(loads):.2f}-{max(loads):.2f}; "
            f"code of commit {', '.join(sorted({r['commit'] for r in recorded}))}; "
            f"wall {min(walls):.0f}-{max(walls):.0f} s per run."
            + "".join(f" {r['arm']} {r['budget']}: {r['wall_note']}." for r in recorded if r["wall_note"])
            + (load_samples(load_csv) if load_csv is not None and load_csv.is_file() else "") + "\n")


FINETUNE_ARMS = {"one_shot_short": "one-shot, then 1 epoch", "one_shot_long": "one-shot, then 1 epoch per round",
                 "iterative": "iterative, 1 epoch per round", "distill": "iterative + distillation"}


def beside(table: list[dict], recovery: Path) -> str:
    """Retraining-free runs at heads budgets beside the recovery experiment's prune-and-fine-tune
    arms: what each starts from, what it ends at, and its wall time (mean over seeds)."""
    out = []
    for r in table:
        if r["budget"].startswith("heads ") and r["arm"] in ARMS:
            out.append((float(r["budget"].split()[1]), 0, f"retraining-free {ARMS[r['arm']]}",
                        "fine-tuned on all of SST-2", [r["acc_unpruned"]], [r["acc"]], [r["wall_seconds"]]))
    groups: dict = {}
    for path in sorted(recovery.glob("*.json")):
        arm, target, _ = path.stem.rsplit("_", 2)
        if arm in FINETUNE_ARMS:
            res = json.loads(path.read_text())
            g = groups.setdefault((float(target), arm), ([], [], []))
            g[0].append(res["baseline"]["val"]["acc"])
            g[1].append(res["final"]["val"]["acc"])
            g[2].append(res.get("wall_seconds"))
    for (target, arm), (before, after, walls) in groups.items():
        out.append((target, 1 + list(FINETUNE_ARMS).index(arm), f"prune and fine-tune: {FINETUNE_ARMS[arm]}",
                    "2 epochs on 4,000 sentences", before, after, walls))
    routes = []
    for target, _, route, start, before, after, walls in sorted(out, key=lambda x: x[:2]):
        known = [w for w in walls if w is not None]
        routes.append({"target": target, "route": route + (f" (mean of {len(after)} seeds)" if len(after) > 1 else ""),
                       "start": start, "before": statistics.fmean(before), "after": statistics.fmean(after),
                       "wall": f"{statistics.fmean(known) / 60:.1f}" if len(known) == len(walls) else "– (reused)"})
    lines = markdown_table([column("heads removed", "target", "g", scale=100, unit="%"), text("route"),
                            text("starts from", "start"), column("acc before pruning", "before", scale=100),
                            column("acc after", "after", scale=100),
                            column("change (points)", lambda r: r["after"] - r["before"], "+.2f", scale=100),
                            text("wall min", "wall", right=True)], routes)
    return "\n".join(lines) + "\n"


RECOVERY = Path(__file__).resolve().parent.parent / "recovery" / "results"


def render(folder: Path, recovery: Path | None = RECOVERY) -> dict[str, str]:
    """retraining_free.csv, results.md, targets.md, summary.md and streaming_ls.md (streaming_ls.py's
    re-runs beside the committed runs) from `folder`'s result files, and
    beside.md with the recovery experiment's results folder `recovery` (None: no beside.md)."""
    table = all_rows(folder)
    files = {"retraining_free.csv": to_csv(table), "results.md": markdown(table),
             "targets.md": targets(table) + "\n" + conditions(table, folder / "results" / "refit" / "load.csv"),
             "summary.md": summary(table),
             "streaming_ls.md": script(Path(__file__).resolve().parent / "streaming_ls.py").table(folder)}
    if recovery is not None:
        files["beside.md"] = beside(table, recovery)
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--beside", type=Path, default=None, help="experiments/recovery/results, for beside.md")
    args = parser.parse_args(argv)
    if args.runs is not None:
        gather(args.runs, args.out)
    files = render(args.out, args.beside)
    write(args.out, files)
    print(files["results.md"])


if __name__ == "__main__":
    main()
