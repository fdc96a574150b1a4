"""Greedy chat answers: equal to a hand-written greedy loop over the chat template on a tiny
model, deterministic, and the real SmolLM2 names Paris."""
import pytest
import torch

from headprune.evaluation import PROMPTS, generate_answers
from headprune.evaluation.generation import chat_inputs
from tests.helpers import smollm2, tiny_chat_lm, tiny_tokenizer


def greedy(model, tok, prompt: str, max_new_tokens: int) -> str:
    """Argmax next token, one at a time, from the full sequence each step; stop at EOS."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    new = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            token = model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax().item()
        if token == tok.eos_token_id:
            break
        new.append(token)
    return tok.decode(new, skip_special_tokens=True).strip()


def test_answers_are_the_greedy_continuation_of_the_chat_prompt():
    tok = tiny_tokenizer()
    model = tiny_chat_lm(tok).train()
    prompts = ["What is the capital of France?", "Hi"]
    answers = generate_answers(model, tok, prompts, max_new_tokens=6)
    assert model.training
    assert [a["prompt"] for a in answers] == prompts
    assert [a["answer"] for a in answers] == [greedy(model.eval(), tok, p, 6) for p in prompts]
    assert generate_answers(model, tok, prompts, max_new_tokens=6) == answers  # deterministic


def test_the_template_adds_the_assistant_turn_and_no_second_bos():
    tok = tiny_tokenizer()
    ids = chat_inputs(tok, "Hi")[0].tolist()
    assert tok.decode(ids) == "<s>user: Hi</s><s>assistant:"
    assert ids.count(tok.bos_token_id) == 2


def test_settings_errors_name_the_field():
    tok = tiny_tokenizer()
    model = tiny_chat_lm(tok)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate_answers(model, tok, max_new_tokens=0)


def test_a_tokenizer_without_a_chat_template_is_prompted_in_plain_text():
    """A base model's tokenizer (no chat template, as Gemma-3-270M's GGUF): the prompt as plain text
    after the tokenizer's BOS, and each answer says so."""
    from headprune.evaluation.generation import PLAIN

    tok = tiny_tokenizer()
    model = tiny_chat_lm(tok)
    tok.chat_template = None
    ids = chat_inputs(tok, "Hi")[0].tolist()
    assert tok.decode(ids) == tok.decode(tok.encode(PLAIN.format(prompt="Hi"))) and "Question: Hi" in tok.decode(ids)
    answers = generate_answers(model, tok, ["Hi"], max_new_tokens=3)
    assert answers[0]["format"] == "plain" and answers[0]["prompt"] == "Hi"


@pytest.mark.real_model
def test_smollm2_names_paris():
    model, tokenizer = smollm2()
    answers = generate_answers(model, tokenizer, PROMPTS[:1], max_new_tokens=16)
    assert answers == [{"prompt": "What is the capital of France?", "answer": "The capital of France is Paris."}]
