"""Passkey retrieval (evaluation/retrieval.py): prompt construction and teacher-forced scoring,
checked on the byte tokenizer with oracle models and once end to end on a tiny random Llama."""
import pytest
import torch
import transformers as tf
from torch import nn

from headprune.evaluation.retrieval import (FILLER, NEEDLE, QUESTION, answered, passkey_accuracy, passkey_case,
                                            passkey_cases)
from headprune.models.byte_tokenizer import ByteTokenizer
from tests.helpers import llama_config, tiny_byte_llama

TOK = ByteTokenizer()


class Oracle(nn.Module):
    """Logits that put each position's maximum on the true next token of its case (prompt +
    answer), except for the cases whose key is in `wrong`, whose last answer token it misses."""

    def __init__(self, cases, wrong=()):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.config = llama_config(max_position_embeddings=512)  # passkey_accuracy reads its positions
        self.truth = {case.prompt: list(case.prompt + case.answer) for case in cases}
        self.wrong = set(wrong)
        self.keys = {case.prompt: case.key for case in cases}

    def forward(self, input_ids, use_cache=False):
        prompt = next(p for p in self.truth if tuple(input_ids[0, :len(p)].tolist()) == p)
        truth = list(self.truth[prompt])
        if self.keys[prompt] in self.wrong:
            truth[-1] = (truth[-1] + 1) % ByteTokenizer.vocab_size
        logits = torch.zeros(1, input_ids.shape[1], ByteTokenizer.vocab_size)
        logits[0, torch.arange(input_ids.shape[1]), torch.tensor(truth[1:input_ids.shape[1] + 1])] = 1.0
        return tf.modeling_outputs.CausalLMOutput(logits=logits)


def test_prompts_fill_the_length_and_bury_the_key_at_its_depth():
    longest = max(len(TOK.encode(" " + s)) for s in FILLER)
    needle = TOK.encode(" " + NEEDLE.format(key="12345"))
    shallow, middle, deep = (passkey_case(TOK, 400, d, "12345") for d in (0.0, 0.5, 1.0))
    for case in (shallow, middle, deep):
        total = len(case.prompt) + len(case.answer)
        assert 400 - longest < total <= 400 and case.prompt[0] == TOK.bos_token_id
        assert list(case.prompt[case.needle_at:case.needle_at + len(needle)]) == needle
        assert TOK.decode(case.prompt).count("12345") == 2 and TOK.decode(case.answer) == " 12345"
        assert TOK.decode(case.prompt).endswith(" " + QUESTION)
    assert shallow.needle_at < middle.needle_at < deep.needle_at
    assert deep.needle_at + len(needle) + len(TOK.encode(" " + QUESTION)) == len(deep.prompt)  # just before it
    assert TOK.decode(shallow.prompt[:shallow.needle_at]).endswith("I will quiz you about it.")
    cases = passkey_cases(TOK, [300, 400], [0.0, 1.0], samples=3, seed=7)
    assert len(cases) == 12 and len({c.key for c in cases}) == 12 and all(len(c.key) == 5 for c in cases)
    assert [c.key for c in passkey_cases(TOK, [300, 400], [0.0, 1.0], samples=3, seed=7)] == [c.key for c in cases]


def test_scoring_is_teacher_forced_on_the_answer_tokens():
    """An oracle of the true tokens is right; one that misses only the key's last digit is wrong,
    and accuracy by depth counts exactly the cases it misses."""
    cases = passkey_cases(TOK, [300], [0.0, 0.5, 1.0], samples=2, seed=1)
    assert all(answered(Oracle(cases), case) for case in cases)
    missed = [c.key for c in cases if c.depth == 0.5]
    assert not any(answered(Oracle(cases, wrong=missed), case) for case in cases if case.depth == 0.5)
    result = passkey_accuracy(Oracle(cases, wrong=missed), TOK, [300], [0.0, 0.5, 1.0], samples=2, seed=1)
    assert result["by_depth"] == {"0.0": 1.0, "0.5": 0.0, "1.0": 1.0} and result["accuracy"] == pytest.approx(2 / 3)
    assert result["by_length"] == {"300": result["by_depth"]} and len(result["cases"]) == 6 and result["bos"]


def test_a_tiny_llama_runs_and_bad_settings_are_refused():
    model = tiny_byte_llama(max_position_embeddings=512)
    result = passkey_accuracy(model, TOK, [260, 320], [0.0, 1.0], samples=1)
    assert 0.0 <= result["accuracy"] <= 1.0 and set(result["by_length"]) == {"260", "320"}
    assert [c["tokens"] <= c["length"] for c in result["cases"]] == [True] * 4
    with pytest.raises(ValueError, match="1024 exceeds the model's 512 positions"):
        passkey_accuracy(model, TOK, [1024])
    with pytest.raises(ValueError, match="length=100 is too short"):
        passkey_accuracy(model, TOK, [100])
    with pytest.raises(ValueError, match=r"depths=\[1.5\] must be a non-empty list of shares in \[0, 1\]"):
        passkey_accuracy(model, TOK, [300], [1.5])


def test_a_passkey_length_too_short_for_the_tokenizer_is_refused_with_the_model_check(tmp_path):
    """`evaluation.passkey_lengths` shorter than the instruction, needle, question and answer: refused by
    `EvaluationSettings.check_model`, which a run calls before its run dir is written (.hydra/, csv/,
    train.log), not by the evaluation after the run (issue 56)."""
    from types import SimpleNamespace

    from headprune.evaluation.llm_suite import EvaluationSettings

    tok = ByteTokenizer()
    model = SimpleNamespace(config=llama_config(tok, max_position_embeddings=512))
    data = SimpleNamespace(tokenizer=tok, held_out_ids=list(range(1000)), data_dir=str(tmp_path), name="x")
    settings = EvaluationSettings(enabled=True, perplexity_tokens=64, perplexity_seqs=[32], passkey_lengths=[16, 300], zero_shot_tasks=[],
                                  passkey_samples=1)
    with pytest.raises(ValueError, match=r"evaluation\.passkey_lengths: passkey length=16 is too short.*allowed: at "
                                         r"least \d+"):
        settings.check_model(model, data)
    EvaluationSettings(enabled=True, perplexity_tokens=64, perplexity_seqs=[32], passkey_lengths=[300], zero_shot_tasks=[],
                       passkey_samples=1).check_model(model, data)
