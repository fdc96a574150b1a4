"""Scale: memory and time of each stage of the LLM pipeline, per model size (issue 38).

Random-init Llama-family models built from config (`bench.scale.shapes`: SmolLM2-135M's and
-360M's shapes and a ~1B one) go through the stages a `headprune-train` LLM run goes through,
each called through headprune's own functions, on `samples` x `seq` random calibration tokens:

    load        `models.build_model` of the saved checkpoint (what `model=<folder>` does)
    dense_eval  `CausalLM.evaluate` (perplexity) of the dense model on the calibration blocks
    scoring     `get_metric("fisher")`: the Fisher information of the head mask
    allocation  `prune_round` under `budget=kv` (`kv_target` of the dense KV bytes) with
                `layer_policy=measured` (cost curves, knapsack, corrections), on the scores above
    refit       the Pruner's dense copy (`HeadMask.unmasked_copy`), the heads removed
                (`prune_heads`, pruning.physical=true) and `Refit().after_round` (ridge refit of
                every output projection against the dense model, layer by layer)
    kl          `Distill(steps=kl_steps, alpha=1.0, temperature=1.0, teacher_logits=...)` through a
                `RecoveryContext` (cached: the teacher's top-64 built in its set-up, the dense copy freed)
                (`before_first_round` takes the dense model as teacher, `after_round` trains),
                as recovery=chain's KL stage; the row says whether a teacher model was in memory
                during the steps (`teacher`: live) or not (cached)
    export      `fold` and `save_pruned` of the recovered model

`model_device=cpu` runs scoring, allocation and refit with the pruned model streamed
(`pruning.model_device=cpu`: its blocks in host memory, one at a time on the device) and the refit's
dense copy too (`pruning.dense_device=cpu`). On the CPU home and device are the same memory, so the
resident peak measures what streaming costs the host; the rows' `info.device` says what a device
would hold by the residency trace: per model the peak number of blocks on it at once and
`device_bytes` (the small modules plus that many blocks; `engine.offload.device_bytes`), and
`device_ratio`, their sum over the model's bytes.

Memory: each stage runs in a fresh child process (multiprocessing `forkserver`: the server has
imported torch, transformers and headprune once and never computes; every child forks from it)
that loads the stage's inputs from the folder the previous stage wrote, then runs the stage.
The child's peak is `getrusage(RUSAGE_SELF).ru_maxrss`, exact (the kernel's high-water mark of
resident pages, including memory-mapped weight pages once touched), where a sampling thread
reading /proc/self/statm could miss a peak between samples; it is monotone over a process's
life, which is why every stage gets its own process and nothing of an earlier stage (freed
tensors kept by the allocator, a second model) can inflate a later one. A row reports the
child's resident memory before it loaded anything (`base_rss_mib`: the interpreter and
libraries), its high-water mark after the stage's set-up (`setup_peak_rss_mib`: inputs loaded,
the dense copy or teacher made) and after the stage (`peak_rss_mib`), and `peak_ratio` =
(peak - base) / the model's bytes (its parameters' bytes, tied weights once): how many models'
worth of memory the stage needs. `peak_in_setup` is true when the set-up, not the stage, set
the peak; `load_before` is the 1-minute load average when it started (the machine is shared).
Code a stage uses for the first time (transformers' loading, safetensors, allocator arenas:
~20-40 MiB) is in its net peak: negligible from SmolLM2-135M's size on (< 0.1x), dominant in
quick mode's tiny model, whose ratios mean nothing. Weights load memory-mapped (transformers'
safetensors loading), so the `load` row counts only the pages the load touched; every later
stage touches them all. Seconds time the stage alone, not its set-up. A script that runs the
bench itself must guard its entry with `if __name__ == "__main__":` (multiprocessing's rule
for forkserver children; the `headprune-bench` entry point does).

Targets (issue 38, reported, never asserted): scoring, allocation and refit peak <= 1.5x the
model's bytes at the largest size; KL steps with a cached teacher <= 4x (weights, gradients,
AdamW moments). The allocation here scores once and allocates once (one round, one-shot).
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import resource
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import torch
from omegaconf import MISSING, OmegaConf
from torch.utils.data import DataLoader

from headprune.bench import render
from headprune.report import Column
from headprune.bench.decoder import build_decoder
from headprune.bench.sections import Section, SectionInputs, one_of, register
from headprune.deploy.fold import fold
from headprune.deploy.hf import load_pruned, save_pruned
from headprune.engine.offload import MODEL_DEVICES, dense_copy, device_bytes, offload_of, stream_model
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import prune_heads
from headprune.models.build import build_model
from headprune.recovery.base import RecoveryContext
from headprune.recovery.distill import Distill
from headprune.recovery.refit import Refit
from headprune.scoring import get_metric
from headprune.selection.budgets import KVBudget
from headprune.selection.layer_policies import MeasuredPolicy
from headprune.selection.pruner import Loaders
from headprune.selection.rounds import prune_round
from headprune.selection.schedules import OneShot
from headprune.tasks import CAUSAL_LM

log = logging.getLogger(__name__)

STAGES = ("load", "dense_eval", "scoring", "allocation", "refit", "kl", "export")
SKIPPABLE = ("load", "dense_eval", "kl", "export")  # nothing later reads what they write
STREAMED = ("scoring", "allocation", "refit")  # the stages model_device=cpu streams
TARGETS = {"scoring": 1.5, "allocation": 1.5, "refit": 1.5, "kl": 4.0}  # peak / model bytes
MIB = 2 ** 20


@dataclass
class ScaleSettings:
    enabled: bool = MISSING
    models: List[str] = MISSING  # keys of `shapes`, run in this order
    shapes: Dict[str, Any] = MISSING  # name -> {model_type, transformers config fields}
    skip: Dict[str, List[str]] = MISSING  # model -> stages not run for it (of SKIPPABLE)
    samples: int = MISSING  # calibration sequences (random token ids)
    seq: int = MISSING  # tokens per sequence
    batch_size: int = MISSING
    kl_steps: int = MISSING
    teacher_logits: str = MISSING  # the KL stage's teacher: live, or cached (its top-k, then freed)
    kv_target: float = MISSING  # budget=kv target: the share of the dense KV bytes kept
    profile_samples: int = MISSING  # layer_policy=measured: sequences its cost curves read
    passes: int = MISSING
    candidates: int = MISSING
    model_device: str = MISSING  # run | cpu: scoring, allocation and refit with the models' blocks streamed


# -- in the child process -----------------------------------------------------------------------
def rss_mib() -> float:
    """Resident memory of this process now (/proc/self/statm), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def peak_rss_mib() -> float:
    """This process's high-water mark of resident memory so far (ru_maxrss is in KiB on Linux), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def blocks(job: dict, seed: int) -> DataLoader:
    """`samples` x `seq` random token ids in batches of `batch_size`: {"input_ids": (B, T)},
    the batches of the causal-LM datamodule (memory and time do not depend on the text)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, job["vocab_size"], (job["samples"], job["seq"]), generator=g)  # (N, T)
    return DataLoader([{"input_ids": row} for row in ids], batch_size=job["batch_size"], shuffle=False)


def _dense(job: dict):
    return build_model(str(job["work"] / "dense"), task="causal_lm").eval()


def _placed(job: dict, model):
    """`model` as `model_device` says: whole (run) or its blocks streamed (cpu)."""
    if job["model_device"] == "cpu":
        stream_model(model, "cpu")
    return model


def _on_device(*models) -> dict:
    """`info.device`: per model, the peak blocks on the device at once and the bytes it held there
    (module docstring); `device_ratio`: their sum over the first model's bytes."""
    out = {}
    for name, model in models:
        offload = offload_of(model)
        out[name] = {"streamed": offload is not None, "device_bytes": device_bytes(model),
                     **({"peak_resident_blocks": offload.peak_resident, "blocks": len(offload.blocks)}
                        if offload is not None else {})}
    return out


def _heads(job: dict) -> list[tuple[int, int]]:
    """The (layer, head) pairs the allocation pruned, original ids."""
    return [tuple(h) for h in json.loads((job["work"] / "heads.json").read_text())]


def _pruned_mask(job: dict, model) -> HeadMask:
    """The HeadMask of a model saved after the allocation (its heads already removed), with the
    allocation's heads at 0, as the run's mask is."""
    mask = HeadMask.for_model(model)
    mask.prune(_heads(job))
    return mask


def _model_size(model) -> tuple[int, int]:
    """(parameters, bytes) of `model`, tied weights once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _build(job: dict) -> dict:
    """Not a stage: the random-init model built from its shape and saved for the stages to load."""
    spec = dict(job["spec"])
    model = build_decoder(spec, seed=job["seed"]).to(getattr(torch, job["dtype"]))
    params, nbytes = _model_size(model)
    model.save_pretrained(job["work"] / "dense")
    return {"params": params, "model_bytes": nbytes, "layers": model.config.num_hidden_layers,
            "heads": model.config.num_attention_heads, "kv_heads": model.config.num_key_value_heads}


class _Stage:
    """One stage in a child: `setup(job)` loads its inputs (not timed), `run(state)` is the stage
    (timed, its peak reported), `save(state)` writes what the next stage reads (after the peak
    was read)."""

    def setup(self, job: dict) -> dict:
        return {"job": job, "model": _dense(job)}

    def run(self, state: dict) -> dict:
        raise NotImplementedError

    def save(self, state: dict) -> None:
        pass


class _Load(_Stage):
    def setup(self, job):
        return {"job": job}

    def run(self, state):
        state["model"] = _dense(state["job"])
        return {}


class _DenseEval(_Stage):
    def run(self, state):
        return CAUSAL_LM.evaluate(state["model"], blocks(state["job"], seed=0), "cpu")


class _Scoring(_Stage):
    def setup(self, job):
        state = super().setup(job)
        _placed(job, state["model"])
        state["mask"] = HeadMask.for_model(state["model"])
        return state

    def run(self, state):
        state["scores"] = get_metric("fisher")(state["model"], state["mask"], blocks(state["job"], seed=0))  # (L, H)
        return {"device": _on_device(("model", state["model"]))}

    def save(self, state):
        torch.save(state["scores"], state["job"]["work"] / "scores.pt")


class _Allocation(_Scoring):
    def setup(self, job):
        state = super().setup(job)
        state["scores"] = torch.load(job["work"] / "scores.pt")
        return state

    def run(self, state):
        job, model, mask = state["job"], state["model"], state["mask"]
        budget = KVBudget(target=job["kv_target"])
        policy = MeasuredPolicy(profile_samples=job["profile_samples"], passes=job["passes"],
                                candidates=job["candidates"])
        costs, _ = budget.measure(model)
        goal = budget.goal(OneShot(target_sparsity=0.5), 0, mask.alive(), costs)
        scores = state["scores"]  # the scoring stage's, handed to prune_round as its metric's result
        result = prune_round(model, mask, lambda *args, **kwargs: scores, policy, goal.n_prune,
                             blocks(job, seed=0), cost_budget=(goal.costs, goal.share))
        state["heads"] = result.pruned
        report = result.budget or {}
        return {"heads_pruned": result.n_pruned, "kv_share": report.get("predicted_share"),
                "kept_units_per_layer": report.get("kept_units_per_layer"),
                "forwards": report.get("measured", {}).get("forwards"), "shortfall": result.shortfall,
                "device": _on_device(("model", model))}

    def save(self, state):
        (state["job"]["work"] / "heads.json").write_text(json.dumps(state["heads"]))


class _Refit(_Stage):
    def setup(self, job):
        model = _placed(job, _dense(job))
        mask = HeadMask.for_model(model)
        # the Pruner's dense copy (round 1), streamed with the model under model_device=cpu
        dense = mask.unmasked_copy(model, lambda m: dense_copy(m, job["model_device"]))
        heads = _heads(job)
        mask.prune(heads)
        prune_heads(model, heads)  # pruning.physical=true: the heads leave before the recovery
        refit = Refit()
        refit.check_model(model)
        return {"job": job, "model": model, "mask": mask, "dense": dense, "refit": refit}

    def run(self, state):
        record = {"round": 1}
        ctx = RecoveryContext(state["model"], state["mask"], Loaders(score=blocks(state["job"], seed=0)),
                              dense=state["dense"], task=CAUSAL_LM)
        state["refit"].after_round(ctx, record)
        report = record["refit"]
        return {"tokens": report["tokens"], "block_runs": report["block_runs"],
                "device": _on_device(("model", state["model"]), ("dense", state["dense"]))}

    def save(self, state):
        save_pruned(state["model"], state["job"]["work"] / "refit", overwrite=True)


class _KL(_Stage):
    def setup(self, job):
        student = load_pruned(job["work"] / "refit")
        mask = _pruned_mask(job, student)
        teacher = _dense(job).requires_grad_(False)  # the run's frozen dense copy
        distill = Distill(steps=job["kl_steps"], alpha=1.0, temperature=1.0, teacher_logits=job["teacher_logits"])
        distill.check_model(student)
        ctx = RecoveryContext(student, mask, Loaders(score=blocks(job, seed=0), train=blocks(job, seed=1)),
                              dense=teacher, task=CAUSAL_LM)
        distill.before_first_round(ctx)
        if not distill.keeps_dense:  # a cached teacher: the run frees its dense copy (Pruner._start)
            ctx.dense = None
        del teacher
        return {"job": job, "model": student, "ctx": ctx, "distill": distill}

    def run(self, state):
        record = {"round": 1}
        distill = state["distill"]
        teacher = "live" if distill.state.model is not None else "cached"
        distill.after_round(state["ctx"], record)
        report = record["distill"]
        return {"teacher": teacher, "steps": report["steps"], "tokens": report["tokens"],
                "loss_first": report["loss_first"], "loss_last": report["loss_last"],
                "teacher_seconds": report.get("teacher_seconds")}

    def save(self, state):
        save_pruned(state["model"], state["job"]["work"] / "kl", overwrite=True)


class _Export(_Stage):
    def setup(self, job):
        source = job["work"] / ("kl" if (job["work"] / "kl").is_dir() else "refit")
        model = load_pruned(source)
        return {"job": job, "model": model, "mask": _pruned_mask(job, model), "source": source.name}

    def run(self, state):
        folder = state["job"]["work"] / "export"
        fold(state["model"], state["mask"])
        save_pruned(state["model"], folder, overwrite=True)
        params, _ = _model_size(state["model"])
        return {"from": state["source"], "export_bytes": _folder_bytes(folder), "params_after": params}


STAGE_CLASSES = {"load": _Load, "dense_eval": _DenseEval, "scoring": _Scoring, "allocation": _Allocation,
                 "refit": _Refit, "kl": _KL, "export": _Export}


def _child(stage: str, job: dict, out: str) -> None:
    """Entry point of a child process: one stage (or `build`), its figures written to `out` as JSON."""
    try:
        torch.set_num_threads(job["threads"])
        base = rss_mib()
        if stage == "build":
            result = _build(job)
        else:
            runner = STAGE_CLASSES[stage]()
            state = runner.setup(job)
            setup_peak = peak_rss_mib()
            start = time.perf_counter()
            info = runner.run(state)
            seconds = time.perf_counter() - start
            peak, end = peak_rss_mib(), rss_mib()
            runner.save(state)
            result = {"seconds": seconds, "base_rss_mib": base, "setup_peak_rss_mib": setup_peak,
                      "peak_rss_mib": peak, "end_rss_mib": end, "info": info}
    except BaseException as err:  # noqa: BLE001 (reported to the parent, which raises)
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    Path(out).write_text(json.dumps(result, default=str))


# -- in the bench process -----------------------------------------------------------------------
def _context(model_types: list[str]):
    """The forkserver context; its server imports this module, the families' modeling code and
    Lightning (the KL steps' fit) before any child forks, so lazily imported code is in every
    child's `base_rss_mib`, not in a stage's peak."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "lightning.pytorch",
                                *(f"transformers.models.{t}.modeling_{t}" for t in dict.fromkeys(model_types))])
    return ctx


def in_child(ctx, stage: str, job: dict, model: str) -> dict:
    """Run `stage` of `job` in a fresh child process and return its figures; a failure raises,
    naming the model and the stage."""
    out = job["work"] / f"{stage}.json"
    process = ctx.Process(target=_child, args=(stage, job, str(out)), name=f"scale-{model}-{stage}")
    process.start()
    process.join()
    if not out.is_file():
        why = " (killed: out of memory?)" if process.exitcode in (-9, 137) else ""
        raise RuntimeError(f"bench.scale: stage {stage} of {model} exited with {process.exitcode}{why} and "
                           "reported nothing")
    result = json.loads(out.read_text())
    if "error" in result:
        log.error("bench.scale: %s of %s failed:\n%s", stage, model, result["traceback"])
        raise RuntimeError(f"bench.scale: stage {stage} of {model} failed: {result['error']}")
    return result


def row(model: str, built: dict, stage: str, result: dict, job: dict) -> dict:
    """One bench.json row: the stage's seconds and peak, and the peak per byte of the model."""
    net = result["peak_rss_mib"] - result["base_rss_mib"]
    ratio = net * MIB / built["model_bytes"]
    target = TARGETS.get(stage)
    return {"model": model, "params": built["params"], "model_bytes": built["model_bytes"], "dtype": job["dtype"],
            "layers": built["layers"], "heads": built["heads"], "kv_heads": built["kv_heads"], "stage": stage,
            "tokens": job["samples"] * job["seq"], "seconds": result["seconds"],
            "base_rss_mib": result["base_rss_mib"], "setup_peak_rss_mib": result["setup_peak_rss_mib"],
            "peak_rss_mib": result["peak_rss_mib"], "end_rss_mib": result["end_rss_mib"], "net_peak_mib": net,
            "peak_ratio": ratio, "peak_in_setup": result["peak_rss_mib"] <= result["setup_peak_rss_mib"],
            "target": target, "teacher": result["info"].get("teacher"), "info": result["info"],
            "model_device": job["model_device"] if stage in STREAMED else "run",
            "device_ratio": (sum(d["device_bytes"] for d in result["info"]["device"].values()) / built["model_bytes"]
                             if "device" in result["info"] else None)}


def run(inputs: SectionInputs) -> list[dict]:
    """The rows of every model in `bench.scale.models`, stage after stage, one child each."""
    s, rows = inputs.bench.scale, []
    ctx = _context([s.shapes[name].model_type for name in s.models])
    root = Path(inputs.cfg.paths.output_dir)
    for name in s.models:
        spec = OmegaConf.to_container(s.shapes[name], resolve=True)
        skip = set(s.skip.get(name) or [])
        with tempfile.TemporaryDirectory(prefix=f"scale_{name}_", dir=root) as work:
            job = {"work": Path(work), "spec": spec, "vocab_size": spec["vocab_size"], "seed": inputs.cfg.seed,
                   "dtype": inputs.bench.dtype, "threads": inputs.bench.threads, "samples": s.samples, "seq": s.seq,
                   "batch_size": s.batch_size, "kl_steps": s.kl_steps, "teacher_logits": s.teacher_logits,
                   "kv_target": s.kv_target,
                   "profile_samples": s.profile_samples, "passes": s.passes, "candidates": s.candidates,
                   "model_device": s.model_device}
            built = in_child(ctx, "build", job, name)
            log.info("scale %s: %.1fM parameters, %.0f MiB (%s)", name, built["params"] / 1e6,
                     built["model_bytes"] / MIB, job["dtype"])
            for stage in STAGES:
                if stage in skip:
                    continue
                load = round(os.getloadavg()[0], 2)
                r = {**row(name, built, stage, in_child(ctx, stage, job, name), job), "load_before": load}
                log.info("scale %s %s: %.1f s, peak %.0f MiB (%.2fx the model)", name, stage, r["seconds"],
                         r["peak_rss_mib"], r["peak_ratio"])
                rows.append(r)
    return rows


def applies(inputs: SectionInputs) -> bool:
    """Resident memory is a CPU measure: the section runs when the bench runs on the CPU."""
    if inputs.device.type != "cpu":
        log.warning("bench.scale measures resident (CPU) memory and runs only with bench.device=cpu; skipped on %s",
                    inputs.device)
        return False
    return True


def check(settings, bench) -> None:
    if not settings.enabled:
        return
    if bench.device == "cuda":
        raise ValueError("bench.scale measures resident (CPU) memory: bench.device=cuda is not allowed with "
                         "bench.scale.enabled=true; allowed: cpu, auto (the section is skipped on a GPU)")
    for name in ("samples", "seq", "batch_size", "kl_steps", "profile_samples", "candidates"):
        if settings[name] < 1:
            raise ValueError(f"bench.scale.{name}={settings[name]} is not allowed; allowed: an integer >= 1")
    if settings.samples < 4:  # Refit's holdout (0.25) chooses its damping on every 4th sequence
        raise ValueError(f"bench.scale.samples={settings.samples} is not allowed; allowed: an integer >= 4 (the refit "
                         "chooses its damping on every 4th calibration sequence)")
    one_of("bench.scale.teacher_logits", settings.teacher_logits, ("live", "cached"))
    one_of("bench.scale.model_device", settings.model_device, MODEL_DEVICES)
    if settings.passes < 0:
        raise ValueError(f"bench.scale.passes={settings.passes} is not allowed; allowed: an integer >= 0")
    if not 0 < settings.kv_target < 1:
        raise ValueError(f"bench.scale.kv_target={settings.kv_target} is not allowed; allowed: 0 < kv_target < 1")
    if not settings.models:
        raise ValueError("bench.scale.models is empty; allowed: a non-empty list of keys of bench.scale.shapes")
    for model in settings.models:
        one_of("bench.scale.models", model, tuple(settings.shapes))
        spec = settings.shapes[model]
        for key in ("model_type", "vocab_size"):
            if key not in spec:
                raise ValueError(f"bench.scale.shapes.{model} has no {key}; a shape is a model_type plus "
                                 "transformers config fields, vocab_size included")
        if settings.seq > spec.get("max_position_embeddings", settings.seq):
            raise ValueError(f"bench.scale.seq={settings.seq} exceeds bench.scale.shapes.{model}'s "
                             f"max_position_embeddings={spec['max_position_embeddings']}; allowed: at most that")
    for model, stages in settings.skip.items():
        one_of("bench.scale.skip", model, tuple(settings.shapes))
        for stage in stages:
            one_of(f"bench.scale.skip.{model}", stage, SKIPPABLE)


# -- report ---------------------------------------------------------------------------------------
def largest(rows: list[dict], stage: str) -> dict | None:
    """The row of `stage` at the largest model it ran on."""
    return max((r for r in rows if r["stage"] == stage), key=lambda r: r["params"], default=None)


def summary(rows: list[dict], results: dict) -> dict:
    """Per target stage, at the largest model it ran on: the peak per model byte against its target."""
    block = {}
    for stage, target in TARGETS.items():
        r = largest(rows, stage)
        if r is not None:
            block[stage] = {"model": r["model"], "params": r["params"], "peak_ratio": r["peak_ratio"],
                            "target": target, "meets_target": r["peak_ratio"] <= target,
                            **({"teacher": r["teacher"]} if stage == "kl" else {})}
    return block


def summary_lines(block: dict) -> list[str]:
    lines = []
    for stage, d in block.items():
        line = (f"- scale, {stage} at {d['model']} ({d['params'] / 1e6:.0f}M parameters): peak "
                f"{d['peak_ratio']:.2f}x the model's bytes (target <= {d['target']}x: {render.met(d)})")
        if stage == "kl":
            line += (f"; teacher {d['teacher']}" + (" (the target is for a cached teacher: not measured)"
                                                     if d["teacher"] == "live" else ""))
        lines.append(line)
    return lines


def table(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    heading = f"## Scale (random-init models, {r0['dtype']}, {r0['tokens']} calibration tokens)"
    return render.table(heading, rows, [
        Column("model", lambda r: r["model"], False), Column("parameters", lambda r: f"{r['params'] / 1e6:.1f}M", True),
        Column("model MiB", lambda r: f"{r['model_bytes'] / MIB:,.0f}", True), Column("stage", lambda r: r["stage"], False),
        Column("seconds", lambda r: f"{r['seconds']:.1f}", True),
        Column("peak RSS MiB", lambda r: f"{r['peak_rss_mib']:,.0f}", True),
        Column("peak - base MiB", lambda r: f"{r['net_peak_mib']:,.0f}", True),
        Column("peak / model", lambda r: f"{r['peak_ratio']:.2f}x", True),
        Column("target", lambda r: "" if r["target"] is None else f"<= {r['target']}x", True),
        Column("teacher", lambda r: r["teacher"] or "", False)])


SECTION = register(Section("scale", ScaleSettings, run, table, summary, summary_lines, check=check,
                           applies=applies))
