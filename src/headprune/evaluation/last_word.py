"""LAMBADA-style last-word passages from held-out text of both local corpora, for the
`last_word_local` zero-shot task (tasks/last_word_local.yaml).

Why: SST-2 two-choice is at chance for SmolLM2-135M (dense 0.560 on 200 sentences, random-score
arms 0.46-0.565, issue 30), so it cannot tell a good prune from a bad one. Predicting the last
word of a real passage greedily (every token of " word" the model's argmax, lm-eval's `acc` of a
`loglikelihood` task, as in its `lambada_openai`) degrades with the model, on text no run
calibrates or trains on. Unlike LAMBADA the passages are not filtered by people for a word that
needs the whole passage, so the accuracy is lower; it still separates models.

Passages, in a fixed order (`passages`):
- `tinyshakespeare`: every line end of the second half of the corpus's held-out part
  (characters from `held_out_start`; the first half holds the evaluation's perplexity windows,
  and the char and token cuts of subword tokenizers differ by a few thousand characters) whose
  last word (letters only, trailing punctuation dropped) follows a space; the context is the
  whole lines before it, at most 600 characters and at least 30 words;
- `sst2`: SST-2 validation sentences (held out from calibration on `sst2`, which reads the
  train file) with at least 8 words before the last word; trailing punctuation tokens dropped
  (the sentences are tokenized: "... journey ." -> context "...", target " journey").
The two are interleaved one by one (then the rest of the longer list), so the first n documents
(`evaluation.zero_shot_limit`) hold both corpora.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from headprune.data.corpora import SHAKESPEARE_VALIDATION_SHARE, corpus_file, sst2_sentences
from headprune.data.language_model import held_out_start

WORD = re.compile(r"[A-Za-z]+")
CONTEXT_CHARS = 600  # a Shakespeare passage's context: whole lines, at most this long
CONTEXT_WORDS = 30  # ... and at least this many words
SENTENCE_CONTEXT_WORDS = 8  # words before an SST-2 sentence's last word, at least
FIELD = "zero_shot task 'last_word_local'"


def shakespeare_passages(text: str) -> list[dict]:
    """{"context", "target", "corpus"} for each line end of the held-out part's second half whose
    last word follows a space (not a speaker's name), with the preceding whole lines of at most
    `CONTEXT_CHARS` characters (and at least `CONTEXT_WORDS` words) as context."""
    held = text[held_out_start(len(text), SHAKESPEARE_VALIDATION_SHARE):]
    part = held[len(held) // 2:]
    part = part[part.index("\n") + 1:]  # from a line start
    starts = [0] + [m.end() for m in re.finditer("\n", part)]  # line starts
    out = []
    for i, (start, end) in enumerate(zip(starts, starts[1:])):
        line = part[start:end - 1].rstrip(".,;:!?'\"- ")
        match = re.search(r" ([A-Za-z]+)$", line)
        if not match:
            continue
        target_at = start + match.start()
        first = next((s for s in starts[:i + 1] if target_at - s <= CONTEXT_CHARS), None)
        context = part[first:target_at] if first is not None else ""
        if len(context.split()) >= CONTEXT_WORDS:
            out.append({"context": context, "target": " " + match.group(1), "corpus": "tinyshakespeare"})
    return out


def sst2_passages(sentences: list[str]) -> list[dict]:
    """{"context", "target", "corpus"} for each SST-2 sentence with enough words."""
    out = []
    for sentence in sentences:
        words = sentence.split()
        while words and not WORD.fullmatch(words[-1]):
            words.pop()
        if len(words) <= SENTENCE_CONTEXT_WORDS:
            continue
        out.append({"context": " ".join(words[:-1]), "target": " " + words[-1], "corpus": "sst2"})
    return out


def interleave(*lists: list) -> list:
    """One item of each list in turn, then what remains of the longer ones."""
    out = []
    for i in range(max(map(len, lists))):
        out += [items[i] for items in lists if i < len(items)]
    return out


def passages(data_dir: Path) -> list[dict]:
    """Every passage of the task, in its fixed order (see the module doc)."""
    text = corpus_file("tinyshakespeare", "held_out", data_dir, FIELD).read_text(encoding="utf-8")
    sentences = sst2_sentences(corpus_file("sst2", "held_out", data_dir, FIELD))
    return interleave(shakespeare_passages(text), sst2_passages(sentences))


def last_word_jsonl(data_dir: Path) -> str:
    """The task's data file: one JSON line {"context", "target", "corpus"} per passage."""
    return "".join(json.dumps(p) + "\n" for p in passages(data_dir))
