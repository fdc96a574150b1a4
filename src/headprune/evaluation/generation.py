"""Greedy answers of a chat model to a fixed list of prompts: a quick look at what pruning did
to the model's behaviour that a perplexity or an accuracy does not show (a model can keep its
perplexity and start to ramble, or answer in the wrong language).

Each prompt is one user turn through the tokenizer's chat template with the generation prompt
added (a tokenizer without one, a base model's such as Gemma-3-270M's: the prompt as plain text,
`PLAIN`, and the answer records `"format": "plain"`), answered alone (no padding) with greedy decoding, so answers are deterministic and do
not depend on which other prompts are asked.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from transformers import GenerationConfig

PROMPTS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is 7 plus 5?",
    "Name a colour of the rainbow.",
    "Write one sentence about the sea.",
)


PLAIN = "Question: {prompt}\nAnswer:"  # a prompt for a tokenizer without a chat template (a base model)


def chat_inputs(tokenizer, prompt: str) -> torch.Tensor:
    """(1, T) token ids of `prompt` as one user turn, ending with the assistant's turn opening;
    without a chat template, `PLAIN` with the tokenizer's own special tokens (its BOS)."""
    if not getattr(tokenizer, "chat_template", None):
        return torch.tensor([tokenizer.encode(PLAIN.format(prompt=prompt))], dtype=torch.long)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    # the template writes any BOS itself
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.long)


def generate_answers(model: nn.Module, tokenizer, prompts: Sequence[str] = PROMPTS,
                     max_new_tokens: int = 32) -> list[dict]:
    """[{"prompt", "answer"}]: greedy continuations of at most `max_new_tokens` tokens, stopping
    at the tokenizer's end-of-sequence token, decoded without special tokens and stripped. The
    model is run in eval mode; its training flag is restored."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    answers = []
    try:
        with torch.inference_mode():
            for prompt in prompts:
                ids = chat_inputs(tokenizer, prompt).to(device)  # (1, T)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
                answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()  # new tokens only
                answers.append({"prompt": prompt, "answer": answer}
                               | ({} if getattr(tokenizer, "chat_template", None) else {"format": "plain"}))
    finally:
        model.train(was_training)
    return answers
