"""RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?") offline, through lm-eval's own task code (`lm_eval/tasks/ruler`, lm-eval 0.4.13): its
sample generators, prompt templates, answer prefixes, generation lengths and metric, driven here
with a seed, a sample count and a tokenizer, so the dense model and the export are scored on the
same prompts and a peer method can be scored on them too (`write_samples`).

Why: RULER at 4k is the field's yardstick for KV-cache compression (kvpress's leaderboard,
DuoAttention, RazorAttention); passkey alone is too easy to tell methods apart.

Tasks (RULER's names; lm-eval's yaml `ruler_vt` etc. for the last three):
- `niah_single_1` (the "repeat" haystack), `niah_multikey_2` / `niah_multikey_3` (the "needle"
  haystack), `vt`, `fwe`: nothing from the network; `cwe` needs the `wonderwords` package (the
  `llm` extra), as do all niah tasks (lm-eval's prepare_niah imports it).
- the essay variants `niah_single_2`, `niah_single_3`, `niah_multikey_1`, `niah_multivalue`,
  `niah_multiquery` load Paul Graham's essays from the hub in lm-eval; here their haystack is Tiny
  Shakespeare's training part (`headprune.data.corpora`, decoded from the model tokenizer's ids of
  the training part), split into words as lm-eval splits the essays, and into sentences by nltk's
  Punkt with default parameters (lm-eval's `sent_tokenize` needs the `punkt_tab` download).
  `haystack` in results.json says which each task used.
- RULER's qa tasks read SQuAD / HotpotQA from the network and are not offered.

What is lm-eval's and what is ours: the generators are lm-eval's functions (`niah_utils.<task>`
with its argument table; `vt_utils`, `cwe_utils`, `fwe_utils`' sample functions with the
arguments their `get_dataset` passes, `num_samples` ours instead of 500); the prompt is built as
lm-eval builds it (`doc_to_text` = input, then the task's `target_delimiter` unless whitespace
joins them, then `gen_prefix`; with `chat_template`: the input as one user turn and the answer
prefix as the start of the assistant's turn, `continue_final_message`, as lm-eval's
`--apply_chat_template`), encoded without added special tokens (lm-eval's HF model adds no BOS;
a chat template writes its own); generation is greedy, `max_gen_toks` of the task's yaml, stopped
at the tokenizer's end-of-sequence token; the score is the yaml's `process_results`
(`string_match_all` for every task here: the share of gold answers found in the prediction,
case-insensitive, after lm-eval's `postprocess_pred`).

Seeding: lm-eval's generators draw from Python's global `random` (vt also from numpy's global
generator, cwe from a module-level `random.Random(42)` whose state depends on what ran before);
each (task, context) here seeds all three from `seed`, the task and the context, and restores
them after, so the samples depend only on (tokenizer, task, context, samples, seed) and the
first n samples of a larger count are the same n. A sample's prompt plus `max_gen_toks` fits the
context (lm-eval's rule) before any chat template's tokens.

The mean: a task where the dense model scores below `FLOOR` (20%) is reported but left out of the
RULER mean (issue 53: a small model cannot do it, so its ratio says nothing); results hold both
the mean over every task and the mean over the tasks where dense scores at least `FLOOR`.

    python -m headprune.evaluation.ruler write-samples --model smollm2 --tasks niah_single_1 vt \
        --contexts 4096 --samples 20 --seed 0 --out ruler_samples.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

log = logging.getLogger(__name__)

from headprune.evaluation.ruler_tasks import (  # noqa: F401  (re-exported: the names ruler users read)
    ESSAY_HAYSTACK, FLOOR, MODULES, SAMPLE_KEYS, TASKS, RulerTask, check_settings, lm_eval_module, quiet, score,
    task_config,
)


# -- samples ------------------------------------------------------------------------------------------
class _Counter:
    """What lm-eval's generators call to count tokens, `TOKENIZER(text).input_ids`, for a
    tokenizer that is not callable (headprune's byte tokenizer: its special tokens added, as an HF
    tokenizer's call adds them)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=self.tokenizer.encode(text, add_special_tokens=True))


def _counter(tokenizer):
    return tokenizer if callable(tokenizer) else _Counter(tokenizer)


def _tokens(tokenizer, text: str) -> int:
    return len(_counter(tokenizer)(text).input_ids)


@contextlib.contextmanager
def seeded(seed: int, task: str, context: int) -> Iterator[None]:
    """Python's and numpy's global generators and cwe's module generator seeded from (seed, task,
    context), their states restored after."""
    import numpy as np

    cwe = lm_eval_module("cwe_utils") if TASKS[task].kind == "cwe" else None
    states = random.getstate(), np.random.get_state(), cwe.RNG.getstate() if cwe else None
    key = f"{seed}/{task}/{context}"
    random.seed(key)
    np.random.seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little"))
    if cwe:
        cwe.RNG.seed(key)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        if cwe:
            cwe.RNG.setstate(states[2])


@contextlib.contextmanager
def _patched(module, **attributes) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in attributes}
    for name, value in attributes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@cache
def _punkt():
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer()


_ESSAYS: dict = {}


def essay_haystack(tokenizer, data_dir: str | Path | None) -> list[str]:
    """The words of Tiny Shakespeare's training part (the model tokenizer's ids of it, decoded), split
    as lm-eval splits Paul Graham's essays (whitespace runs to one space, split on spaces)."""
    import re

    from headprune.data.corpora import corpus_ids

    key = (id(tokenizer), str(data_dir))
    if key not in _ESSAYS or _ESSAYS[key][0] is not tokenizer:
        ids = corpus_ids("tinyshakespeare", "train", tokenizer, data_dir, "evaluation.ruler_tasks (essay haystack)")
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        _ESSAYS[key] = (tokenizer, re.sub(r"\s+", " ", text).split(" "))
    return _ESSAYS[key][1]


def check_fits(tokenizer, task: str, context: int) -> None:
    """Refuse a context too short for the task's fixed text plus its answer tokens: lm-eval's vt,
    cwe and fwe generators would shrink their haystack forever (niah raises by itself). Measured
    with lm-eval's own builders at their smallest sizes, under a throwaway seed."""
    kind, need = TASKS[task].kind, task_config(task)["max_gen_toks"]
    if kind == "niah":
        return
    generator = lm_eval_module(MODULES[kind])
    with seeded(0, task, context), quiet():
        if kind == "vt":
            icl, _ = generator.generate_input_output(5, 1, 4, is_icl=True)
            if _tokens(tokenizer, icl) + need > 500:
                raise ValueError(f"evaluation.ruler_tasks: vt's in-context example (lm-eval builds it within 500 tokens) "
                                 f"does not fit 500 tokens of this tokenizer ({_tokens(tokenizer, icl)} + {need}); "
                                 "allowed: a tokenizer with subword tokens, or leave vt out")
            text, _ = generator.generate_input_output(10, 1, 4)
            fixed = _tokens(tokenizer, text) + 500
        elif kind == "cwe":
            example, text, answer = generator.generate_input_output(20, context)
            fixed = _tokens(tokenizer, example + "\n" + text + " " + " ".join(answer))
        else:
            fixed = _tokens(tokenizer, generator.TEMPLATE.format(context="", query=""))
    if fixed + need > context:
        raise ValueError(f"evaluation.ruler_contexts: {context} tokens are too few for RULER's {task} with this "
                         f"tokenizer: its smallest prompt takes about {fixed} tokens and its answer {need}; allowed: "
                         f"at least {fixed + need}")


def task_samples(tokenizer, task: str, context: int, samples: int, seed: int, data_dir: str | Path | None) -> list[dict]:
    """lm-eval's documents of `task` at `context` tokens: {"index", "input", "outputs", "gen_prefix",
    "length", "max_length", ...} as its generator writes them, `samples` of them, seeded (module docstring)."""
    kind = TASKS[task].kind
    check_fits(tokenizer, task, context)
    counter, generator = _counter(tokenizer), lm_eval_module(MODULES[kind])
    with seeded(seed, task, context), quiet():
        if kind == "niah":
            prepare = lm_eval_module("prepare_niah")
            haystack = prepare.get_haystack
            essays = essay_haystack(tokenizer, data_dir) if TASKS[task].haystack == ESSAY_HAYSTACK else None

            def local_haystack(type_haystack):
                return essays if type_haystack == "essay" else haystack(type_haystack)

            def generate(*args, **kwargs):
                return prepare.generate_samples(*args, **{**kwargs, "num_samples": samples})

            with _patched(generator, get_tokenizer=lambda *a, **k: counter, get_haystack=local_haystack,
                          generate_samples=generate), \
                    _patched(prepare, cached_sent_tokenize=_punkt().tokenize):
                try:
                    docs = list(getattr(generator, TASKS[task].yaml)(max_seq_lengths=[context])["test"])
                except ValueError as err:  # nothing fits: lm-eval's message says why
                    raise ValueError(f"evaluation.ruler_contexts: {context} tokens: {err}") from None
        elif kind == "vt":  # vt_utils.get_dataset's two calls, `samples` instead of 500
            icl = generator.sys_vartrack_w_noise_random(tokenizer=counter, num_samples=1, max_seq_length=500,
                                                        incremental=5)[0]
            docs = generator.sys_vartrack_w_noise_random(tokenizer=counter, num_samples=samples,
                                                         max_seq_length=context, icl_example=icl)
        elif kind == "cwe":  # cwe_utils.get_dataset's call
            docs = generator.sys_word_pair_random(num_samples=samples, max_seq_length=context, tokenizer=counter)
        else:  # fwe_utils.get_dataset's call
            docs = generator.sys_kwext(tokenizer=counter, max_seq_length=context, num_samples=samples)
    if len(docs) != samples:
        raise ValueError(f"evaluation.ruler_contexts: lm-eval built {len(docs)} of {samples} {task} samples at {context} "
                         "tokens (the rest did not fit); allowed: a longer context")
    return docs


def prompt_text(tokenizer, task: str, doc: dict, chat_template: bool) -> str:
    """The text the model continues: lm-eval's prompt of `doc` (module docstring)."""
    gen_prefix = doc["gen_prefix"]
    if chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": doc["input"]},
                                              {"role": "assistant", "content": gen_prefix}],
                                             tokenize=False, add_generation_prompt=False, continue_final_message=True)
    from lm_eval.api.utils import requires_delimiter

    delimiter = task_config(task)["target_delimiter"] if requires_delimiter(doc["input"], gen_prefix) else ""
    return doc["input"] + delimiter + gen_prefix


def ruler_samples(tokenizer, tasks: Sequence[str], contexts: Sequence[int], samples: int, seed: int,
                  data_dir: str | Path | None, chat_template: bool) -> list[dict]:
    """Every sample, one dict each with `SAMPLE_KEYS`: "input" is the whole text the model is given
    (chat template applied when `chat_template`, the answer prefix at its end; encode it without
    added special tokens), "gen_prefix" the answer prefix it ends with, "outputs" the gold answers."""
    check_settings(tasks, contexts, samples, seed)
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"evaluation.ruler_prompt=chat, but the tokenizer ({type(tokenizer).__name__}) has no "
                         "chat_template; allowed: plain (lm-eval's base prompt), auto, or a chat tokenizer")
    out = []
    for task in tasks:
        config = task_config(task)
        for context in contexts:
            for doc in task_samples(tokenizer, task, context, samples, seed, data_dir):
                out.append({"task": task, "context": context, "index": int(doc["index"]),
                            "input": prompt_text(tokenizer, task, doc, chat_template), "gen_prefix": doc["gen_prefix"],
                            "outputs": [str(o) for o in doc["outputs"]], "max_gen_toks": config["max_gen_toks"]})
    return out


_CACHE: dict = {}


def cached_samples(tokenizer, tasks, contexts, samples, seed, data_dir, chat_template) -> list[dict]:
    """ruler_samples, built once per tokenizer object and settings in a process (a run's dense
    model and export read the same list; built again, it would be the same)."""
    key = (id(tokenizer), tuple(tasks), tuple(contexts), samples, seed, str(data_dir), chat_template)
    if key not in _CACHE or _CACHE[key][0] is not tokenizer:
        start = time.perf_counter()
        _CACHE[key] = (tokenizer, ruler_samples(tokenizer, tasks, contexts, samples, seed, data_dir, chat_template))
        log.info("RULER: %d samples of %s at %s tokens built in %.1f s", len(_CACHE[key][1]), list(tasks),
                 list(contexts), time.perf_counter() - start)
    return _CACHE[key][1]


def samples_sha256(samples: Sequence[dict]) -> str:
    """One hash of the samples' JSON lines: equal hashes, equal prompts and answers."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(json.dumps({k: sample[k] for k in SAMPLE_KEYS}, sort_keys=True).encode() + b"\n")
    return digest.hexdigest()


# -- scoring a model ----------------------------------------------------------------------------------
def generate(model: nn.Module, tokenizer, sample: dict) -> tuple[str, int]:
    """(the greedy continuation of the sample's input, decoded without special tokens; prompt tokens),
    at most `max_gen_toks` tokens, stopped at the end-of-sequence token. Through `generate()`, so a
    windowed export generates through its windowed cache."""
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=sample["max_gen_toks"], eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer.encode(sample["input"], add_special_tokens=False)], device=device)  # (1, T)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True), ids.shape[1]


def ruler_scores(model: nn.Module, tokenizer, samples: Sequence[dict]) -> dict:
    """RULER scores of `model` on `samples` (its training flag restored): per task and context the
    mean score, the samples' hash and every case (index, prompt tokens, score, prediction);
    `mean_all_tasks` per context."""
    was_training = model.training
    model.eval()
    tasks: dict = {}
    try:
        with torch.inference_mode():
            for sample in samples:
                prediction, tokens = generate(model, tokenizer, sample)
                cell = tasks.setdefault(sample["task"], {}).setdefault(str(sample["context"]), {"cases": [], "_s": []})
                cell["_s"].append(sample)
                cell["cases"].append({"index": sample["index"], "prompt_tokens": tokens,
                                      "score": score(sample["task"], prediction, sample["outputs"]),
                                      "prediction": prediction})
    finally:
        model.train(was_training)
    for task, by_context in tasks.items():
        for context, cell in by_context.items():
            cell["sha256"] = samples_sha256(cell.pop("_s"))
            cell["samples"] = len(cell["cases"])
            cell["score"] = sum(c["score"] for c in cell["cases"]) / len(cell["cases"])
            by_context[context] = {k: cell[k] for k in ("score", "samples", "sha256", "cases")}
    contexts = sorted({c for by_context in tasks.values() for c in by_context}, key=int)
    return {"tasks": tasks, "mean_all_tasks": {c: _mean([tasks[t][c]["score"] for t in tasks if c in tasks[t]])
                                               for c in contexts}}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def floor_means(block: dict, dense: dict) -> dict:
    """The RULER mean of `block` over the tasks where `dense` (the dense model's ruler block) scores
    at least FLOOR, per context, with the tasks left out: {"floor", "mean_dense_at_least_20",
    "below_floor"}."""
    out = {"floor": FLOOR, "mean_dense_at_least_20": {}, "below_floor": {}}
    for context in block["mean_all_tasks"]:
        kept = [t for t in block["tasks"] if context in block["tasks"][t] and t in dense["tasks"]
                and context in dense["tasks"][t] and dense["tasks"][t][context]["score"] >= FLOOR]
        out["below_floor"][context] = sorted(t for t in block["tasks"] if t not in kept)
        out["mean_dense_at_least_20"][context] = _mean([block["tasks"][t][context]["score"] for t in kept])
    return out


def header(tasks: Sequence[str], chat_template: bool) -> dict:
    """results.json `evaluation.ruler`: what each task is (lm-eval's task, haystack, answer tokens, metric)."""
    import lm_eval

    return {"lm_eval": lm_eval.__version__, "chat_template": chat_template, "floor": FLOOR,
            "sentence_splitter": "nltk PunktSentenceTokenizer() with default parameters (essay haystack only)",
            "tasks": {t: {**{k: v for k, v in task_config(t).items() if k != "target_delimiter"},
                          "haystack": TASKS[t].haystack} for t in tasks}}


# -- tables -------------------------------------------------------------------------------------------
def table(models: dict[str, dict], dense: dict | None) -> list[str]:
    """Markdown lines: one row per (model, context) of `models` ({name: an evaluation block's
    `ruler`}), a column per task (its score), the mean over every task, and the RULER mean over the
    tasks where `dense` (the dense model's `ruler`; None: unknown) scores at least FLOOR, with its
    share of dense's; then a line naming the tasks left out. What headprune-collect and the
    experiments' collect scripts show."""
    from headprune.report import DASH, Column, markdown, number

    tasks = list(dict.fromkeys(t for block in models.values() for t in block["tasks"]))
    contexts = sorted({c for block in models.values() for c in block["mean_all_tasks"]}, key=int)
    rows = []
    for name, block in models.items():
        for context in contexts:
            if context not in block["mean_all_tasks"]:
                continue
            kept = floor_means(block, dense)["mean_dense_at_least_20"][context] if dense else None
            base = floor_means(dense, dense)["mean_dense_at_least_20"].get(context) if dense else None
            rows.append({"model": name, "context": context, "mean": block["mean_all_tasks"][context], "kept": kept,
                         "share": kept / base if kept is not None and base else None,
                         **{t: block["tasks"].get(t, {}).get(context, {}).get("score") for t in tasks}})
    columns = [Column("model", lambda r: r["model"], False), Column("context", lambda r: r["context"]),
               *[Column(t, lambda r, t=t: number(r[t], ".2f")) for t in tasks],
               Column("mean, all tasks", lambda r: number(r["mean"], ".3f")),
               Column(f"RULER mean (dense >= {FLOOR:.0%})", lambda r: number(r["kept"], ".3f")),
               Column("/ dense", lambda r: number(r["share"], ".3f"))]
    lines = markdown(columns, rows)
    if dense:
        left = {c: floor_means(dense, dense)["below_floor"][c] for c in dense["mean_all_tasks"]}
        lines += ["", "Left out of the RULER mean (dense below 20%): " + "; ".join(
            f"{c} tokens: {', '.join(names) if names else DASH}" for c, names in left.items())]
    return lines


# -- the samples file ---------------------------------------------------------------------------------
def write_samples(path: str | Path, tokenizer, tasks: Sequence[str], contexts: Sequence[int], samples: int, seed: int,
                  data_dir: str | Path | None, chat_template: bool) -> list[dict]:
    """The samples as JSON lines (keys `SAMPLE_KEYS`), published whole (atomic)."""
    from headprune.atomic import staged_file

    rows = ruler_samples(tokenizer, tasks, contexts, samples, seed, data_dir, chat_template)
    with staged_file(Path(path)) as staged:
        Path(staged).write_text("".join(json.dumps({k: row[k] for k in SAMPLE_KEYS}) + "\n" for row in rows))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m headprune.evaluation.ruler",
                                     description="RULER samples for peers (module docstring)")
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write-samples", help="write the seeded prompts as JSON lines")
    write.add_argument("--model", required=True, help="the model's pretrained source (its tokenizer): smollm2, a folder")
    write.add_argument("--tasks", nargs="+", required=True, help=", ".join(TASKS))
    write.add_argument("--contexts", nargs="+", type=int, default=[4096])
    write.add_argument("--samples", type=int, required=True)
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--no-chat-template", action="store_true", help="the plain prompt (default: chat template)")
    write.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR"),
                       help="the shared data folder (essay haystack; default $HEADPRUNE_DATA_DIR)")
    write.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    from headprune.models.build import load_tokenizer

    check_settings(args.tasks, args.contexts, args.samples, args.seed, "--")
    rows = write_samples(args.out, load_tokenizer(args.model), args.tasks, args.contexts, args.samples, args.seed,
                         args.data_dir, not args.no_chat_template)
    print(f"wrote {len(rows)} samples to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
