"""Synthetic passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"): a five-digit key
buried at a stated depth of repetitive filler, asked for at the end; accuracy by depth and
context length. Offline and seeded: nothing is downloaded, the same arguments give the same
prompts.

Why: perplexity hardly moves when a head that looks far back is restricted to a recent window
(most next tokens need only the last few hundred), but a key a few thousand tokens back is
then out of reach. This evaluation tells windowed layouts apart where perplexity does not
(DuoAttention's and RazorAttention's "retrieval heads").

A prompt, in tokens (each piece tokenized alone, without special tokens, and concatenated, so
lengths are exact): BOS when the tokenizer has one, the instruction, filler sentences cycling
through `FILLER`, the needle after round(depth x n) of the n filler sentences, the question;
then the answer " <key>". As many filler sentences as fit make prompt + answer at most `length`
tokens. Scoring is teacher-forced, as lm-eval's `acc` of a loglikelihood task: a case is right
when every answer token is the model's argmax after the prompt and the answer tokens before it
(so greedy decoding would write the key). One forward per case.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from headprune.tasks import max_positions

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about it.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class PasskeyCase:
    """One prompt: `prompt` and `answer` token ids, the key, where the needle starts (`needle_at`,
    a token index) and the depth and length it was built for."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    key: str
    depth: float
    length: int
    needle_at: int


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def passkey_case(tokenizer, length: int, depth: float, key: str) -> PasskeyCase:
    """The prompt of at most `length` tokens (prompt + answer) with `key` at `depth` (module docstring)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    head = ([bos] if bos is not None else []) + _encode(tokenizer, INSTRUCTION)
    needle = _encode(tokenizer, " " + NEEDLE.format(key=key))
    question = _encode(tokenizer, " " + QUESTION)
    answer = _encode(tokenizer, ANSWER.format(key=key))
    sentences = [_encode(tokenizer, " " + s) for s in FILLER]
    room = length - len(head) - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ValueError(f"passkey length={length} is too short: the instruction, needle, question and answer alone "
                         f"take {length - room} tokens of this tokenizer; allowed: at least {length - room}")
    filler: list[list[int]] = []
    while room >= len(sentences[len(filler) % len(sentences)]):
        room -= len(sentences[len(filler) % len(sentences)])
        filler.append(sentences[len(filler) % len(sentences)])
    before = round(depth * len(filler))
    start = head + [t for s in filler[:before] for t in s]
    prompt = start + needle + [t for s in filler[before:] for t in s] + question
    return PasskeyCase(tuple(prompt), tuple(answer), key, depth, length, len(start))


def passkey_cases(tokenizer, lengths: Sequence[int], depths: Sequence[float] = DEPTHS, samples: int = 5,
                  seed: int = 0) -> list[PasskeyCase]:
    """`samples` cases per (length, depth), each with its own five-digit key drawn from `seed`."""
    check_passkey(lengths, depths, samples)
    rng = random.Random(seed)
    return [passkey_case(tokenizer, length, depth, f"{rng.randrange(10000, 100000)}")
            for length in lengths for depth in depths for _ in range(samples)]


def answered(model: nn.Module, case: PasskeyCase) -> bool:
    """Whether every answer token is the model's argmax after the prompt (teacher-forced)."""
    device = next(model.parameters()).device
    ids = torch.tensor([case.prompt + case.answer[:-1]], device=device)  # (1, T)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(case.prompt) - 1:]  # (len(answer), V)
    return bool((logits.argmax(-1).cpu() == torch.tensor(case.answer)).all())


def passkey_accuracy(model: nn.Module, tokenizer, lengths: Sequence[int], depths: Sequence[float] = DEPTHS,
                     samples: int = 5, seed: int = 0) -> dict:
    """Passkey accuracy of `model` (its training flag restored): overall, `by_depth`, `by_length`
    ({length: {depth: accuracy}}), and every case's record. Lengths beyond the model's positions
    are refused before any forward."""
    check_passkey(lengths, depths, samples)
    positions = max_positions(model.config)
    if positions and max(lengths) > positions:
        raise ValueError(f"passkey lengths={list(lengths)}: {max(lengths)} exceeds the model's {positions} positions; "
                         f"allowed: at most {positions}")
    cases = passkey_cases(tokenizer, lengths, depths, samples, seed)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            right = [answered(model, case) for case in cases]
    finally:
        model.train(was_training)

    def share(pick) -> float:
        hits = [r for case, r in zip(cases, right) if pick(case)]
        return sum(hits) / len(hits)

    return {"accuracy": sum(right) / len(right),
            "by_depth": {str(d): share(lambda c, d=d: c.depth == d) for d in depths},
            "by_length": {str(n): {str(d): share(lambda c, n=n, d=d: c.length == n and c.depth == d) for d in depths}
                          for n in lengths},
            "lengths": list(lengths), "depths": list(depths), "samples": samples, "seed": seed,
            "bos": getattr(tokenizer, "bos_token_id", None) is not None,
            "cases": [{"length": c.length, "depth": c.depth, "tokens": len(c.prompt) + len(c.answer),
                       "needle_at": c.needle_at, "key": c.key, "correct": r} for c, r in zip(cases, right)]}


def check_passkey(lengths: Sequence[int], depths: Sequence[float], samples: int) -> None:
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"passkey lengths={list(lengths)!r} must be a non-empty list of token counts >= 1")
    if not depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in depths):
        raise ValueError(f"passkey depths={list(depths)!r} must be a non-empty list of shares in [0, 1]")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"passkey samples={samples!r} must be an integer >= 1")
