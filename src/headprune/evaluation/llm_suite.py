"""The LLM evaluation suite of a causal-LM run (the `evaluation:` block, whose fields and defaults
are `EvaluationSettings`: the one source, train.yaml only lists its schema), on the dense model
before pruning and on the exported one, written to results.json `evaluation`.

Which model each number is of: `evaluation.dense` is the dense model as loaded, in memory
(`source: in_memory_dense`); `evaluation.pruned` is the saved export, loaded from its folder as a
user loads it (`source: export`, `model`: the folder), so a save bug cannot hide behind the
in-memory model. The run's `val` numbers (`baseline.val`, each round's, and `final.val`: the
headline and the sweep objective) are the causal-LM Task's evaluation (`CausalLM.evaluate`) of the
model in the run's memory, masked (`final.val_source: in_memory_masked`).

- `perplexity.seq<N>`: perplexity in non-overlapping windows of each `perplexity_seqs` length
  over the first `perplexity_tokens` tokens of the held-out text (the data module's validation
  tail: the same tokens for every arm of an experiment and every window length: when the lengths
  do not all divide perplexity_tokens, the largest multiple of their least common multiple within
  it, warned and recorded as `evaluation.perplexity_tokens_used`), `bos` saying whether each
  window starts with BOS; `evaluation.val` names the windows and BOS rule of the run's `val`
  perplexity, which the same implementation (the causal-LM Task's `evaluate`, through
  `evaluation.perplexity`) computes on the validation blocks;
- `perplexity_other.<corpus>.seq<N>`: the same windows, seqs, token count and BOS rule on the
  held-out part of each of `other_corpora` (headprune.data.corpora: `sst2` = SST-2's validation
  sentences, newline-joined), text the run did not calibrate on: a repair that overfits the
  calibration corpus shows here (issue 30);
- zero-shot accuracy on `zero_shot_tasks` through lm-eval-harness, with chance level
  (`sst2_local` ships with headprune; any lm-eval task name runs where a network is available);
- greedy answers to fixed chat prompts (`generate`);
- `passkey`: synthetic passkey retrieval (headprune.evaluation.retrieval) at each of
  `passkey_lengths` tokens and `passkey_depths`, `passkey_samples` keys each (none when the
  lengths are empty): what separates windowed KV layouts where perplexity does not;
- `ruler`: RULER (headprune.evaluation.ruler: lm-eval's own task code, offline, the essay
  variants on Tiny Shakespeare's training part) on `ruler_tasks` at each of `ruler_contexts`,
  `ruler_samples` seeded samples each (`ruler_seed`; none when the tasks are empty): per task and
  context the score and every case, `mean_all_tasks`, and once the dense model's scores are in
  the results, `mean_dense_at_least_20` (the RULER mean: the tasks where dense scores >= 20%) with
  the tasks left out. The samples are built once, when the settings are checked against the
  model's tokenizer (before any work), and the dense model and the export are scored on the same
  ones (`sha256` per task and context says so).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from headprune.data.corpora import check_corpora, corpus_file, corpus_ids
from headprune.tasks import CAUSAL_LM, Task, max_positions

log = logging.getLogger(__name__)


@dataclass
class EvaluationSettings:
    """`evaluation:` settings and their defaults, the one place they are written (the Hydra
    schema `schema/evaluation` is this class, so a misspelt field fails at compose).
    experiment=llm_kv turns the block on."""

    enabled: bool = False
    dense: bool = True  # evaluate the dense model too (an experiment's arms share one dense run)
    perplexity_seqs: List[int] = field(default_factory=lambda: [128, 2048])  # window lengths
    perplexity_tokens: int = 8192  # held-out tokens every window length covers (the first ones)
    bos: bool = True  # each window starts with the tokenizer's BOS
    other_corpora: List[str] = field(default_factory=list)  # perplexity_other on these (data.corpora)
    batch_size: int = 4
    zero_shot_tasks: List[str] = field(default_factory=lambda: ["sst2_local"])  # local tasks or lm-eval names
    zero_shot_limit: Optional[int] = None  # the first n documents of each task (null: all)
    generate: bool = True  # greedy answers to the fixed chat prompts
    max_new_tokens: int = 32
    passkey_lengths: List[int] = field(default_factory=list)  # passkey retrieval at these lengths ([]: none)
    passkey_depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_samples: int = 5  # keys per (length, depth)
    ruler_tasks: List[str] = field(default_factory=list)  # RULER tasks (evaluation.ruler.TASKS; []: none)
    ruler_contexts: List[int] = field(default_factory=lambda: [4096])  # prompt + answer tokens of each sample
    ruler_samples: int = 20  # samples per task and context
    ruler_seed: int = 0  # the samples' seed (the same for the dense model and the export)
    ruler_prompt: str = "auto"  # chat: one user turn of the tokenizer's chat template; plain: lm-eval's base prompt; auto: chat where the tokenizer has a template

    def check(self, task: Task) -> None:
        """Refuse, before any work, settings that cannot run: the suite is the causal-LM Task's."""
        if not self.enabled:
            return
        if task is not CAUSAL_LM:
            raise ValueError(f"evaluation.enabled=true evaluates causal LMs, but model.task={task.name}; allowed: "
                             "evaluation.enabled=false, or a model.task=causal_lm run")
        if not self.perplexity_seqs:
            raise ValueError("evaluation.perplexity_seqs=[] names no window length; allowed: a non-empty list of "
                             "integers >= 2 (e.g. [128, 2048])")
        for seq in self.perplexity_seqs:
            if not isinstance(seq, int) or not 2 <= seq <= self.perplexity_tokens:
                raise ValueError(f"evaluation.perplexity_seqs: {seq!r} must be an integer in 2..perplexity_tokens "
                                 f"({self.perplexity_tokens})")
        used = self.tokens_used()
        if used == 0:
            common = math.lcm(*self.perplexity_seqs)
            raise ValueError(f"evaluation.perplexity_tokens={self.perplexity_tokens} holds no whole number of windows of "
                             f"every length in evaluation.perplexity_seqs {list(self.perplexity_seqs)}, so each length "
                             f"would cover different tokens; allowed: perplexity_tokens >= {common} (their least "
                             f"common multiple; a multiple of it uses every token), or lengths that divide it")
        if used != self.perplexity_tokens:
            log.warning("evaluation: every window length covers the same first %d held-out tokens (the largest multiple "
                        "of %d, the least common multiple of perplexity_seqs %s), not perplexity_tokens=%d",
                        used, math.lcm(*self.perplexity_seqs), list(self.perplexity_seqs), self.perplexity_tokens)
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("evaluation.batch_size and evaluation.max_new_tokens must be >= 1")
        if self.zero_shot_limit is not None and self.zero_shot_limit < 1:
            raise ValueError(f"evaluation.zero_shot_limit={self.zero_shot_limit} must be >= 1 or null")
        check_corpora(self.other_corpora, "evaluation.other_corpora")
        if self.passkey_lengths:
            from headprune.evaluation.retrieval import check_passkey

            try:
                check_passkey(self.passkey_lengths, self.passkey_depths, self.passkey_samples)
            except ValueError as err:
                raise ValueError(f"evaluation.passkey_lengths / passkey_depths / passkey_samples: {err}") from None
        if self.zero_shot_tasks:
            from headprune.evaluation.zero_shot import check_tasks

            check_tasks(self.zero_shot_tasks, "evaluation.zero_shot_tasks")
        from headprune.evaluation.ruler import check_settings

        check_settings(self.ruler_tasks, self.ruler_contexts, self.ruler_samples, self.ruler_seed)
        if self.ruler_prompt not in RULER_PROMPTS:
            raise ValueError(f"evaluation.ruler_prompt={self.ruler_prompt!r} is not allowed; allowed: "
                             f"{', '.join(RULER_PROMPTS)}")

    def tokens_used(self) -> int:
        """The tokens every window length covers: the largest multiple of the lengths' least common
        multiple within perplexity_tokens (all of them when it is one), so every `seq<N>` record of
        a model is over the same tokens; 0 when there is none."""
        common = math.lcm(*self.perplexity_seqs)
        return self.perplexity_tokens // common * common

    def check_model(self, model, datamodule) -> None:
        """The longest window fits the model's positions and the held-out text."""
        if not self.enabled:
            return
        if self.zero_shot_tasks:
            from headprune.evaluation.zero_shot import check_local_data

            check_local_data(self.zero_shot_tasks, datamodule.data_dir, "evaluation.zero_shot_tasks")
        positions = max_positions(model.config)
        longest = max(self.perplexity_seqs) + int(self.bos)
        if positions and longest > positions:
            raise ValueError(f"evaluation.perplexity_seqs: {max(self.perplexity_seqs)} tokens (+ BOS) exceed the model's "
                             f"{positions} positions; allowed: at most {positions - int(self.bos)}")
        if self.passkey_lengths and positions and max(self.passkey_lengths) > positions:
            raise ValueError(f"evaluation.passkey_lengths: {max(self.passkey_lengths)} exceeds the model's {positions} "
                             f"positions; allowed: at most {positions}")
        if self.passkey_lengths:  # each length holds the instruction, needle, question and answer in this tokenizer
            from headprune.evaluation.retrieval import passkey_cases

            try:
                passkey_cases(datamodule.tokenizer, sorted(set(self.passkey_lengths)), self.passkey_depths[:1], 1)
            except ValueError as err:
                raise ValueError(f"evaluation.passkey_lengths: {err}") from None
        if self.ruler_tasks:
            self.check_ruler(datamodule.tokenizer, positions, datamodule.data_dir)
        held = len(datamodule.held_out_ids)
        if held < self.perplexity_tokens:
            raise ValueError(f"evaluation.perplexity_tokens={self.perplexity_tokens} exceeds the {held} held-out tokens "
                             f"of data={datamodule.name}; allowed: at most {held}")
        for name in self.other_corpora:
            held = len(corpus_ids(name, "held_out", datamodule.tokenizer, datamodule.data_dir, "evaluation.other_corpora"))
            if held < self.perplexity_tokens:
                raise ValueError(f"evaluation.perplexity_tokens={self.perplexity_tokens} exceeds the {held} held-out "
                                 f"tokens of evaluation.other_corpora {name!r}; allowed: at most {held}")


    def check_ruler(self, tokenizer, positions: int | None, data_dir) -> list[dict]:
        """The RULER samples, built here (once: `ruler.cached_samples`), so a context too short for a
        task, a missing haystack or chat template is refused before any work; every prompt plus its
        answer tokens fits the model's positions."""
        if positions and max(self.ruler_contexts) > positions:
            raise ValueError(f"evaluation.ruler_contexts: {max(self.ruler_contexts)} exceeds the model's {positions} "
                             f"positions; allowed: at most {positions}")
        samples = self.ruler_samples_of(tokenizer, data_dir)
        longest = max(len(tokenizer.encode(s["input"], add_special_tokens=False)) + s["max_gen_toks"] for s in samples)
        if positions and longest > positions:
            raise ValueError(f"evaluation.ruler_contexts: the longest RULER prompt with its answer takes {longest} tokens "
                             f"(the chat template's tokens beyond the context), more than the model's {positions} "
                             f"positions; allowed: contexts at most {positions - (longest - max(self.ruler_contexts))}")
        return samples

    def ruler_samples_of(self, tokenizer, data_dir) -> list[dict]:
        """The seeded RULER samples of these settings for `tokenizer` (built once per process)."""
        from headprune.evaluation.ruler import cached_samples

        return cached_samples(tokenizer, self.ruler_tasks, self.ruler_contexts, self.ruler_samples, self.ruler_seed,
                              data_dir, self.ruler_chat(tokenizer))

    def ruler_chat(self, tokenizer) -> bool:
        """Whether RULER's prompts go through `tokenizer`'s chat template (`ruler_prompt`; auto: an
        instruct model's tokenizer carries a template, a base model's, e.g. Gemma-3-270M's, none)."""
        if self.ruler_prompt not in RULER_PROMPTS:
            raise ValueError(f"evaluation.ruler_prompt={self.ruler_prompt!r} is not allowed; allowed: "
                             f"{', '.join(RULER_PROMPTS)}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.ruler_prompt == "chat" and not has_template:
            raise ValueError(f"evaluation.ruler_prompt=chat, but the tokenizer ({type(tokenizer).__name__}) has no "
                             "chat_template; allowed: plain (lm-eval's base prompt), auto, or a chat tokenizer")
        return self.ruler_prompt == "chat" or (self.ruler_prompt == "auto" and has_template)


RULER_PROMPTS = ("auto", "chat", "plain")  # evaluation.ruler_prompt
SOURCES = {"dense": "in_memory_dense", "pruned": "export"}  # evaluation.<which>.source: the model each reads


def header(options: EvaluationSettings, datamodule) -> dict:
    """results.json `evaluation` before any model is evaluated: the settings, and `val`: the
    windows and BOS rule of the run's `val` perplexity (the same implementation as the
    perplexities here, on the data module's validation blocks, without BOS)."""
    head = {"settings": asdict(options), "perplexity_tokens_used": options.tokens_used(),
            "val": datamodule.val_windows()}
    if options.ruler_tasks:
        from headprune.evaluation.ruler import header as ruler_header

        head["ruler"] = ruler_header(options.ruler_tasks, options.ruler_chat(datamodule.tokenizer))
    if options.other_corpora:
        head["other_corpora"] = {name: str(corpus_file(name, "held_out", datamodule.data_dir, "evaluation.other_corpora"))
                                 for name in options.other_corpora}
    return head


def evaluate_llm(model, tokenizer, datamodule, options: EvaluationSettings, data_dir: str | None) -> dict:
    """Every evaluation of the module docstring on `model`, with the seconds each took."""
    from headprune.evaluation.generation import generate_answers
    from headprune.evaluation.perplexity import Windows, perplexity
    from headprune.evaluation.zero_shot import zero_shot

    out: dict = {"perplexity": {}, "seconds": {}}
    bos = tokenizer.bos_token_id if options.bos else None

    def perplexities(ids) -> dict:
        used = options.tokens_used()
        return {f"seq{seq}": perplexity(model, Windows.cut(ids, seq, bos, used), options.batch_size)
                for seq in options.perplexity_seqs}

    start = time.perf_counter()
    out["perplexity"] = perplexities(datamodule.held_out_ids)
    out["seconds"]["perplexity"] = round(time.perf_counter() - start, 3)
    if options.other_corpora:
        start = time.perf_counter()
        out["perplexity_other"] = {
            name: perplexities(corpus_ids(name, "held_out", tokenizer, data_dir, "evaluation.other_corpora"))
            for name in options.other_corpora}
        out["seconds"]["perplexity_other"] = round(time.perf_counter() - start, 3)
    if options.zero_shot_tasks:
        start = time.perf_counter()
        out["zero_shot"] = zero_shot(model, tokenizer, options.zero_shot_tasks, data_dir=data_dir,
                                     limit=options.zero_shot_limit, batch_size=options.batch_size)
        out["seconds"]["zero_shot"] = round(time.perf_counter() - start, 3)
    if options.passkey_lengths:
        from headprune.evaluation.retrieval import passkey_accuracy

        start = time.perf_counter()
        out["passkey"] = passkey_accuracy(model, tokenizer, options.passkey_lengths, options.passkey_depths,
                                          options.passkey_samples)
        out["seconds"]["passkey"] = round(time.perf_counter() - start, 3)
    if options.ruler_tasks:
        from headprune.evaluation.ruler import ruler_scores

        start = time.perf_counter()
        out["ruler"] = ruler_scores(model, tokenizer, options.ruler_samples_of(tokenizer, data_dir))
        out["seconds"]["ruler"] = round(time.perf_counter() - start, 3)
    if options.generate:
        start = time.perf_counter()
        out["generation"] = generate_answers(model, tokenizer, max_new_tokens=options.max_new_tokens)
        out["seconds"]["generation"] = round(time.perf_counter() - start, 3)
    log.info("evaluation: %s", {k: v["ppl"] for k, v in out["perplexity"].items()}
             | {f"{c}/{k}": v["ppl"] for c, seqs in out.get("perplexity_other", {}).items() for k, v in seqs.items()}
             | {k: v["acc"] for k, v in out.get("zero_shot", {}).items()}
             | {f"ruler/{c}": v for c, v in out.get("ruler", {}).get("mean_all_tasks", {}).items()})
    return out


def ruler_floor(block: dict) -> None:
    """Once results.json `evaluation` holds the dense model's RULER scores: the RULER mean over the
    tasks where dense scores at least 20%, added to the dense and the pruned blocks (`ruler.floor_means`)."""
    from headprune.evaluation.ruler import floor_means

    dense = block.get("dense", {}).get("ruler")
    if dense is None:
        return
    for which in ("dense", "pruned"):
        if "ruler" in block.get(which, {}):
            block[which]["ruler"].update(floor_means(block[which]["ruler"], dense))
