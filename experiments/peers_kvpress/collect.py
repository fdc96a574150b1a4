"""The table of experiments/peers_kvpress from its raw files: RULER score against KV bytes held,
kvpress's presses beside headprune's layouts, on one model and samples file.

    python experiments/peers_kvpress/collect.py

reads raw/<set>/<config>.json (run_press.py: kvpress presses and dense in kvpress's venv; run_ours.py:
headprune's layouts and dense under transformers 5.x) and raw/<set>_memory/<config>.json (the same
configs, each in its own process on one sample: peak resident memory), scores every prediction with
lm-eval 0.4.13's RULER metric (`lm_eval.tasks.ruler.common_utils`: `postprocess_pred`, then
`string_match_all`: the share of the expected strings found in the answer, case-insensitive), and
writes results.md (built with headprune.report). Only the samples every config of a set answered
count (the runs are cut at a time, in task-by-task order), so every row scores the same samples.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from headprune.report import DASH, column, load_results, markdown, number, text, write

HERE = Path(__file__).resolve().parent
SETS = {"smollm2_4096": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32), RULER at 4096 tokens",
        "gemma3_270m_4096": "Gemma-3-270M (Q4_K_M GGUF, dequantized to float32; base model, plain prompt), "
                            "RULER at 4096 tokens"}
# what a set's shares are of, where that is not every layer holding the whole context
NOTES = {"gemma3_270m_4096": [
    "Gemma 3 slides a 512-token window on 15 of its 18 layers (5, 11 and 17 are global). Dense here is the",
    "model's own cache (transformers' DynamicCache(config=...)): a sliding layer holds its last 511 tokens, a",
    "global one the whole context, and every share (kept, claimed, held) is of those bytes, per sample.",
    "kvpress 0.5.5 compresses every layer of a Gemma3ForCausalLM, sliding ones too (it skips them only for",
    "Gemma3ForConditionalGeneration), in the cache its pipeline creates (DynamicCache(): every layer keeps",
    "every token, the row dense_full_cache). So each press was asked for the share of the context that holds",
    "the kept share of dense's bytes (run_press.py --kept-of native, at the samples' mean context of 3,455",
    "tokens: 0.34 of dense's bytes is 0.099 of the context on every layer; the held share measured per",
    "sample varies with its context, 0.353 at 3,800 tokens); asked for 0.34 of the context itself, a press",
    "would hold 1.22x dense's bytes at 3,800 tokens. Sparing the sliding layers instead (kvpress's Gemma 3",
    "rule) cannot reach these budgets: their windows alone are 0.40 of dense's bytes at 3,800 tokens.", ""]}
ORDER = ["dense", "dense_transformers5", "dense_full_cache", "ours_default_0.34", "ours_retrieval_0.34",
         "streaming_llm_0.34", "snapkv_0.34",
         "expected_attention_0.34", "adakv_expected_attention_0.34", "kvzip_0.34", "duo_attention_on_the_fly_0.34",
         "ours_default_0.15", "ours_retrieval_0.15", "streaming_llm_0.15", "snapkv_0.15", "expected_attention_0.15",
         "adakv_expected_attention_0.15", "kvzip_0.15", "duo_attention_on_the_fly_0.15"]
# where the bytes a press claims are only masked (kept in the cache, hidden at attention time)
SIMULATED = {"adakv_expected_attention", "kvzip", "duo_attention_on_the_fly"}
MIN_DENSE = 0.2  # a task the dense model scores below this is reported but left out of the mean (issue 53)
BUDGETS = (0.34, 0.15)


def score(task: str, prediction: str, outputs: list[str]) -> float:
    """lm-eval's RULER metric for one answer (every task here: process_results = string_match_all)."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    return string_match_all(postprocess_pred([prediction]), [outputs])


def load_set(folder: Path) -> dict[str, dict]:
    runs = load_results(folder)
    return {name: runs[name] for name in ORDER if name in runs} | {n: r for n, r in runs.items() if n not in ORDER}


def common_samples(runs: dict[str, dict]) -> list[tuple[str, int]]:
    """(task, index) of the samples every config answered, in the first config's order."""
    keys = None
    for data in runs.values():
        have = [(r["task"], r["index"]) for r in data["results"]]
        keys = have if keys is None else [k for k in keys if k in set(have)]
    return keys or []


def outputs_of(samples_file: Path) -> dict[tuple[str, int], list[str]]:
    import json

    out = {}
    for line in samples_file.read_text().splitlines():
        if line.strip():
            sample = json.loads(line)
            out[(sample["task"], sample["index"])] = sample["outputs"]
    return out


def dense_of(result: dict, per_token: int) -> int:
    """The bytes the dense model's own cache holds at the sample's context (`native_bytes`: a sliding
    layer holds its window; files without it: every layer the whole context)."""
    return result.get("native_bytes", result["context_tokens"] * per_token)


def rows(runs: dict[str, dict], memory: dict[str, dict], expected: dict) -> tuple[list[dict], list[str], list[str]]:
    """One row per config, the tasks, and the tasks the mean counts (dense at or above MIN_DENSE)."""
    keys = common_samples(runs)
    tasks = list(dict.fromkeys(task for task, _ in keys))
    table = []
    for name, data in runs.items():
        results = {(r["task"], r["index"]): r for r in data["results"]}
        chosen = [results[k] for k in keys]
        per_token = data["dense_bytes_per_token"]
        dense_bytes = statistics.fmean(dense_of(r, per_token) for r in chosen)
        claimed = statistics.fmean((1 - r["compression_ratio"]) * r["context_tokens"] * per_token for r in chosen)
        if name.startswith("dense"):  # dense claims nothing: what its cache holds
            claimed = statistics.fmean(r["held_bytes"] for r in chosen)
        held = statistics.fmean(r["held_bytes"] for r in chosen)
        by_task = {t: statistics.fmean(score(t, r["prediction"], expected[(t, r["index"])])
                                       for r in chosen if r["task"] == t) for t in tasks}
        press = data["press"]
        family = press.rsplit("_", 1)[0] if press.startswith("ours") else press
        mem = memory.get(name)
        table.append({"name": name, "method": name, "kept": data.get("kept"), "family": family,
                      "claimed": claimed, "claimed_share": claimed / dense_bytes, "held": held,
                      "held_share": held / dense_bytes, "tasks": by_task,
                      "simulated": family in SIMULATED, "samples": len(chosen),
                      "peak_mib": mem["ru_maxrss_kib"] / 1024 if mem else None,
                      "load_mib": mem["rss_after_load_kib"] / 1024 if mem else None,
                      "versions": data["versions"]})
    dense = next(row for row in table if row["name"] == "dense")
    counted = [t for t in tasks if dense["tasks"][t] >= MIN_DENSE]
    for row in table:
        row["mean"] = statistics.fmean(row["tasks"][t] for t in counted) if counted else None
        row["of_dense"] = row["mean"] / dense["mean"] if counted and dense["mean"] else None
    return table, tasks, counted


def budget_of(row: dict) -> float | None:
    """The budget a row belongs to: the kept share it was run at (ours: the layout's measured share)."""
    kept = row["kept"]
    if kept is None or row["name"].startswith("dense"):
        return None
    return min(BUDGETS, key=lambda b: abs(b - kept))


def targets(table: list[dict]) -> list[str]:
    """The issue's comparison target, hit or miss: at each budget, ours ahead of every press."""
    lines = []
    for budget in BUDGETS:
        ours = [r for r in table if r["name"].startswith("ours") and budget_of(r) == budget]
        presses = [r for r in table if not r["name"].startswith(("ours", "dense")) and budget_of(r) == budget]
        if not ours:
            lines.append(f"- {1 - budget:.0%} removed: no headprune layout measured on this model "
                         f"({len(presses)} presses measured): **not measured**")
        for mine in ours:
            behind = [r["name"] for r in presses if r["mean"] is not None and mine["mean"] is not None
                      and r["mean"] >= mine["mean"]]
            verdict = "hit" if not behind and presses else ("miss" if behind else "no press measured")
            lines.append(f"- {1 - budget:.0%} removed: {mine['name']} ({number(mine['mean'], '.3f')} RULER mean, "
                         f"{number(mine['held_share'], '.4f')} of dense's bytes held) ahead of every press "
                         f"({len(presses)} measured): **{verdict}**" + (f" (not ahead of: {', '.join(behind)})" if behind else ""))
    return lines


def native_check(runs: dict[str, dict]) -> list[str]:
    """Where dense runs in the model's own cache (`native_bytes`): its measured bytes against the
    price, and its answers against the full cache's (dense_full_cache), on the samples both answered."""
    dense, full = runs.get("dense"), runs.get("dense_full_cache")
    if dense is None or full is None or "native_bytes" not in dense["results"][0]:
        return []
    a = {(r["task"], r["index"]): r for r in dense["results"]}
    b = {(r["task"], r["index"]): r for r in full["results"]}
    keys = [k for k in a if k in b]
    priced = sum(a[k]["held_bytes"] == a[k]["native_bytes"] for k in keys)
    same = sum(a[k]["generated_ids"] == b[k]["generated_ids"] for k in keys)
    return [f"- dense's cache held exactly its price (sliding layers 511 tokens, global ones the context) on "
            f"{priced} of {len(keys)} samples; dense in the model's own cache and in kvpress's default cache "
            f"(dense_full_cache): the same greedy answer token for token on {same} of {len(keys)}"]


def dense_check(runs: dict[str, dict]) -> list[str]:
    """Dense under kvpress's transformers against dense under headprune's, on the samples both answered."""
    if "dense" not in runs or "dense_transformers5" not in runs:
        return ["- dense under both transformers versions: not both measured"] + native_check(runs)
    a = {(r["task"], r["index"]): r for r in runs["dense"]["results"]}
    b = {(r["task"], r["index"]): r for r in runs["dense_transformers5"]["results"]}
    keys = [k for k in a if k in b]
    same_answer = sum(a[k]["generated_ids"] == b[k]["generated_ids"] for k in keys)
    same_first = sum(a[k]["first_token_top5"]["ids"][0] == b[k]["first_token_top5"]["ids"][0] for k in keys)
    gap = max(abs(x - y) for k in keys for x, y in zip(a[k]["first_token_top5"]["logits"], b[k]["first_token_top5"]["logits"])
              if a[k]["first_token_top5"]["ids"] == b[k]["first_token_top5"]["ids"]) if keys else None
    va, vb = runs["dense"]["versions"]["transformers"], runs["dense_transformers5"]["versions"]["transformers"]
    return [f"- dense in kvpress's venv (transformers {va}) against dense in headprune's (transformers {vb}), "
            f"{len(keys)} samples: the same greedy answer token for token on {same_answer}, the same first answer token "
            f"on {same_first}; largest gap between the first answer token's top-5 logits (where both rank the same 5 "
            f"tokens; the raw files keep them to 5 decimals): {number(gap, '.2e')}"] + native_check(runs)


def table_lines(runs: dict[str, dict], memory: dict, expected: dict, samples: Path, with_targets: bool) -> list[str]:
    """The table of `runs` on the samples all of them answered, and with `with_targets` the targets
    and the dense check."""
    table, tasks, counted = rows(runs, memory, expected)
    cols = [text("config", "method"), column("kept", "kept", ".3f"),
            column("claimed MB", "claimed", ".1f", scale=1e-6), column("claimed share", "claimed_share", ".3f"),
            column("held MB", "held", ".1f", scale=1e-6), column("held share", "held_share", ".3f"),
            text("simulated", lambda r: "yes" if r["simulated"] else ""),
            *[column(t, (lambda r, t=t: r["tasks"][t]), ".2f") for t in tasks],
            column("mean", "mean", ".3f", bold=True), column("of dense", "of_dense", ".2f"),
            column("peak RSS MiB", "peak_mib", ".0f"), column("RSS after load MiB", "load_mib", ".0f"),
            column("samples", "samples", "d")]
    lines = [f"Samples: `{samples}`, {table[0]['samples']} answered by every row ({', '.join(tasks)}); "
             f"the mean counts {', '.join(counted) or 'no task'}.", ""]
    lines += markdown(cols, table)
    left = [t for t in tasks if t not in counted]
    if left:
        lines += ["", f"Left out of the mean (dense below {MIN_DENSE:.0%}): {', '.join(left)}."]
    if with_targets:
        lines += ["", "Targets (issue 53):", "", *targets(table), "", "Checks:", "", *dense_check(runs),
                  *shared_check(runs, memory)]
    return lines + [""]


def shared_check(runs: dict[str, dict], memory: dict[str, dict]) -> list[str]:
    """Each config run alone (the memory runs: `with press(model)`, its own prefill) against the same
    config in the shared-prefill run, on the samples both answered: the same greedy answer?"""
    lines = []
    for name, alone in memory.items():
        shared = runs.get(name)
        if shared is None:
            continue
        mine = {(r["task"], r["index"]): r for r in shared["results"]}
        pairs = [(r, mine[(r["task"], r["index"])]) for r in alone["results"] if (r["task"], r["index"]) in mine]
        same = sum(a["generated_ids"] == b["generated_ids"] for a, b in pairs)
        lines.append(f"{name} {same}/{len(pairs)}")
    if not lines:
        return []
    return ["- each config run alone in its own process (raw/<set>_memory/) against its row here, the same greedy "
            "answer token for token on: " + ", ".join(lines)]


def render(directory: Path = HERE) -> dict[str, str]:
    lines = ["# kvpress beside headprune's KV layouts: RULER score against KV bytes held", "",
             "Generated by `python experiments/peers_kvpress/collect.py` from `raw/` (README.md says how each file",
             "was written). Score: lm-eval 0.4.13's RULER metric (string_match_all) on the samples every row answered.",
             "Kept: the share of the context's KV entries a press was asked to keep (dense 1); ours: the share of",
             "dense's bytes its cache held, measured over the samples (its windows are 64 + 448 tokens whatever",
             "the context, priced at 4096 tokens; these contexts are ~3,800 tokens, so the same layout holds more).",
             "Claimed: the bytes of the context's KV cache a method says it keeps ((1 - compression_ratio) x the",
             "dense bytes; ours: what its cache holds); held: the bytes the key/value tensors of the cache hold after",
             "the prefill, measured; both a mean per sample and a share of dense. Simulated: the press keeps every",
             "entry and masks the removed ones at attention time (kvpress/attention_patch.py), so held = dense.",
             f"Mean: over the tasks the dense model scores at least {MIN_DENSE:.0%} on. Peak RSS: the process's peak",
             "resident set (Linux getrusage ru_maxrss) of the config run alone on one sample (raw/<set>_memory/),",
             "with the RSS after loading the model beside it.", ""]
    for name, title in SETS.items():
        folder = directory / "raw" / name
        if not folder.is_dir():
            continue
        runs = load_set(folder)
        if not runs:
            continue
        memory_dir = directory / "raw" / f"{name}_memory"
        memory = load_results(memory_dir) if memory_dir.is_dir() else {}
        samples_file = directory / Path(next(iter(runs.values()))["samples_file"]).relative_to("experiments/peers_kvpress")
        expected = outputs_of(samples_file)
        lines += [f"## {title}", "", *NOTES.get(name, [])]
        lines += table_lines(runs, memory, expected, samples_file.relative_to(directory), with_targets=True)
        extra_dir = directory / "raw" / f"{name}_kvzip"
        if extra_dir.is_dir():
            extra = load_set(extra_dir)
            lines += [f"### Beside KVzip, on the samples it answered ({', '.join(extra)}: each its own process, "
                      "three forward passes a sample)", ""]
            lines += table_lines(runs | extra, memory, expected, samples_file.relative_to(directory), with_targets=False)
    return {"results.md": "\n".join(lines).rstrip("\n") + "\n"}


def main() -> None:
    files = render(HERE)
    write(HERE, files)
    print(files["results.md"])


if __name__ == "__main__":
    main()
