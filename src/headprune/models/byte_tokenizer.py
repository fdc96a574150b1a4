"""Byte-level tokenizer: a token id is a UTF-8 byte value (0-255), plus two special tokens.

Why: a causal LM trained from scratch offline needs a vocabulary that nothing has to download.
Bytes cover any text losslessly (`decode(encode(s)) == s`), and 258 ids keep the embedding and
LM head small. Saved next to a model as `headprune_byte_tokenizer.json`, so an exported model
folder names its own tokenizer (`headprune.models.load_tokenizer(<folder>)`).
"""
from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILE = "headprune_byte_tokenizer.json"


class ByteTokenizer:
    """ids 0-255: bytes; 256: end of text (also BOS); 257: padding. vocab_size 258."""

    n_bytes = 256
    eos_token_id = bos_token_id = 256
    pad_token_id = 257
    vocab_size = 258
    special_tokens = {256: "<|endoftext|>", 257: "<pad>"}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes of `text`; with `add_special_tokens`, an end-of-text token first (as a BOS)."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (any iterable of ints, e.g. a 1-D tensor). Invalid UTF-8 (a cut multi-byte
        character) becomes U+FFFD; special tokens are dropped, or written by name when kept."""
        out, run = [], bytearray()
        for i in (int(x) for x in ids):
            if 0 <= i < self.n_bytes:
                run.append(i)
                continue
            if i not in self.special_tokens:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary 0..{self.vocab_size - 1}")
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(self.special_tokens[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __len__(self) -> int:
        return self.vocab_size

    def save_pretrained(self, directory: str | Path) -> tuple[str]:
        """Write the tokenizer's description into `directory` (as HF tokenizers do)."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"type": "bytes", "vocab_size": self.vocab_size,
                                    "special_tokens": {str(k): v for k, v in self.special_tokens.items()}}, indent=2))
        return (str(path),)

    @classmethod
    def saved_in(cls, directory: str | Path) -> bool:
        return (Path(directory) / TOKENIZER_FILE).is_file()

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "ByteTokenizer":
        """The tokenizer saved in `directory` by `save_pretrained`."""
        path = Path(directory) / TOKENIZER_FILE
        saved = json.loads(path.read_text())
        if saved.get("type") != "bytes" or saved.get("vocab_size") != cls.vocab_size:
            raise ValueError(f"{path} describes {saved.get('type')!r} with vocab_size {saved.get('vocab_size')}; "
                             f"this version reads type 'bytes' with vocab_size {cls.vocab_size}")
        return cls()

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"
