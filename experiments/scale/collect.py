"""README.md's generated blocks from bench.json: the measured table (seconds and peak resident
memory per stage and model), the conditions, and the projection to Llama-3.1-8B and -70B derived
from the measured peaks per model byte. Every number in those blocks comes from bench.json or
from the constants below (the target models' configs, the bytes per parameter of each assumption).

    python experiments/scale/collect.py           # rewrite README.md's generated blocks
    python experiments/scale/collect.py --check   # exit 1 when README.md is not what bench.json gives

Projection (assumptions, stated in the README too):
- bf16 weights (2 bytes a parameter) on 80 GiB GPUs;
- a stage that trains nothing holds `copies` whole models in bf16 (the refit two: the dense copy
  and the pruned model), which FSDP could shard; the KL steps hold bf16 weights (2 bytes a
  parameter) + bf16 gradients (2) + AdamW's two moments in fp32 (8) = 12, + 2 for a live bf16
  teacher (0 cached), all shardable, no fp32 master copy of the weights;
- the rest of a stage's measured peak (at the largest model it ran on: its net peak minus those
  copies, or minus the KL's float32 state of 5 model bytes: weights, gradients, two moments,
  live teacher) is activations, buffers and solver work space, kept on every GPU: scaled by
  the target's layers x hidden over the measured model's (activations of a fixed number of
  tokens grow so) and halved for bf16; logits grow with the vocabulary instead (not modelled);
- FSDP (full sharding): N = ceil(shardable / (80 GiB - per-GPU rest)).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from headprune.report import column, markdown, text

HERE = Path(__file__).resolve().parent
GIB = 2 ** 30
MIB = 2 ** 20
GPU_GIB = 80
STAGES = ("load", "dense_eval", "scoring", "allocation", "refit", "kl", "export")
COPIES = {"load": 1, "dense_eval": 1, "scoring": 1, "allocation": 1, "refit": 2, "export": 1}  # whole models held
KL_FP32_STATE = 5  # float32 weights, gradients, two AdamW moments and the live teacher, in model bytes
KL_BYTES = {"cached": 2 + 2 + 8, "live": 2 + 2 + 8 + 2}  # per parameter, bf16 weights/grads/teacher, fp32 moments
# the target models' configs (config.json of meta-llama/Llama-3.1-8B and -70B): untied embeddings
TARGETS = {"Llama-3.1-8B": {"layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8,
                            "head_dim": 128, "vocab": 128256},
           "Llama-3.1-70B": {"layers": 80, "hidden": 8192, "intermediate": 28672, "heads": 64, "kv_heads": 8,
                             "head_dim": 128, "vocab": 128256}}
BLOCKS = ("measured", "conditions", "projection")


def llama_params(c: dict) -> int:
    """Parameters of an untied Llama from its config: embeddings and LM head, per layer Q/K/V/O,
    gate/up/down and two RMSNorms, the final norm."""
    attention = c["hidden"] * c["head_dim"] * (2 * c["heads"] + 2 * c["kv_heads"])
    per_layer = attention + 3 * c["hidden"] * c["intermediate"] + 2 * c["hidden"]
    return 2 * c["vocab"] * c["hidden"] + c["layers"] * per_layer + c["hidden"]


def largest(rows: list[dict], stage: str) -> dict | None:
    return max((r for r in rows if r["stage"] == stage), key=lambda r: r["params"], default=None)


def _target(r: dict) -> str:
    target = "" if r["target"] is None else (f"<= {r['target']}x: " + ("met" if r["peak_ratio"] <= r["target"] else "missed"))
    return target + (f" ({r['teacher']} teacher)" if r["stage"] == "kl" else "")


def _setup(r: dict) -> float:
    """The set-up's net peak over the model's bytes (never below 0: ru_maxrss and statm differ by a few KiB)."""
    return max(0.0, r["setup_peak_rss_mib"] - r["base_rss_mib"]) * MIB / r["model_bytes"]


MEASURED = [text("model"), column("parameters", lambda r: r["params"] / 1e6, ".1f", unit="M"),
            column("model MiB", lambda r: r["model_bytes"] / MIB, ",.0f"), text("stage"), column("seconds", "seconds", ".1f"),
            column("peak RSS MiB", "peak_rss_mib", ",.0f"), column("peak - base MiB", "net_peak_mib", ",.0f"),
            column("set-up / model", _setup, unit="x"), column("peak / model", "peak_ratio", unit="x"),
            text("target", _target, right=True), text("set by", lambda r: "set-up" if r["peak_in_setup"] else "stage")]


def measured(bench: dict) -> str:
    lines = markdown(MEASURED, bench["scale"])
    skipped = [f"{m}: {', '.join(s)}" for m, s in bench["meta"]["config"]["scale"]["skip"].items()
               if s and m in bench["meta"]["config"]["scale"]["models"]]
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines)


def conditions(bench: dict) -> str:
    meta, rows = bench["meta"], bench["scale"]
    s = meta["config"]["scale"]
    loads = [r["load_before"] for r in rows]
    return "\n".join([
        f"- started {meta['date']}, code of commit {meta['commit']} (`-dirty`: other engineers' uncommitted "
        "changes were in the checkout)",
        f"- torch {meta['torch']}, transformers {meta['transformers']}, device {meta['device']} "
        f"({meta['device_name']}), {meta['threads']} torch thread, dtype {meta['config']['dtype']}",
        f"- calibration: {s['samples']} x {s['seq']} random tokens in batches of {s['batch_size']}; "
        f"budget=kv target {s['kv_target']}; layer_policy=measured with profile_samples {s['profile_samples']}, "
        f"passes {s['passes']}, candidates {s['candidates']}; {s['kl_steps']} KL steps (the same batches' size)",
        f"- 1-minute load average: {meta['load_before'][0]} at the start, {meta['load_after'][0]} at the end, "
        f"{min(loads)} to {max(loads)} when the stages started (2 shared CPU cores)",
    ])


def rest_bytes(r: dict, bench: dict, config: dict) -> tuple[float, float]:
    """(shardable-state multiple of the measured model, per-GPU rest in bytes at `config`): the
    measured peak beyond the whole models (or, KL, the float32 training state) the stage holds,
    scaled from the measured model's layers x hidden to the target's, in bf16."""
    state = KL_FP32_STATE if r["stage"] == "kl" else COPIES[r["stage"]]
    measured_rest = max(0.0, r["net_peak_mib"] * MIB - state * r["model_bytes"])  # bytes, measured dtype
    shape = bench["meta"]["config"]["scale"]["shapes"][r["model"]]
    width = (config["layers"] * config["hidden"]) / (shape["num_hidden_layers"] * shape["hidden_size"])
    return state, measured_rest * width * 2 / (r["model_bytes"] / r["params"])


def projection(bench: dict) -> str:
    rows = bench["scale"]
    gpu = GPU_GIB * GIB
    lines = ["| model | stage | measured at | peak / model there | shardable GiB | per-GPU rest GiB | projected GiB "
             "| one 80 GiB GPU | GPUs under FSDP |", "|---|---|---|---:|---:|---:|---:|---|---:|"]
    notes = []
    for name, config in TARGETS.items():
        params = llama_params(config)
        for stage in STAGES:
            r = largest(rows, stage)
            if r is None or stage == "load":
                continue
            _, rest = rest_bytes(r, bench, config)
            for teacher in (("cached", "live") if stage == "kl" else (None,)):
                shardable = KL_BYTES[teacher] * params if stage == "kl" else COPIES[stage] * 2 * params
                label = f"kl ({teacher} teacher)" if stage == "kl" else stage
                total = shardable + rest
                gpus = "-" if rest >= gpu else str(max(1, math.ceil(shardable / (gpu - rest))))
                lines.append(f"| {name} ({params / 1e9:.2f}B) | {label} | {r['model']} | {r['peak_ratio']:.2f}x "
                             f"| {shardable / GIB:,.0f} | {rest / GIB:,.1f} | {total / GIB:,.0f} "
                             f"| {'yes' if total <= gpu else 'no'} | {gpus} |")
        kl = largest(rows, "kl")
        if kl is not None:
            _, rest = rest_bytes(kl, bench, config)
            on_gpu = 4 * params  # bf16 weights and gradients; the moments offloaded
            notes.append(f"- {name}, KL with a cached teacher and AdamW's moments offloaded to the CPU: "
                         f"{(on_gpu + rest) / GIB:,.0f} GiB of GPU memory in all, "
                         f"{max(1, math.ceil(on_gpu / (gpu - rest)))} GPU(s) of 80 GiB under FSDP, and "
                         f"{8 * params / GIB:,.0f} GiB of host memory for the moments")
    return "\n".join(lines + [""] + notes)


def render(text: str, bench: dict) -> str:
    """`text` (README.md) with each generated block replaced by what `bench` gives."""
    for block in BLOCKS:
        start, end = f"<!-- generated: {block} -->\n", f"<!-- end: {block} -->"
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + start + globals()[block](bench) + "\n" + end + tail
    return text


def main(argv: list[str]) -> int:
    bench = json.loads((HERE / "bench.json").read_text())
    readme = HERE / "README.md"
    text = readme.read_text()
    fresh = render(text, bench)
    if "--check" in argv:
        if fresh != text:
            print("experiments/scale/README.md differs from what bench.json gives; run experiments/scale/collect.py")
            return 1
        return 0
    readme.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
