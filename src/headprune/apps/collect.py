"""`headprune-collect`: gather the results.json files of runs/sweeps into one table.

    headprune-collect multirun/2026-11-29/10-00-00 --out experiments/metric_curves

writes `runs.csv` (one row per run and round, with the sweep's overrides as columns),
`results.md` (final accuracy per run), `curves.md` (accuracy at every sparsity, one row per run
label) and `accuracy_vs_sparsity.png` (one line per run label). `--mean-over metric.seed` merges
runs that differ only in those overrides into one label: mean, sample standard deviation and
count per point, drawn as a line with a +-1 std band.
Causal-LM runs (validation `ppl` instead of `acc`) get `ppl` columns, a perplexity table and
`perplexity_vs_sparsity.png`. Runs of both tasks collected together get one table per task in
results.md and curves.md (under a heading naming the task, with a line saying why) and both
plots: an accuracy column is never left empty for a run that reports perplexity, nor the other
way round. A run that has not finished (killed, or still running: its results.json has no final
`val`) shows "–" for its final figures and "unfinished" with the rounds it recorded as its stop
reason, rather than a final sparsity of 0. Run dirs reached through symbolic links (a folder of
links to runs) are collected like any other.

A results.json that cannot be read (truncated by a kill, a run still writing it, not a results
object, not strict JSON (NaN), a validation value or sparsity that is not a number) is skipped
and named on stderr, with the field; the command fails only when no run could be read. A null
value (results.json writes null for a non-finite accuracy, loss or perplexity) shows as "–" in the
tables, an empty cell in runs.csv, and no point in curves and plots. The outputs are published
together (made in a staging folder inside --out, then renamed into place): a failure leaves an
earlier output folder as it was.

Runs whose LLM evaluation scored RULER (`evaluation.ruler_tasks`) also get `ruler.md`: per run, the
dense model's and the export's score per task and context, the mean over every task and the RULER
mean over the tasks where dense scores at least 20% with its share of dense's (a run that did not
evaluate its dense model reads the dense scores of the one collected run that did, if exactly one).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from headprune import tasks
from headprune.atomic import share, write_json_atomic, write_text_atomic
from headprune.report import DASH, Column, column, markdown, number, spread, text, to_csv

OVERRIDE_FILE = Path(".hydra") / "overrides.yaml"
PLOT_FILES = {"acc": "accuracy_vs_sparsity.png", "ppl": "perplexity_vs_sparsity.png"}
TASKS = {"acc": "classification (accuracy)", "ppl": "causal LM (perplexity)"}  # headings of a mixed table


def run_metric(run: dict) -> str:
    """The run's headline metric ("acc" for a classification run, "ppl" for a causal-LM run): the
    Task's headline its baseline reports, else the headline of its config's model.task."""
    val = run["baseline"].get("val") or {}
    reported = [task.headline for task in tasks.TASKS.values() if task.headline in val]
    if reported:
        return reported[0]
    return tasks.get_task(((run.get("config") or {}).get("model") or {}).get("task") or "classification").headline


def _metric(runs: list[dict]) -> str:
    """"acc" when every run reports accuracy (classification), else "ppl" (causal LM)."""
    return "acc" if all(run_metric(run) == "acc" for run in runs) else "ppl"


def by_task(runs: list[dict]) -> dict[str, list[dict]]:
    """The runs grouped by what they report ("acc", then "ppl"), in their order."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run_metric(run), []).append(run)
    return {metric: groups[metric] for metric in TASKS if metric in groups}


def _per_task(runs: list[dict], table) -> str:
    """`table(runs)` when the runs are of one task; else one `table(group)` per task under a
    heading, after a line saying why."""
    groups = by_task(runs)
    if len(groups) == 1:
        return table(runs)
    parts = [f"Runs of {len(groups)} tasks: one table per task (a classification run reports no perplexity, "
             "a causal-LM run no accuracy).\n"]
    for metric, group in groups.items():
        parts.append(f"\n## {TASKS[metric]}: {len(group)} run(s)\n\n{table(group)}")
    return "".join(parts)


def unfinished(run: dict) -> bool:
    """The run has no final results (killed, failed, or still running)."""
    return "val" not in run["final"]


def _stop_reason(run: dict) -> str:
    if not unfinished(run):
        return run["final"].get("stop_reason", "")
    rounds = [r for r in run["rounds"] if r.get("sparsity") is not None]
    last = f", the last at sparsity {rounds[-1]['sparsity']:.3f}" if rounds else ""
    return f"unfinished (killed or still running): {len(run['rounds'])} round(s) recorded{last}"


def _final_sparsity(run: dict) -> str:
    return DASH if unfinished(run) else number(run["final"].get("sparsity", 0), ".3f")


def _overrides(run_dir: Path) -> dict[str, str]:
    path = run_dir / OVERRIDE_FILE
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip().removeprefix("- ").strip()
        if "=" in line and not line.startswith(("hydra.", "paths.")):
            key, value = line.split("=", 1)
            out[key.lstrip("+~")] = value
    return out


def load_runs(roots: list[Path], skipped: list[str] | None = None) -> list[dict]:
    """Every readable results.json under `roots`, with its run dir and command-line overrides.
    Unreadable ones are appended to `skipped` as "path (why)"; none readable is an error."""
    runs, skipped = [], skipped if skipped is not None else []
    for root in roots:
        for path in _results_files(Path(root)):
            data, why = _read_results(path)
            if data is None:
                skipped.append(f"{path} ({why})")
                continue
            data["run_dir"] = str(path.parent)
            data["overrides"] = _overrides(path.parent)
            runs.append(data)
    if not runs:
        unreadable = f"; unreadable: {', '.join(skipped)}" if skipped else ""
        raise FileNotFoundError(f"no readable results.json under {[str(r) for r in roots]}{unreadable}")
    return runs


def _results_files(root: Path) -> list[Path]:
    """Every results.json under `root`, symbolic links to folders followed (each real folder once,
    so a link cycle ends), sorted by path."""
    found, seen = [], set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders.sort()
        if "results.json" in names:
            found.append(Path(folder) / "results.json")
    return sorted(found)


def _read_results(path: Path) -> tuple[dict | None, str]:
    """(the results, "") or (None, why the file cannot be used)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_not_strict)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, a NaN or Infinity
        return None, f"not valid JSON, truncated or still being written: {err}"
    except OSError as err:
        return None, f"cannot be read: {err}"
    if not isinstance(data, dict):
        return None, f"holds a {type(data).__name__}, not a results object"
    for key, kind in (("baseline", dict), ("rounds", list), ("final", dict)):
        if not isinstance(data.get(key), kind):
            return None, f"'{key}' is missing or not a {kind.__name__}"
    if not isinstance(data["baseline"].get("val"), dict) or not all(isinstance(r, dict) for r in data["rounds"]):
        return None, "'baseline.val' or a round is not an object"
    bad = _unreadable_value(data)
    if bad:
        return None, bad
    return data, ""


def _not_strict(constant: str):
    raise ValueError(f"not strict JSON: {constant} (results.json writes null for a non-finite value)")


def _unreadable_value(data: dict) -> str:
    """Why a figure the tables read is unusable ('' if none): each validation value and sparsity is a
    number or null (results.json's null for a non-finite value)."""
    places = [("baseline.val", data["baseline"].get("val")), ("final.val", data["final"].get("val"))]
    for i, r in enumerate(data["rounds"]):
        places += [(f"rounds[{i}].{key}", r.get(key)) for key in ("val", "val_before_finetune")]
    checks = [(f"{where}.{k}", v) for where, block in places if isinstance(block, dict) for k, v in block.items()]
    checks += [("final.sparsity", data["final"].get("sparsity"))]
    checks += [(f"rounds[{i}].sparsity", r.get("sparsity")) for i, r in enumerate(data["rounds"])]
    for where, value in checks:
        if isinstance(value, (dict, list)) or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return f"{where}={value!r} is not a number; allowed: a number or null"
    for where, block in places[1:]:
        if block is not None and not isinstance(block, dict):
            return f"{where} is not an object"
    return ""


def label(run: dict, keys: list[str] | None = None, mean_over: list[str] = ()) -> str:
    ov = run["overrides"]
    keys = keys if keys is not None else [k for k in sorted(ov) if k not in ("schedule.target_sparsity",)]
    keys = [k for k in keys if k not in mean_over]
    return ", ".join(f"{k}={ov[k]}" for k in keys if k in ov) or Path(run["run_dir"]).name


def curve_points(run: dict, metric: str, before_finetune: bool = False) -> list[tuple[float, float]]:
    """(sparsity, metric) from the baseline through every round: after each round's fine-tuning,
    or right after its pruning step with `before_finetune`."""
    key = "val_before_finetune" if before_finetune else "val"
    pts = [(0.0, run["baseline"]["val"].get(metric))]
    pts += [(r.get("sparsity"), (r.get(key) or {}).get(metric)) for r in run["rounds"]]
    return [(s, v) for s, v in pts if s is not None and v is not None]  # null: not finite, no point


def curves(runs: list[dict], keys: list[str] | None = None, mean_over: list[str] = (),
           before_finetune: bool = False) -> dict[str, dict[float, list[float]]]:
    """label -> sparsity (rounded to 4 places) -> the values of every run with that label."""
    metric = _metric(runs)
    out: dict[str, dict[float, list[float]]] = {}
    for run in sorted(runs, key=lambda r: label(r, keys, mean_over)):
        points = out.setdefault(label(run, keys, mean_over), {})
        for r in [{"sparsity": 0.0}, *run["rounds"]]:  # every sparsity reached, with a value or not
            if r.get("sparsity") is not None:
                points.setdefault(round(r["sparsity"], 4), [])
        for sparsity, value in curve_points(run, metric, before_finetune):
            points[round(sparsity, 4)].append(value)
    return out


def curve_table(runs: list[dict], keys: list[str] | None = None, mean_over: list[str] = (),
                before_finetune: bool = False) -> str:
    """Markdown: one row per label, one column per sparsity reached by any run (one table per task)."""
    return _per_task(runs, lambda group: _curve_table(group, keys, mean_over, before_finetune))


def _curve_table(runs: list[dict], keys: list[str] | None, mean_over: list[str], before_finetune: bool) -> str:
    metric = _metric(runs)
    scale = 100 if metric == "acc" else 1
    table = curves(runs, keys, mean_over, before_finetune)
    columns = sorted({s for points in table.values() for s in points})
    what = "accuracy (%)" if metric == "acc" else "perplexity"
    cols = [text(f"run ({what} at heads pruned)", "name")]
    cols += [Column(f"{100 * s:g}%", lambda row, s=s: spread(row["points"][s], scale=scale, count=True)
                    if s in row["points"] else "") for s in columns]
    return "\n".join(markdown(cols, [{"name": name, "points": points} for name, points in table.items()])) + "\n"


def rows(runs: list[dict]) -> list[dict]:
    """One row per (run, point): the baseline (round 0) and every round."""
    out = []
    for run in runs:
        common = {"run_dir": run["run_dir"], **run["overrides"]}
        base = run["baseline"].get("val", {})
        out.append({**common, "round": 0, "sparsity": 0.0, "acc": base.get("acc"), "loss": base.get("loss"),
                    "acc_before_finetune": base.get("acc"), **_ppl(base, base)})
        for r in run["rounds"]:
            val, before = r.get("val", {}), r.get("val_before_finetune", {})
            out.append({**common, "round": r["round"], "sparsity": r["sparsity"], "acc": val.get("acc"),
                        "loss": val.get("loss"), "acc_before_finetune": before.get("acc"),
                        "rejected": r.get("rejected", False), **_ppl(val, before)})
    return out


def _ppl(val: dict, before: dict) -> dict:
    """Perplexity columns, for causal-LM runs only (classification tables keep their columns)."""
    return {"ppl": val.get("ppl"), "ppl_before_finetune": before.get("ppl")} if "ppl" in val else {}


def final_table(runs: list[dict], keys: list[str] | None = None) -> str:
    """Markdown: one row per run, its baseline and final figures (one table per task)."""
    return _per_task(runs, lambda group: _final_table(group, keys))


def _final_table(runs: list[dict], keys: list[str] | None = None) -> str:
    if _metric(runs) == "ppl":
        return _final_ppl_table(runs, keys)
    return _final_rows(runs, keys, "acc", [
        column("baseline acc", "base", ".2f", 100, right=False), text("final sparsity", "sparsity"),
        column("final acc", "final", ".2f", 100, right=False),
        column("drop (points)", lambda r: None if r["base"] is None or r["final"] is None else r["base"] - r["final"],
               ".2f", 100, right=False)])


def _final_ppl_table(runs: list[dict], keys: list[str] | None = None) -> str:
    return _final_rows(runs, keys, "ppl", [
        column("baseline ppl", "base", ".3f", right=False), text("final sparsity", "sparsity"),
        column("final ppl", "final", ".3f", right=False),
        column("final / baseline", lambda r: r["final"] / r["base"] if r["base"] and r["final"] is not None else None,
               ".3f", right=False)])


def _final_rows(runs: list[dict], keys: list[str] | None, metric: str, middle: list[Column]) -> str:
    """One left-aligned row per run (by label): its name, the `middle` columns (read from `base`,
    `final` = the run's baseline and final `metric`, and `sparsity`), its stop reason."""
    rows = [{"run": label(run, keys), "base": run["baseline"]["val"].get(metric),
             "final": (run["final"].get("val") or {}).get(metric), "sparsity": _final_sparsity(run),
             "stop reason": _stop_reason(run)} for run in sorted(runs, key=lambda r: label(r, keys))]
    return "\n".join(markdown([text("run"), *middle, text("stop reason")], rows)) + "\n"


def plot(runs: list[dict], path: Path, keys: list[str] | None = None, before_finetune: bool = False,
         mean_over: list[str] = ()) -> None:
    from headprune.plots import plt

    metric = _metric(runs)
    scale = 100 if metric == "acc" else 1
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves(runs, keys, mean_over, before_finetune).items():
        xs = sorted(s for s in points if points[s])
        mean = [scale * statistics.fmean(points[s]) for s in xs]
        (line,) = ax.plot([100 * s for s in xs], mean, marker="o", ms=3, label=name)
        if any(len(points[s]) > 1 for s in xs):
            std = [scale * statistics.stdev(points[s]) if len(points[s]) > 1 else 0.0 for s in xs]
            ax.fill_between([100 * s for s in xs], [m - d for m, d in zip(mean, std)],
                            [m + d for m, d in zip(mean, std)], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("heads pruned (%)")
    ax.set_ylabel("validation accuracy (%)" if metric == "acc" else "validation perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def collect(roots: list[Path], out: Path, keys: list[str] | None = None, before_finetune: bool = False,
            mean_over: list[str] = (), skipped: list[str] | None = None) -> list[dict]:
    """Write the tables, CSV, plot and runs.json of the readable runs under `roots` into `out`;
    unreadable results.json files are appended to `skipped`. The outputs are published together:
    every file is made in a hidden staging folder inside `out` first, and only when all are made
    are they renamed into place (a plot of a task this collection has none of is removed), so a
    failure leaves an earlier output as it was, never a mix of two collections."""
    runs = load_runs(roots, skipped)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out, prefix=".collect.", suffix=".tmp"))
    try:
        for name, body in (("runs.csv", to_csv(rows(runs))), ("results.md", final_table(runs, keys)),
                           ("curves.md", curve_table(runs, keys, mean_over, before_finetune))):
            write_text_atomic(stage / name, body)
        ruler = ruler_report(runs, keys)
        if ruler:
            write_text_atomic(stage / "ruler.md", ruler)
        for metric, group in by_task(runs).items():  # one plot per task
            plot(group, stage / PLOT_FILES[metric], keys, before_finetune, mean_over)
        # scores only of the first round (the unpruned model's importance map), to keep the file small;
        # the layer-sensitivity profile when a run measured one
        write_json_atomic(stage / "runs.json", [{k: r.get(k) for k in ("run_dir", "overrides", "baseline", "final",
                                                                       "model")}
                                                | {k: r[k] for k in ("layer_sensitivity",) if k in r}
                                                | {"rounds": [{k: v for k, v in x.items() if k != "scores" or i == 0}
                                                              for i, x in enumerate(r["rounds"])]} for r in runs])
        made = {p.name for p in stage.iterdir()}
        for name in (set(PLOT_FILES.values()) | {"ruler.md"}) - made:  # an earlier collection's plot or RULER table not made now
            (out / name).unlink(missing_ok=True)
        for name in sorted(made):
            share(stage / name)
            os.replace(stage / name, out / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return runs


def ruler_report(runs: list[dict], keys: list[str] | None = None) -> str:
    """ruler.md (module docstring), or "" when no run scored RULER."""
    from headprune.evaluation.ruler import table

    scored = [r for r in sorted(runs, key=lambda r: label(r, keys))
              if any("ruler" in (r.get("evaluation") or {}).get(w, {}) for w in ("dense", "pruned"))]
    if not scored:
        return ""
    denses = [r["evaluation"]["dense"]["ruler"] for r in scored if "ruler" in r["evaluation"].get("dense", {})]
    lines = ["# RULER (generated by headprune-collect)", "",
             "Scores: lm-eval's RULER metric (string_match_all), mean over each task's samples; essay variants on",
             "Tiny Shakespeare's training part (results.json evaluation.ruler.tasks.<task>.haystack)."]
    for run in scored:
        evaluation = run["evaluation"]
        dense = evaluation.get("dense", {}).get("ruler") or (denses[0] if len(denses) == 1 else None)
        models = {name: evaluation[which]["ruler"] for name, which in (("dense", "dense"), ("export", "pruned"))
                  if "ruler" in evaluation.get(which, {})}
        lines += ["", f"## {label(run, keys)}", "", *table(models, dense)]
    return "\n".join(lines) + "\n"


def out_problem(out: Path) -> str | None:
    """Why --out cannot be the folder the tables go to (a file, or a path under one), or None."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                return f"--out {out}: {path} is a file; allowed: a folder (new or earlier headprune-collect output)"
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    """0 when at least one run was collected (unreadable ones are listed on stderr); exits with a
    message naming them when none could be."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="+", type=Path, help="run or sweep directories to search for results.json")
    parser.add_argument("--out", type=Path, required=True, help="folder for runs.csv, results.md and the plot")
    parser.add_argument("--label", nargs="*", default=None, help="override keys that name a run in table and plot")
    parser.add_argument("--before-finetune", action="store_true",
                        help="plot accuracy right after each pruning step instead of after fine-tuning")
    parser.add_argument("--mean-over", nargs="*", default=[], metavar="KEY",
                        help="override keys (e.g. metric.seed) whose runs are averaged into one curve")
    args = parser.parse_args(argv)
    problem = out_problem(args.out)
    if problem:
        parser.error(problem)  # exit 2, before reading any run
    skipped: list[str] = []
    try:
        runs = collect(args.roots, args.out, args.label, args.before_finetune, args.mean_over, skipped)
    except FileNotFoundError as err:
        raise SystemExit(f"headprune-collect: nothing collected: {err}") from None
    if skipped:
        print(f"skipped {len(skipped)} unreadable run(s):\n" + "\n".join(f"  {s}" for s in skipped), file=sys.stderr)
    print(f"collected {len(runs)} runs into {args.out}")
    print((args.out / "results.md").read_text())
    print((args.out / "curves.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
