"""Tables of experiments/llm_iterative from its raw files: results/<alloc>_<schedule>.json, copies of
the runs' results.json (with the run's wall.json under `wall`), and kl_speed.json.

    python experiments/llm_iterative/collect.py --runs ../llmruns/llm_iterative   # copy finished runs, then render
    python experiments/llm_iterative/collect.py                                    # render from results/

writes results.md (one row per arm: KV kept per round, KL steps and tokens, perplexity at seq 2048 and
128 on held-out Tiny Shakespeare and SST-2's sentences against the dense model evaluated in the same
runs, seconds), answers.md (each arm's greedy chat answers beside the dense model's) and kl_speed.md
(from kl_speed.json, or from the log kl_speed.py printed, kl_speed.log). tests/test_experiment_tables.py checks the committed Markdown
against these functions.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = [f"{alloc}_{schedule}" for alloc in ("attention_drop", "uniform") for schedule in ("one_shot", "iterative")]


def copy_runs(runs: Path, results: Path) -> list[str]:
    """Copy each finished arm's results.json (its export written) into `results`, with wall.json."""
    results.mkdir(parents=True, exist_ok=True)
    copied = []
    for arm in ARMS:
        source = runs / arm / "results.json"
        if not source.is_file():
            continue
        data = json.loads(source.read_text())
        if "export_dir" not in data.get("final", {}):
            continue
        wall = runs / arm / "wall.json"
        if wall.is_file():
            data["wall"] = json.loads(wall.read_text())
        (results / f"{arm}.json").write_text(json.dumps(data, indent=1) + "\n")
        copied.append(arm)
    return copied


def load(results: Path) -> dict[str, dict]:
    return {arm: json.loads((results / f"{arm}.json").read_text()) for arm in ARMS
            if (results / f"{arm}.json").is_file()}


def dense_evaluation(runs: dict[str, dict]) -> dict:
    """The dense model's evaluation block (from the arm that evaluated it), refused when none did."""
    for data in runs.values():
        dense = data.get("evaluation", {}).get("dense")
        if dense:
            return dense
    raise ValueError("no run holds evaluation.dense: run one arm with evaluation.dense=true")


def _ppl(block: dict, corpus: str, seq: str) -> float:
    return (block["perplexity"] if corpus == "tinyshakespeare" else block["perplexity_other"][corpus])[seq]["ppl"]


def _change(value: float, dense: float) -> str:
    return f"{value:.2f} ({100 * (value / dense - 1):+.1f}%)"


def table(runs: dict[str, dict]) -> list[str]:
    """One row per arm; perplexities with their change against the dense model of the same runs."""
    dense = dense_evaluation(runs)
    cells = [("tinyshakespeare", "seq2048"), ("sst2", "seq2048"), ("tinyshakespeare", "seq128"), ("sst2", "seq128")]
    lines = ["| arm | KV kept after each round | KL steps (tokens) | Tiny Shakespeare, seq 2048 | SST-2, seq 2048 | "
             "Tiny Shakespeare, seq 128 | SST-2, seq 128 | train + prune s | wall s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|",
             "| dense | 1.00 | – | " + " | ".join(f"{_ppl(dense, c, s):.2f}" for c, s in cells) + " | – | – |"]
    for arm, data in runs.items():
        rounds = data["rounds"]
        kept = ", ".join(f"{r['budget']['predicted_share']:.2f}" for r in rounds)
        steps = sum(r["distill"]["steps"] for r in rounds)
        tokens = sum(r["distill"]["tokens"] for r in rounds)
        pruned = data["evaluation"]["pruned"]
        ppl = " | ".join(_change(_ppl(pruned, c, s), _ppl(dense, c, s)) for c, s in cells)
        wall = data.get("wall", {}).get("wall_seconds", "–")
        lines.append(f"| {arm} | {kept} | {steps} ({tokens:,}) | {ppl} | {data['stages']['train_and_prune']:.0f} | "
                     f"{wall} |")
    return lines


def answers(runs: dict[str, dict]) -> list[str]:
    """Per prompt, the dense model's greedy answer and each arm's (every arm asked the same prompts)."""
    dense = dense_evaluation(runs).get("generation") or []
    prompts = [item["prompt"] for item in dense]
    lines = ["| prompt | dense | " + " | ".join(runs) + " |", "|---|---|" + "---|" * len(runs)]
    columns = []
    for arm, data in runs.items():
        generated = data["evaluation"]["pruned"].get("generation") or []
        if [item["prompt"] for item in generated] != prompts:
            raise ValueError(f"{arm} was asked other prompts than the dense model")
        columns.append([item["answer"] for item in generated])
    for i, prompt in enumerate(prompts):
        cells = [dense[i]["answer"], *(column[i] for column in columns)]
        lines.append(f"| {prompt} | " + " | ".join(c.replace("|", "\\|").replace("\n", " ") or "(empty)"
                                                   for c in cells) + " |")
    return lines


def kl_speed(raw: dict) -> list[str]:
    """Median seconds per KL step of each variant and its speed over the pre-issue-38 loop."""
    seconds = raw["seconds_per_step"]
    base = statistics.median(seconds["loop_fp32_live"])
    lines = ["| variant | s / step (median of rounds) | KL steps / s vs the old loop |", "|---|---:|---:|"]
    for name, values in seconds.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.2f} | {base / median:.2f}x |")
    return lines


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
    lines = ["| model | last word acc (n) | change vs dense | seconds |", "|---|---:|---:|---:|"]
    for name in ["dense", *ARMS]:
        if name not in records:
            continue
        scores = records[name]["last_word_local"]
        change = "–" if name == "dense" else f"{100 * (scores['acc'] - dense['acc']):+.2f} points"
        lines.append(f"| {name} | {scores['acc']:.4f} ± {scores['acc_stderr']:.4f} ({scores['n']}) | {change} | "
                     f"{records[name]['seconds']:.0f} |")
    return lines


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
    for name, text in render(args.out).items():
        (args.out / name).write_text(text)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
