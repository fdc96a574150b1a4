"""models/byte_tokenizer.py: the byte-level tokenizer of the tiny GPT-2 (model=tiny_gpt2)."""
import pytest
import torch

from headprune.models import load_tokenizer
from headprune.models.byte_tokenizer import ByteTokenizer


@pytest.mark.parametrize("text", ["", "First Citizen:\nBefore we proceed", "naïve café — 東京 🙂", "\x00\xff tab\t"])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=True)) == text  # BOS dropped on decode
    assert tok.decode(torch.tensor(ids + [tok.pad_token_id])) == text


def test_byte_tokenizer_specials_and_saving(tmp_path):
    tok = ByteTokenizer()
    assert len(tok) == tok.vocab_size == 258 and tok.bos_token_id == tok.eos_token_id == 256
    assert tok.decode([104, 105, 256, 33], skip_special_tokens=False) == "hi<|endoftext|>!"
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character
    with pytest.raises(ValueError, match="outside the byte tokenizer's vocabulary 0..257"):
        tok.decode([300])
    tok.save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer("byte-gpt2"), ByteTokenizer)
