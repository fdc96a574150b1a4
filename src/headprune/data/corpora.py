"""Named plain-text corpora of the shared data folder, each with a training part and a held-out part.

Why: the evaluation measures perplexity on a corpus that was not calibrated on (issue 30's
overfitting guard), calibration may mix corpora (`data.calibration_corpora`), and the last-word
task is built from held-out passages of them; all three must agree on which text is held out.

- `tinyshakespeare`: `<data_dir>/tinyshakespeare/input.txt`, one running text split by position
  as `TextLMDataModule` splits it (`held_out_start`, validation_share 0.1 as in
  conf/data/tinyshakespeare.yaml): the first 90% of the tokens train, the rest is held out.
- `sst2`: SST-2's sentences (`<data_dir>/sst2/*.tsv`, one sentence a line, newline-joined):
  the GLUE train file is the training part, the validation file (872 sentences) the held-out part.
"""
from __future__ import annotations

from pathlib import Path

import torch

from headprune.data.language_model import held_out_start, tokenize_corpus
from headprune.data.textdata import read_table

SHAKESPEARE_VALIDATION_SHARE = 0.1  # conf/data/tinyshakespeare.yaml
FILES = {"tinyshakespeare": {"train": "tinyshakespeare/input.txt", "held_out": "tinyshakespeare/input.txt"},
         "sst2": {"train": "sst2/train.tsv", "held_out": "sst2/validation.tsv"}}
CORPORA = tuple(FILES)
PARTS = ("train", "held_out")


def check_corpora(names, field: str) -> list[str]:
    """`names` as a list, or an error naming `field` and the allowed corpora (unknown or repeated)."""
    names = list(names or [])
    unknown = [n for n in names if n not in CORPORA]
    if unknown or len(set(names)) != len(names):
        what = f"unknown {unknown}" if unknown else "a corpus named twice"
        raise ValueError(f"{field}={names}: {what}; allowed: a list of distinct names from {', '.join(CORPORA)}")
    return names


def corpus_file(name: str, part: str, data_dir: str | Path | None, field: str) -> Path:
    """The file holding `part` of corpus `name`, or an error naming `field`, the file and the data folder."""
    check_corpora([name], field)
    if part not in PARTS:
        raise ValueError(f"part={part!r}; allowed: {', '.join(PARTS)}")
    if not data_dir:
        raise ValueError(f"{field}: corpus {name!r} is read from the shared data folder, but no data_dir is set; allowed: "
                         "data.data_dir or HEADPRUNE_DATA_DIR pointing at it (e.g. ../shared/data)")
    path = Path(data_dir).expanduser() / FILES[name][part]
    if not path.is_file():
        raise FileNotFoundError(f"{field}: corpus {name!r} needs {path} (data_dir={str(data_dir)!r}); see "
                                "../shared/data/README.md")
    return path


def sst2_sentences(path: Path) -> list[str]:
    """The stripped sentences of an SST-2 TSV file, in file order."""
    return [s.strip() for s in read_table(path, "sentence", "label").texts]


def corpus_text(name: str, part: str, data_dir: str | Path | None, field: str = "corpus") -> str:
    """The text of `part` of a file-split corpus (sst2), or the whole running text of a corpus
    split by position (tinyshakespeare: its parts are cut in tokens, see `corpus_ids`)."""
    path = corpus_file(name, part, data_dir, field)
    if name == "sst2":
        return "\n".join(sst2_sentences(path))
    return path.read_text(encoding="utf-8")


def corpus_ids(name: str, part: str, tokenizer, data_dir: str | Path | None, field: str = "corpus") -> torch.Tensor:
    """(N,) token ids of `part` of corpus `name` (no special tokens)."""
    ids = tokenize_corpus(tokenizer, corpus_text(name, part, data_dir, field))
    if name == "tinyshakespeare":
        cut = held_out_start(len(ids), SHAKESPEARE_VALIDATION_SHARE)
        return ids[:cut] if part == "train" else ids[cut:]
    return ids
