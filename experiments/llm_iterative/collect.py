"""Tables of experiments/llm_iterative from its raw files: results/<alloc>_<schedule>.json, copies of
the runs' results.json (with the run's wall.json under `wall`), and kl_speed.json.

    python experiments/llm_iterative/collect.py --runs ../llmruns/llm_iterative   # copy finished runs, then render
    python experiments/llm_iterative/collect.py                                    # render from results/

writes results.md (one row per arm: KV kept per round, KL steps and tokens, perplexity at seq 2048 and
128 on held-out Tiny Shakespeare and SST-2's sentences against the dense model evaluated in the same
runs, seconds), answers.md (each arm's greedy chat answers beside the dense model's) and kl_speed.md
(from kl_speed.json, or from the log kl_speed.py printed, kl_speed.log). tests/test_experiment_results.py checks the committed Markdown
against these functions.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
from pathlib import Path

from headprune.report import DASH, Column, change, column, gather, load_results, markdown, text, write
from headprune.run_record import dense_of, records

HERE = Path(__file__).resolve().parent
ARMS = [f"{alloc}_{schedule}" for alloc in ("attention_drop", "uniform") for schedule in ("one_shot", "iterative")]


def copy_runs(runs: Path, results: Path) -> list[str]:
    """Copy each finished arm's results.json (its export written) into `results`, with wall.json."""
    return gather(runs, results, lambda data: "export_dir" in data.get("final", {}), ARMS)


def load(results: Path) -> dict[str, dict]:
    return load_results(results, ARMS)


CELLS = {("tinyshakespeare", "seq2048"): "Tiny Shakespeare, seq 2048", ("sst2", "seq2048"): "SST-2, seq 2048",
         ("tinyshakespeare", "seq128"): "Tiny Shakespeare, seq 128", ("sst2", "seq128"): "SST-2, seq 128"}


def _perplexity(corpus: str, seq: str):
    """A perplexity cell: the value, and for an arm its change against the dense model of the same runs."""
    def cell(r: dict) -> str:
        value, dense = r["ppl"][corpus, seq], r["dense_ppl"][corpus, seq]
        return f"{value:.2f}" if r["arm"] == "dense" else f"{value:.2f} ({change(value, dense)})"
    return Column(CELLS[corpus, seq], cell)


COLUMNS = [text("arm"), text("KV kept after each round", lambda r: ", ".join(f"{k:.2f}" for k in r["kept"])),
           text("KL steps (tokens)", lambda r: DASH if r["steps"] is None else f"{r['steps']} ({r['tokens']:,})", right=True),
           *(_perplexity(*cell) for cell in CELLS), column("train + prune s", "train_and_prune", ".0f"),
           text("wall s", lambda r: DASH if r["wall"] is None else r["wall"], right=True)]


def rows(runs: dict[str, dict]) -> list[dict]:
    """The dense model (from the arm that evaluated it), then one row per arm."""
    typed = records(runs)  # the main corpus (Tiny Shakespeare) named from each run's config.data.name
    dense = {(corpus, seq): dense_of(typed).ppl(seq, corpus) for corpus, seq in CELLS}
    out = [{"arm": "dense", "kept": [1.0], "steps": None, "tokens": None, "ppl": dense, "dense_ppl": dense,
            "train_and_prune": None, "wall": None}]
    for arm, data in runs.items():
        rounds = data["rounds"]
        out.append({"arm": arm, "kept": [r["budget"]["predicted_share"] for r in rounds],
                    "steps": sum(r["distill"]["steps"] for r in rounds),
                    "tokens": sum(r["distill"]["tokens"] for r in rounds),
                    "ppl": {(corpus, seq): typed[arm].ppl("pruned", seq, corpus) for corpus, seq in CELLS},
                    "dense_ppl": dense,
                    "train_and_prune": data["stages"]["train_and_prune"],
                    "wall": data.get("wall", {}).get("wall_seconds")})
    return out


def table(runs: dict[str, dict]) -> list[str]:
    """One row per arm; perplexities with their change against the dense model of the same runs."""
    return markdown(COLUMNS, rows(runs))


def _answer(answer: str) -> str:
    return answer.replace("|", "\\|").replace("\n", " ") or "(empty)"


def answers(runs: dict[str, dict]) -> list[str]:
    """Per prompt, the dense model's greedy answer and each arm's (every arm asked the same prompts)."""
    dense = dense_of(records(runs)).get("generation") or []
    prompts = [item["prompt"] for item in dense]
    answered = {"dense": [item["answer"] for item in dense]}
    for arm, data in runs.items():
        generated = data["evaluation"]["pruned"].get("generation") or []
        if [item["prompt"] for item in generated] != prompts:
            raise ValueError(f"{arm} was asked other prompts than the dense model")
        answered[arm] = [item["answer"] for item in generated]
    columns = [text("prompt", lambda i: prompts[i])]
    columns += [text(name, lambda i, name=name: _answer(answered[name][i])) for name in answered]
    return markdown(columns, range(len(prompts)))


def kl_speed(raw: dict) -> list[str]:
    """Median seconds per KL step of each variant and its speed over the pre-issue-38 loop."""
    medians = {name: statistics.median(values) for name, values in raw["seconds_per_step"].items()}
    base = medians["loop_fp32_live"]
    return markdown([text("variant"), column("s / step (median of rounds)", "median"),
                     column("KL steps / s vs the old loop", lambda r: base / r["median"], unit="x")],
                    [{"variant": name, "median": median} for name, median in medians.items()])


def kl_speed_from_log(text: str) -> dict:
    """The per-round figures kl_speed.py prints ("round R <variant>: S s/step"), for a run whose
    JSON was not written (the first measurement, whose last line failed: see the README)."""
    seconds: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"round (\d+) (\w+): ([\d.]+) s/step", line.strip())
        if match:
            seconds.setdefault(match.group(2), []).append(float(match.group(3)))
    if "loop_fp32_live" not in seconds:
        raise ValueError("the log holds no round of the old loop (loop_fp32_live)")
    return {"seconds_per_step": seconds}


def last_word(records: dict[str, dict]) -> list[str]:
    """Last-word accuracy (results/last_word/<model>.json, written by last_word.py) of the dense
    model and each arm, with its change against dense."""
    dense = records["dense"]["last_word_local"]

    def points(r: dict) -> str:
        return DASH if r["name"] == "dense" else f"{100 * (r['acc'] - dense['acc']):+.2f} points"
    rows = [{"name": name, "seconds": records[name]["seconds"], **records[name]["last_word_local"]}
            for name in ["dense", *ARMS] if name in records]
    return markdown([text("model", "name"), text("last word acc (n)", lambda r: f"{r['acc']:.4f} ± {r['acc_stderr']:.4f} "
                                                  f"({r['n']})", right=True),
                     text("change vs dense", points, right=True), column("seconds", "seconds", ".0f")], rows)


def render(folder: Path = HERE) -> dict[str, str]:
    """{file name: Markdown} of every table the raw files in `folder` give."""
    out = {}
    runs = load(folder / "results")
    if runs:
        out["results.md"] = "\n".join(table(runs)) + "\n"
        out["answers.md"] = "\n".join(answers(runs)) + "\n"
    words = {p.stem: json.loads(p.read_text()) for p in sorted((folder / "results" / "last_word").glob("*.json"))}
    if "dense" in words:
        out["last_word.md"] = "\n".join(last_word(words)) + "\n"
    speed, log = folder / "kl_speed.json", folder / "kl_speed.log"
    if speed.is_file():
        out["kl_speed.md"] = "\n".join(kl_speed(json.loads(speed.read_text()))) + "\n"
    elif log.is_file():
        out["kl_speed.md"] = "\n".join(kl_speed(kl_speed_from_log(log.read_text()))) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, help="copy the finished arms' results.json from these run dirs first")
    parser.add_argument("--out", type=Path, default=HERE, help="the folder holding results/ (default: this one)")
    args = parser.parse_args(argv)
    if args.runs is not None:
        print("copied:", ", ".join(copy_runs(args.runs, args.out / "results")) or "nothing")
        if args.out != HERE and (HERE / "kl_speed.json").is_file() and not (args.out / "kl_speed.json").exists():
            shutil.copy(HERE / "kl_speed.json", args.out / "kl_speed.json")
    files = render(args.out)
    write(args.out, files)
    for name in files:
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
