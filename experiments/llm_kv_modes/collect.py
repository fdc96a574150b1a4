"""Tables of experiments/llm_kv_modes from its raw files: results/<arm>.json, copies of the runs'
results.json (with the run's wall.json under `wall`), and results/dense.json.

    python experiments/llm_kv_modes/collect.py --runs ../llmruns/llm_kv_modes   # copy finished runs, then render
    python experiments/llm_kv_modes/collect.py                                   # render from results/

writes results.md: the dense model, then one row per arm (units full / windowed / removed, the KV
bytes kept at 4096 as a share of dense (results.json final.cost_share), perplexity at seq 4096 on
held-out Tiny Shakespeare and SST-2's sentences against the dense model, the SST-2 change over the
Tiny Shakespeare change, passkey accuracy at 4096 tokens overall and by depth, the seconds the
choice took), and the issue's targets, hit or miss; answers.md (the chat answers); the decode tables (decode.json, decode_h200.json); the
arms run again on a GPU (results_h200/<arm>.json) beside their CPU runs; and the three models of issue 53
(SmolLM2 from results/, Gemma-3-270M and Qwen2.5-Coder-1.5B from results/<model>/<arm>.json: the default chooser
and the training-free kv_modes=retrieval at 2/3 and 85% removed, with RULER); built with headprune.report (`render`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from headprune.report import DASH, Column, gather, load_results, markdown, number, read_json, script, text, write

HERE = Path(__file__).resolve().parent
ARMS = ["removal", "removal_refit", "attention_mass", "attention_mass_last", "measured", "measured_self",
        "measured_retrieval", "measured_retrieval_clamped", "measured_retrieval_clamped_last", "measured_retrieval_last",
        "measured_retrieval_clamped_kl", "measured_kl", "retrieval", "retrieval_uniform", "retrieval_uniform_self",
        "retrieval_uniform_kl", "retrieval_uniform_kl_self", "attention_mass_85", "attention_mass_85_last",
        "retrieval_85", "retrieval_85_kl", "retrieval_85_w192", "measured_retrieval_clamped_85",
        "measured_retrieval_clamped_85_last", "attention_mass_33_last", "retrieval_33", "retrieval_33_kl"]
ARMS_2048 = ["retrieval_2048", "retrieval_2048_kl", "retrieval_33_2048"]  # a 2048-token context; dense: retrieval_2048's evaluation.dense
ARMS_8192 = ["measured_retrieval_8192"]  # SmolLM2's 8192-token context; dense: its own evaluation.dense
# the targets without training, by the share of the KV bytes kept: (ppl rise %, passkey share of dense's)
TARGETS = {0.67: (1.0, None), 0.34: (3.0, 0.9), 0.15: (8.0, 0.8)}  # None: the issue sets none
RULER_TARGETS = {0.34: 0.95, 0.15: 0.85}  # issue 53: the RULER mean's share of dense's, by the KV share kept
# issue 53's models: (preset, name, folder of its raw files under results/ ("": results/ itself), {arm: its role})
MODELS = [
    ("smollm2", "SmolLM2-135M-Instruct", "", {
        "measured_retrieval_clamped_last": "default chooser (kv_modes=given: the layout measured_retrieval_last chose)",
        "measured_retrieval_clamped_85_last": "default chooser (kv_modes=given: the same rises at 0.15, clamped_layout.py)",
        "retrieval_uniform": "training-free kv_modes=retrieval", "retrieval_85": "training-free kv_modes=retrieval"}),
    ("gemma3_270m", "Gemma-3-270M (base)", "gemma3_270m", {
        "measured_retrieval_last": "default chooser", "measured_retrieval_85_last": "default chooser",
        "retrieval_uniform": "training-free kv_modes=retrieval", "retrieval_85": "training-free kv_modes=retrieval"}),
    ("qwen25_coder_1p5b", "Qwen2.5-Coder-1.5B-Instruct", "qwen25_coder_1p5b", {
        "measured_retrieval_last": "default chooser", "measured_retrieval_85_last": "default chooser",
        "retrieval_uniform": "training-free kv_modes=retrieval", "retrieval_85": "training-free kv_modes=retrieval"}),
]
DENSE_ARM = "retrieval_uniform"  # the arm of each model run with evaluation.dense=true (its dense row)


def ppl(block: dict, corpus: str, seq: int = 4096) -> float:
    return (block["perplexity"] if corpus == "tinyshakespeare" else block["perplexity_other"][corpus])[f"seq{seq}"]["ppl"]


def units_per_layer(runs: dict[str, dict]) -> int:
    """KV units a layer has, from any arm's kept layout (removal-only runs record kept counts only)."""
    for data in runs.values():
        layout = data["final"].get("kv_layout")
        if layout is not None:
            return len(layout["modes"][0])
    raise ValueError("no arm holds final.kv_layout: the units per layer are unknown")


def modes_count(data: dict, units: int) -> tuple[int, int, int]:
    """(full, windowed, removed) units of the kept layout (removal only: no windows)."""
    layout = data["final"].get("kv_layout")
    if layout is not None:
        flat = [m for layer in layout["modes"] for m in layer]
        return flat.count("full"), flat.count("window"), flat.count("removed")
    kept = data["rounds"][0]["budget"]["kept_units_per_layer"]
    return sum(kept), 0, len(kept) * units - sum(kept)


def depths(passkey: dict) -> str:
    return " / ".join(f"{float(v):.1f}" for v in passkey["by_depth"].values())


def choice_seconds(data: dict) -> float | None:
    kv = data["rounds"][0]["budget"].get("kv_modes")
    return kv["seconds"] if kv else None


def rows(runs: dict[str, dict], dense: dict, seq: int = 4096) -> list[dict]:
    units = units_per_layer(runs)
    out = []
    for arm, data in runs.items():
        pruned = data["evaluation"]["pruned"]
        ts, sst = ppl(pruned, "tinyshakespeare", seq), ppl(pruned, "sst2", seq)
        ts_change = 100.0 * (ts / ppl(dense, "tinyshakespeare", seq) - 1.0)
        sst_change = 100.0 * (sst / ppl(dense, "sst2", seq) - 1.0)
        out.append({"arm": arm, "modes": modes_count(data, units), "share": data["final"]["cost_share"], "ts": ts,
                    "ts_change": ts_change, "sst": sst, "sst_change": sst_change,
                    "ratio": sst_change / ts_change if ts_change > 0 else None, "passkey": pruned["passkey"],
                    "seconds": choice_seconds(data), "target": data["budget"]["target"], "wall": data.get("wall", {}),
                    "kl_steps": data["rounds"][0].get("distill", {}).get("steps"),
                    "calibration": data.get("calibration", {}).get("source", "corpus"),
                    "device": device(data.get("runtime"))})
    return out


def device(runtime: dict | None) -> str:
    """Where the run computed: the GPU's name, or CPU (runs before results.json recorded `runtime`: CPU)."""
    if runtime and str(runtime.get("device", "")).startswith("cuda"):
        return str(runtime.get("device_name") or runtime["device"])
    return "CPU"


def with_change(value: str, base: str):
    return lambda r: f"{r[value]:.2f} ({r[base]:+.1f}%)"


ARM_COLUMNS = [
    text("arm"), text("full / window / removed", lambda r: " / ".join(map(str, r["modes"]))),
    Column("KV share", lambda r: number(r["share"], ".4f"), True),
    Column("Tiny Shakespeare ppl", with_change("ts", "ts_change"), True),
    Column("SST-2 ppl", with_change("sst", "sst_change"), True),
    Column("SST-2 / TS change", lambda r: number(r["ratio"]), True),
    Column("passkey", lambda r: number(r["passkey"]["accuracy"]), True),
    text("by depth 0 / .25 / .5 / .75 / 1", lambda r: depths(r["passkey"])),
    Column("choice s", lambda r: number(r["seconds"], ".0f"), True),
    Column("KL steps", lambda r: str(r["kl_steps"]) if r.get("kl_steps") else DASH, True),
    text("calibration", lambda r: r.get("calibration") or DASH),
    text("device", lambda r: r.get("device") or DASH),
]


def target_columns(dense_key: float) -> list[Column]:
    def hit(ok: bool) -> str:
        return "hit" if ok else "miss"

    def rise(r):
        return TARGETS[r["target"]][0]

    def retrieval(r):
        return TARGETS[r["target"]][1]

    def passkey_target(r) -> str:
        if retrieval(r) is None:
            return f"{DASH} ({r['passkey']['accuracy']:.2f}; no target)"
        return (f"{hit(r['passkey']['accuracy'] >= retrieval(r) * dense_key)} ({r['passkey']['accuracy']:.2f} vs "
                f"{retrieval(r):g} x {dense_key:.2f})")

    return [
        text("arm"), text("KV kept", "target", right=True),
        text("ppl in domain", lambda r: f"{hit(r['ts_change'] <= rise(r))} ({r['ts_change']:+.1f}% vs +{rise(r):g}%)"),
        text("ppl out of domain", lambda r: f"{hit(r['sst_change'] <= rise(r))} ({r['sst_change']:+.1f}%)"),
        text("passkey vs dense", passkey_target),
        text("SST-2 change within 1.5x", lambda r: hit(abs(r["sst_change"]) <= 1.5 * abs(r["ts_change"]))),
    ]


def conditions(r: dict) -> str:
    wall = r["wall"]
    if not wall:
        return (f"- {r['arm']}: no wall.json (the run's process was ended by the out-of-memory killer during the "
                "export's evaluation; that stage ran in evaluate_export.py, README.md), 1 torch thread")
    resumed = f"; the last process only, {wall['resumed']}" if wall.get("resumed") else ""
    return (f"- {r['arm']}: {r['device']}, wall {wall['wall_seconds']} s, {wall['threads']} torch thread(s), load average "
            f"at the end {wall['load_average_end']}{resumed}")


def dense_row(runs: dict[str, dict], dense: dict, seq: int = 4096, runtime: dict | None = None) -> dict:
    """The dense model's row (`runtime`: the results.json block of the run that evaluated it)."""
    return {"arm": "dense", "modes": (units_per_layer(runs) * len(dense_layers(runs)), 0, 0), "share": 1.0,
            "ts": ppl(dense, "tinyshakespeare", seq), "ts_change": 0.0, "sst": ppl(dense, "sst2", seq), "sst_change": 0.0,
            "ratio": None, "passkey": dense["passkey"], "seconds": None, "kl_steps": None, "device": device(runtime)}


def targets_heading(seq: int) -> str:
    return (f"## Targets of issue 40 (no training) at {seq}: 2/3 of the KV bytes removed (KV kept 0.34): <= +3% "
            "perplexity in domain and out, passkey >= 90% of dense's; 85% removed (0.15): <= +8%, >= 80%; 1/3 removed "
            "(0.67): <= +1%; every arm: the SST-2 change within 1.5x of the in-domain change")


ONNX_DECODE_COLUMNS = [
    text("model"), Column("context", lambda r: str(r["context"]), True),
    Column("ms / token", lambda r: number(r["per_token_ms"], ".1f"), True),
    Column("speed-up", lambda r: number(r["speedup"]), True),
    Column("past bytes", lambda r: f"{r['held_bytes']:,}", True),
    Column("past / dense", lambda r: number(r["held_share"], ".4f"), True),
    Column("threads", lambda r: str(r["threads"]), True),
    Column("load (1 min)", lambda r: number(r["load_average_end"][0], ".1f"), True),
]

DECODE_COLUMNS = [
    text("model"), Column("context", lambda r: str(r["context"]), True),
    Column("ms / token", lambda r: number(r["per_token_ms"], ".1f"), True),
    Column("speed-up", lambda r: number(r["speedup"]), True), Column("bound", lambda r: number(r["bound"]), True),
    Column("speed-up / bound", lambda r: number(r["ratio_to_bound"]), True),
    Column("target (within 10%)", lambda r: "hit" if r["model"] == "dense" or r["ratio_to_bound"] >= 0.9 else "miss",
           True),
    Column("cache held / dense", lambda r: number(r["held_share"], ".4f"), True),
    Column("threads", lambda r: str(r["threads"]), True),
    Column("load (1 min)", lambda r: number(r["load_average_end"][0], ".1f"), True),
]


def render(directory: Path = HERE) -> dict[str, str]:
    runs = load_results(directory / "results", ARMS)
    dense_run = read_json(directory / "results" / "dense.json")
    dense = dense_run["evaluation"]["dense"]
    table = rows(runs, dense)
    dense_key = dense["passkey"]["accuracy"]
    lines = ["# Per-unit KV modes at a 4096-token context (SmolLM2-135M-Instruct, no training unless KL steps say)", "",
             "Generated by `python experiments/llm_kv_modes/collect.py` from `results/<arm>.json` (copies of the",
             "runs' results.json; `bash experiments/llm_kv_modes/run.sh one <arm> false`; README.md says how each ran).",
             "Perplexity at seq 4096 over the first 8,192 held-out tokens (2 windows, BOS first) of Tiny Shakespeare",
             "and of SST-2's validation sentences (dense: change +0.0%); passkey: 5 depths x 2 keys at 4096 tokens,",
             "teacher-forced. Modes: KV groups full / windowed (64 sink + 448 recent tokens; `_w192`: 64 + 192) / removed; KV share:",
             "results.json `final.cost_share` (bytes at batch 1 x seq 4096 as a share of dense). Choice s: seconds",
             "the mode choice took (measurement and knapsack). `_last`: kv_modes.removal=last (no unit removed while",
             "every unit windowed fits the budget; the retrieval arms too). KL steps: optimizer steps of the KL to the",
             "dense model after the choice, with the windows on (one 4096-token block a step; the targets are for no",
             "training); `measured_kl` and the other `_kl` arms train the layout of the arm they name (kv_modes=given,",
             "read from its raw file here), so their choice s is only the layout's check. Calibration: the block the",
             "choice measured on (corpus: Tiny Shakespeare's training part; self: sampled from the dense model).", "",
             *markdown(ARM_COLUMNS, [dense_row(runs, dense, runtime=dense_run.get("runtime")), *table]),
             "", targets_heading(4096), "",
             *markdown(target_columns(dense_key), table)]
    lines += ruler_section(runs, dense)
    section, model_runs = models_section(directory)
    lines += section
    other_runs, other_rows = {}, []
    for seq, arms, kept in ((2048, ARMS_2048, "512 of 2048 tokens"), (8192, ARMS_8192, "512 of 8192 tokens")):
        section, runs_seq, table_seq = context_section(directory, seq, arms, kept)
        lines += section
        other_runs.update(runs_seq)
        other_rows += table_seq
    decode_file = directory / "decode.json"
    if decode_file.is_file():
        lines += ["", "## Decode speed in PyTorch", "",
                  "From `decode.json` (`python experiments/llm_kv_modes/decode.py <exports> --contexts <n>`): median ms",
                  "per greedy token (batch 1) after a prompt of context - new tokens, interleaved with the dense model;",
                  "bound: Amdahl with the dense decode's attention share and the export's attention FLOPs (windowed",
                  "units over sink + window keys); cache held: bytes after the prefill against dense's.", "",
                  *markdown(DECODE_COLUMNS, read_json(decode_file))]
    decode_h200 = directory / "decode_h200.json"
    if decode_h200.is_file():
        lines += ["", "## Decode speed in PyTorch on an NVIDIA H200", "",
                  "From `decode_h200.json` (`decode.py <exports> --contexts 4096 8192 --repeats 5 --device cuda`, the",
                  "exports of the arms run on the GPU, README.md): the same protocol, float32, timed with CUDA events.", "",
                  *markdown(DECODE_COLUMNS, read_json(decode_h200))]
    onnx_decode = directory / "onnx_decode.json"
    if onnx_decode.is_file():
        lines += ["", "## Decode speed in ONNX Runtime", "",
                  "From `onnx_decode.json` (`python experiments/llm_kv_modes/onnx_decode_speed.py <exports> --graphs <dir>`):",
                  "the decode graphs (`headprune-export --onnx-decode`; windowed units' keys in rings of sink + window",
                  "entries), a prompt of context - new tokens prefilled 512 a call, then median ms per greedy token",
                  "(batch 1), interleaved with the dense model's graph; past: the bytes of the graph's past after the",
                  "prefill against dense's.", "",
                  *markdown(ONNX_DECODE_COLUMNS, read_json(onnx_decode))]
    lines += same_arm_on_both(directory)
    lines += ["", "## Conditions", "",
              "Device: CPU rows ran on this project's 2-core machine, one arm per torch thread or two; H200 rows ran",
              "on a lent GPU, the arms side by side (`gpu.sh`), so their wall and choice seconds are not comparable.", "",
              *map(conditions, table + other_rows)]
    return {"results.md": "\n".join(lines) + "\n", "answers.md": answers(dense, {**runs, **other_runs})}


def models_section(directory: Path) -> tuple[list[str], dict[str, dict]]:
    """(the lines, {model/arm: run}) of issue 53's three models: per model the dense row (its
    DENSE_ARM run's evaluation.dense) and each arm of MODELS that finished, with perplexity in domain
    and on SST-2, passkey and the RULER mean over the tasks where dense scores >= 20%, each against
    dense, and the targets hit or miss; a model none of whose arms finished is listed as not run."""
    from headprune.evaluation.ruler import floor_means

    out, missing, all_runs = [], [], {}
    for preset, name, folder, arms in MODELS:
        runs = load_results(directory / "results" / folder, list(arms))
        if DENSE_ARM not in runs or "dense" not in runs[DENSE_ARM]["evaluation"]:
            missing.append(f"{name} (`model={preset}`)")
            continue
        dense = runs[DENSE_ARM]["evaluation"]["dense"]
        if set(arms) - set(runs):
            missing.append(f"{name}'s " + ", ".join(a for a in arms if a not in runs))
        for arm, data in runs.items():
            pruned = data["evaluation"]["pruned"]
            ruler = floor_means(pruned["ruler"], dense["ruler"])["mean_dense_at_least_20"]["4096"] \
                if "ruler" in pruned and "ruler" in dense else None
            all_runs[f"{preset}/{arm}"] = data
            modes = [m for layer in data["final"]["kv_layout"]["modes"] for m in layer]
            out.append({"model": name, "arm": arm, "chooser": arms[arm], "target": data["budget"]["target"],
                        "units": " / ".join(str(modes.count(m)) for m in ("full", "window", "removed")),
                        "share": data["final"]["cost_share"],
                        "ts": 100.0 * (ppl(pruned, "tinyshakespeare") / ppl(dense, "tinyshakespeare") - 1.0),
                        "sst": 100.0 * (ppl(pruned, "sst2") / ppl(dense, "sst2") - 1.0),
                        "passkey": (pruned["passkey"]["accuracy"], dense["passkey"]["accuracy"])
                        if "passkey" in pruned and "passkey" in dense else None,
                        "ruler": (ruler, floor_means(dense["ruler"], dense["ruler"])["mean_dense_at_least_20"]["4096"]
                                  if "ruler" in dense else None),
                        "native": len(data.get("budget", {}).get("native_windows", {}))})
    if not out:
        return [], {}

    def hit(ok: bool) -> str:
        return "hit" if ok else "miss"

    def ppl_target(key: str):
        return lambda r: f"{r[key]:+.1f}% {hit(r[key] <= TARGETS[r['target']][0])}"

    def passkey(r) -> str:
        if r["passkey"] is None:  # not evaluated (a model whose full protocol did not fit the time)
            return DASH
        got, base = r["passkey"]
        need = TARGETS[r["target"]][1]
        return f"{got:.2f} / {base:.2f}" + ("" if need is None else f" {hit(got >= need * base)}")

    def ruler(r) -> str:
        got, base = r["ruler"]
        if got is None or not base:
            return DASH
        return f"{got:.3f} / {base:.3f} ({got / base:.0%}) {hit(got >= RULER_TARGETS[r['target']] * base)}"

    columns = [text("model"), text("arm"), text("chooser"), text("KV kept", "target", right=True),
               text("full / window / removed", "units", right=True), Column("KV share", lambda r: number(r["share"], ".4f"), True),
               text("Tiny Shakespeare ppl vs dense", ppl_target("ts"), right=True),
               text("SST-2 ppl vs dense", ppl_target("sst"), right=True),
               text("passkey / dense", passkey, right=True), text("RULER mean / dense (share)", ruler, right=True)]
    lines = ["", "## Three models at 4096 (issue 53)", "",
             "Each model's arms from `results/<model>/<arm>.json` (SmolLM2's from `results/<arm>.json`), its dense row",
             f"the `{DENSE_ARM}` run's `evaluation.dense`. Perplexity at seq 4096 (Tiny Shakespeare held out, SST-2's",
             "sentences), passkey at 4096 (10 samples), RULER at 4096 (`evaluation.ruler_samples` seeded samples per",
             "task, the 11 offline tasks; mean over the tasks where dense scores >= 20%). KV share: bytes held at",
             "4096 over dense's, a natively sliding layer (Gemma 3: 15 of 18) priced at the 512 tokens it holds.",
             "Targets (issue 53, no training): at 2/3 removed (0.34) <= +3% perplexity in domain and on SST-2, passkey",
             ">= 90% of dense, RULER mean >= 95% of dense; at 85% removed (0.15) <= +8%, passkey >= 80% (issue 40),",
             "RULER >= 85%. A dash: not evaluated by that run (Qwen2.5-Coder-1.5B: passkey left out,",
             "`evaluation.passkey_lengths=[]`, to fit the session on 2 cores).", "", *markdown(columns, out)]
    if missing:
        lines += ["", "Not run yet: " + ", ".join(missing) + "."]
    return lines + removal_probe_section(directory / "results" / "gemma3_270m" / "removal_probe.json"), all_runs


def removal_probe_section(path: Path) -> list[str]:
    """The table of gemma_removal.py's raw file (Gemma-3-270M's perplexity with chosen layers removed)."""
    if not path.is_file():
        return []
    data = read_json(path)
    dense = data["layouts"]["dense"]["perplexity"]["ppl"]
    rows = [{"layout": name, **row} for name, row in data["layouts"].items()]
    columns = [text("layout"), text("removed layers", lambda r: ", ".join(map(str, r["removed_layers"])) or DASH),
               text("windowed", lambda r: ", ".join(map(str, r.get("windowed_layers", []))) or DASH),
               Column("KV share", lambda r: number(r["kv_share"], ".4f"), True),
               Column("Tiny Shakespeare ppl", lambda r: f"{r['perplexity']['ppl']:,.2f}", True),
               Column("vs dense", lambda r: f"{100 * (r['perplexity']['ppl'] / dense - 1):+,.1f}%", True), text("why")]
    return ["", "### Gemma-3-270M: which removed layers break it", "",
            "From `results/gemma3_270m/removal_probe.json` (`python experiments/llm_kv_modes/gemma_removal.py`, commit",
            f"{data['commit']}, {data['threads']} thread, load {data['load_average_end'][0]:.1f}): perplexity at seq "
            f"{data['seq']} on the first {data['tokens']:,} held-out",
            "Tiny Shakespeare tokens with the listed layers' only KV unit (their attention) removed, or windowed (64 +",
            "448 tokens). Its layers 5, 11 and 17 attend to every token; the 15 others slide a 512-token window and can",
            "only be kept or removed. KV share: bytes held at 4096 over dense's, as the budget prices them.", "",
            *markdown(columns, rows)]


def ruler_section(runs: dict[str, dict], dense: dict, context: str = "4096") -> list[str]:
    """The RULER table (headprune.evaluation.ruler.table) of the dense model and each arm's export that
    scored it, and issue 53's targets (the RULER mean over the tasks where dense scores >= 20%, as a
    share of dense's), hit or miss; no lines when no arm scored RULER."""
    from headprune.evaluation.ruler import floor_means, table

    scored = {arm: data["evaluation"]["pruned"]["ruler"] for arm, data in runs.items()
              if "ruler" in data["evaluation"]["pruned"]}
    if not scored:
        return []
    base = dense.get("ruler") or runs.get(DENSE_ARM, {}).get("evaluation", {}).get("dense", {}).get("ruler")
    lines = ["", "## RULER at 4096 (issue 53)", "",
             "lm-eval's RULER task code offline (headprune.evaluation.ruler): the settings each run's",
             "results.json names (`evaluation.settings.ruler_*`; essay variants on Tiny Shakespeare's training",
             "part), the same seeded samples for dense and every export, greedy, lm-eval's string_match_all; dense:",
             f"results/dense.json's RULER, else the `{DENSE_ARM}` run's evaluation.dense).", "",
             *table({"dense": base, **scored} if base else scored, base)]
    if base:
        dense_mean = floor_means(base, base)["mean_dense_at_least_20"].get(context)
        lines += ["", "Targets: RULER mean >= 95% of dense's at 2/3 of the KV bytes removed (KV kept 0.34), >= 85% at",
                  "85% removed (0.15).", ""]
        for arm, block in scored.items():
            target = RULER_TARGETS.get(runs[arm]["budget"]["target"])
            mean = floor_means(block, base)["mean_dense_at_least_20"].get(context)
            if target is None or mean is None or not dense_mean:
                continue
            lines.append(f"- {arm}: {'hit' if mean >= target * dense_mean else 'miss'} ({mean:.3f} vs {target:g} x "
                         f"{dense_mean:.3f})")
    return lines


def context_section(directory: Path, seq: int, arms: list[str], kept: str) -> tuple[list[str], dict, list[dict]]:
    """(the lines, the runs, the rows) of the arms run at another context than 4096; the dense row is
    the first arm's dense evaluation (empty when no arm of it has finished)."""
    runs = load_results(directory / "results", arms)
    if not runs:
        return [], {}, []
    if arms[0] not in runs:
        raise ValueError(f"results/{next(iter(runs))}.json is at {seq} tokens, but results/{arms[0]}.json, whose "
                         f"evaluation.dense is that context's dense row, is missing")
    dense = runs[arms[0]]["evaluation"]["dense"]
    table = rows(runs, dense, seq)
    lines = ["", f"## At a {seq}-token context", "",
             f"The same protocol at {seq} tokens (calibration, validation, perplexity windows and passkey prompts of",
             f"{seq} tokens; a windowed unit keeps {kept}); dense: the dense evaluation of the",
             f"{arms[0]} run.", "",
             *markdown(ARM_COLUMNS, [dense_row(runs, dense, seq, runs[arms[0]].get("runtime")), *table]),
             "", targets_heading(seq), "",
             *markdown(target_columns(dense["passkey"]["accuracy"]), table)]
    return lines, runs, table


def answers(dense: dict, runs: dict[str, dict]) -> str:
    """answers.md: the greedy chat answers (evaluation.generate: 32 new tokens) of the dense model and of
    each arm's export, one table per prompt, with experiments/llm_kv's `answers_table`."""
    prompts = [a["prompt"] for a in dense["generation"]]
    generations = {}
    for arm, data in runs.items():
        generation = data["evaluation"]["pruned"].get("generation") or []
        if generation and [a["prompt"] for a in generation] != prompts:
            raise ValueError(f"results/{arm}.json: its chat prompts are not the dense model's {prompts}")
        generations[arm] = generation
    table = script(HERE.parent / "llm_kv" / "collect.py").answers_table(dense, generations)
    return ("# Greedy chat answers (SmolLM2-135M-Instruct; generated by collect.py from results/*.json)\n\n"
            "The dense model (results/dense.json) and each arm's export as `load_pruned` loads it (its windows\n"
            "attached), greedy, 32 new tokens. A prompt and its answer fit inside sink + window (512 tokens), so a\n"
            "windowed unit sees all of them: without training only removed units change an answer (every arm\n"
            "without removed units answers as dense does); the KL arms' steps changed the weights too.\n\n" + table + "\n")


def same_arm_on_both(directory: Path) -> list[str]:
    """The section comparing each arm in results_h200/ (run again on the GPU, same config) with its
    CPU run in results/: the same layout or not, and the export's perplexities and passkey on each."""
    rows_out = []
    for file in sorted((directory / "results_h200").glob("*.json")):
        gpu, cpu = read_json(file), read_json(directory / "results" / file.name)
        same = gpu["final"].get("kv_layout") == cpu["final"].get("kv_layout")
        for name, data in (("CPU", cpu), (device(gpu.get("runtime")), gpu)):
            pruned = data["evaluation"]["pruned"]
            rows_out.append({"arm": file.stem, "device": name, "same": "yes" if same else "no",
                             "ts": ppl(pruned, "tinyshakespeare"), "sst": ppl(pruned, "sst2"),
                             "passkey": pruned["passkey"]["accuracy"]})
    if not rows_out:
        return []
    columns = [text("arm"), text("device"), text("same layout", "same"),
               Column("Tiny Shakespeare ppl", lambda r: number(r["ts"], ".6f"), True),
               Column("SST-2 ppl", lambda r: number(r["sst"], ".6f"), True),
               Column("passkey", lambda r: number(r["passkey"]), True)]
    return ["", "## The same arm on the CPU and on the H200", "",
            "`results_h200/<arm>.json`: the arm run again on the GPU (`gpu.sh`, same config, float32) beside its",
            "CPU run in `results/`: whether the choice picked the same layout, and the export's evaluation on each.", "",
            *markdown(columns, rows_out)]


def dense_layers(runs: dict[str, dict]) -> list:
    """One entry per layer of the model (any arm's heads kept per layer)."""
    return next(iter(runs.values()))["final"]["heads_per_layer"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, help="run dirs to copy finished arms from (../llmruns/llm_kv_modes)")
    args = parser.parse_args()
    if args.runs is not None:
        finished = gather(args.runs, HERE / "results", lambda data: "pruned" in data.get("evaluation", {}),
                          ARMS + ARMS_2048 + ARMS_8192)
        print("copied:", finished)
        for preset, _, folder, arms in MODELS:
            copied = gather(args.runs / preset, HERE / "results" / folder, lambda data: "pruned" in data.get("evaluation", {}),
                            list(arms))
            print(f"copied ({preset}):", copied)
    files = render(HERE)
    write(HERE, files)
    print(files["results.md"])


if __name__ == "__main__":
    main()
