"""Reading labelled text tables (TSV / CSV / JSON lines) into plain Python lists.

Kept free of Lightning and tokenizers so the parsing rules are easy to test.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

FORMATS = {".tsv": "\t", ".csv": ","}
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass
class TextTable:
    texts: list[str]
    pairs: list[str] | None
    labels: list  # raw labels as read (str or int)


def _column_key(field: str, column, header: list[str] | None):
    """A row key from a column given by name or 0-based index."""
    if isinstance(column, str) and column.lstrip("-").isdigit():
        column = int(column)
    if header is None:
        if not isinstance(column, int):
            raise ValueError(f"data.{field}={column!r}: the file has no header (data.header=false), "
                             "so columns are given by 0-based index")
        return column
    if isinstance(column, int):
        if not 0 <= column < len(header):
            raise ValueError(f"data.{field}={column} is out of range: the file has {len(header)} "
                             f"columns {header}")
        return header[column]
    if column not in header:
        raise ValueError(f"data.{field}={column!r} is not a column of the file; columns: {header}")
    return column


def read_table(path: str | Path, text_column, label_column, text_pair_column=None,
               header: bool = True, delimiter: str | None = None) -> TextTable:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if path.suffix in JSON_SUFFIXES:
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        header_names = list(rows[0].keys()) if rows else []
    else:
        sep = delimiter or FORMATS.get(path.suffix)
        if sep is None:
            raise ValueError(f"cannot tell the format of {str(path)!r}: use a .tsv/.csv/.jsonl file or set "
                             "data.delimiter")
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.reader(f, delimiter=sep, quoting=csv.QUOTE_NONE if sep == "\t" else csv.QUOTE_MINIMAL)
            raw = [r for r in reader if r]
        if header:
            header_names, body = raw[0], raw[1:]
            rows = [dict(zip(header_names, r)) for r in body]
        else:
            header_names, rows = None, [dict(enumerate(r)) for r in raw]
    text_key = _column_key("text_column", text_column, header_names)
    label_key = _column_key("label_column", label_column, header_names)
    pair_key = (_column_key("text_pair_column", text_pair_column, header_names)
                if text_pair_column is not None else None)
    try:
        texts = [str(r[text_key]) for r in rows]
        labels = [r[label_key] for r in rows]
        pairs = [str(r[pair_key]) for r in rows] if pair_key is not None else None
    except (KeyError, IndexError) as err:
        raise ValueError(f"a row of {str(path)!r} lacks column {err}") from None
    return TextTable(texts, pairs, labels)


def label_vocabulary(train_labels: list) -> dict:
    """Map raw labels to ids. Integer-like labels keep their value; other labels get ids in
    sorted order of the training file's distinct values."""
    values = sorted({str(v) for v in train_labels})
    if all(v.lstrip("-").isdigit() for v in values):
        ids = {v: int(v) for v in values}
        if min(ids.values()) < 0:
            raise ValueError(f"integer labels must be >= 0; found {min(ids.values())}")
        return ids
    return {v: i for i, v in enumerate(values)}


def encode_labels(labels: list, vocab: dict, where: str) -> list[int]:
    out = []
    for v in labels:
        key = str(v)
        if key not in vocab:
            raise ValueError(f"label {key!r} in {where} does not occur in the training file; "
                             f"known labels: {sorted(vocab)}")
        out.append(vocab[key])
    return out
