"""Reading labelled text tables (TSV / CSV / JSON lines) into plain Python lists.

Kept free of Lightning and tokenizers so the parsing rules are easy to test.
"""
from __future__ import annotations

import csv
import json
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

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


def resolve_data_file(field: str, value: str | None, data_dir: str | None) -> Path:
    """The file `data.<field>` names (relative to `data_dir` when set), or an error naming the
    field: not set, a folder, or missing."""
    if value is None:
        raise ValueError(f"data.{field} is not set: give a file path (or set data.hub for a hub dataset)")
    path = Path(os.path.expanduser(value))
    if not path.is_absolute() and data_dir:
        path = Path(os.path.expanduser(data_dir)) / path
    if path.is_dir():
        raise IsADirectoryError(f"data.{field}: {str(path)!r} is a folder; allowed: a data file")
    if not path.is_file():
        hint = f" (data.data_dir={data_dir!r})" if data_dir else ""
        raise FileNotFoundError(f"data.{field}: file {str(path)!r} does not exist{hint}")
    return path


# Tables already read in this process, keyed by the file's identity (path, size, mtime, inode) and
# the reading settings: a process that sets up several data modules over one file (a sweep's
# trials in one process, the scoring and training parts of a run, a test session) parses it once.
# SST-2's train file (67,349 rows) takes ~1 s to parse and check on one core.
_TABLES: OrderedDict = OrderedDict()
_TABLES_KEPT = 4


def read_table(path: str | Path, text_column, label_column, text_pair_column=None,
               header: bool = True, delimiter: str | None = None) -> TextTable:
    """Rows of a TSV / CSV / JSON-lines file. Every defect that would change the task without a
    word is an error naming the file and line: bytes that are not UTF-8, a malformed JSON row, a
    row without the column, an empty label, an empty or null text. Labels with padding spaces
    (" 1") are stripped, with a warning that counts them (each time the file is read).

    A file read before in this process, unchanged (same size, modification time and inode) and
    with the same settings, is not parsed again: the caller gets fresh lists of the same rows."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"data file {str(path)!r} is a folder; allowed: a .tsv/.csv/.jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino,
           text_column, label_column, text_pair_column, header, delimiter)
    try:
        hit = _TABLES.get(key)
    except TypeError:  # a column given as something unhashable: read without the cache
        key, hit = None, None
    if hit is None:
        table, padded = _parse_table(path, text_column, label_column, text_pair_column, header, delimiter)
        if key is not None:
            _TABLES[key] = hit = (table, padded)
            while len(_TABLES) > _TABLES_KEPT:
                _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
        table, padded = hit
    if padded:
        log.warning("%s: %d label(s) had spaces around them and were stripped (e.g. ' 1' -> '1')", path, padded)
    return TextTable(list(table.texts), None if table.pairs is None else list(table.pairs), list(table.labels))


def _parse_table(path: Path, text_column, label_column, text_pair_column, header: bool,
                 delimiter: str | None) -> tuple[TextTable, int]:
    """read_table's work on the file itself: (the table, how many labels had padding spaces)."""
    lines = _utf8_lines(path)
    if path.suffix in JSON_SUFFIXES:
        numbered = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: a JSON-lines row must be an object with named columns; got "
                                 f"{type(row).__name__}")
            numbered.append((number, row))
        header_names = list(numbered[0][1].keys()) if numbered else []
    else:
        sep = delimiter or FORMATS.get(path.suffix)
        if sep is None:
            raise ValueError(f"cannot tell the format of {str(path)!r}: use a .tsv/.csv/.jsonl file or set "
                             "data.delimiter")
        # a sentence or document may be long: csv's default 128 KB field limit would stop at it
        csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
        reader = csv.reader(lines, delimiter=sep, quoting=csv.QUOTE_NONE if sep == "\t" else csv.QUOTE_MINIMAL)
        try:
            raw = [(reader.line_num, r) for r in reader if r]
        except csv.Error as err:
            raise ValueError(f"{path}:{reader.line_num}: cannot be read as {'TSV' if sep == chr(9) else 'CSV'} "
                             f"({err})") from None
        if header and raw:
            header_names, body = raw[0][1], raw[1:]
            numbered = [(n, dict(zip(header_names, r))) for n, r in body]
        else:
            header_names, numbered = None, [(n, dict(enumerate(r))) for n, r in raw]
    text_key = _column_key("text_column", text_column, header_names)
    label_key = _column_key("label_column", label_column, header_names)
    pair_key = (_column_key("text_pair_column", text_pair_column, header_names)
                if text_pair_column is not None else None)
    texts, pairs, labels, padded = [], [] if pair_key is not None else None, [], 0
    for number, row in numbered:
        where = f"{path}:{number}"
        for key in (text_key, label_key, pair_key):
            if key is not None and key not in row:
                raise ValueError(f"{where}: the row lacks column {key!r} (it has {len(row)} fields)")
        texts.append(_text(row[text_key], where, "text"))
        if pair_key is not None:
            pairs.append(_text(row[pair_key], where, "text pair"))
        label, stripped = _label(row[label_key], where)
        labels.append(label)
        padded += stripped
    return TextTable(texts, pairs, labels), padded


def _utf8_lines(path: Path) -> list[str]:
    """The file's lines (line ends kept), without a leading byte-order mark (Excel and Notepad write
    one; it would glue itself to the first column's name), or an error naming the first line that
    is not UTF-8."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(f"{path}:{line}: byte 0x{data[err.start]:02x} at column {column} is not valid UTF-8; "
                         "allowed: UTF-8 text (re-encode the file, e.g. iconv -f latin1 -t utf-8)") from None
    return text.splitlines(keepends=True)


def _text(value, where: str, what: str) -> str:
    """A row's text, or an error for an empty, null or NaN one (an empty string would train as if
    it were a sentence)."""
    if value is None or (isinstance(value, float) and value != value) or not str(value).strip():
        raise ValueError(f"{where}: the {what} is empty ({value!r}); allowed: non-empty text (drop or fill the row)")
    return str(value)


def _label(value, where: str) -> tuple:
    """(label, 1 if spaces were stripped from it else 0); an empty or null label is an error."""
    if value is None or (isinstance(value, float) and value != value):
        raise ValueError(f"{where}: the label is empty ({value!r}); allowed: a label in every row")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: the label is empty ({value!r}); allowed: a label in every row")
        if value != value.strip():
            return value.strip(), 1
    return value, 0


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def label_key(value) -> str:
    """The class a raw label names, as a string: numerically equal labels (1, "1", 1.0, "1.0",
    "01") are one class "1"; other labels are themselves."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)) or (isinstance(value, str) and _NUMBER.fullmatch(value)):
        if isinstance(value, str) and value.lstrip("+-").isdigit():
            return str(int(value))  # exact, however long
        number = float(value)
        return str(int(number)) if number.is_integer() else repr(number)
    return str(value)


def label_vocabulary(train_labels: list) -> dict:
    """Map the training file's distinct labels (`label_key`) to class ids 0..K-1: integer labels in
    numeric order (Yelp's 1/2 -> 0/1, no phantom class 0), other labels in sorted order. Negative
    integers are refused: -1 marks unlabelled rows in GLUE's test files."""
    values = set(_label_keys(train_labels).values()) if train_labels else set()
    if values and all(v.lstrip("-").isdigit() for v in values):
        numbers = sorted(int(v) for v in values)
        if numbers[0] < 0:
            raise ValueError(f"integer labels must be >= 0; found {numbers[0]} (-1 marks unlabelled rows in GLUE "
                             "test files: use a labelled file)")
        return {str(n): i for i, n in enumerate(numbers)}
    return {v: i for i, v in enumerate(sorted(values))}


def _raw(value):
    """A dict key for a raw label: its type and value (True, 1 and 1.0 are equal keys otherwise), or
    its repr for a label that cannot be a key (a JSON list)."""
    try:
        hash(value)
    except TypeError:
        return ("unhashable", repr(value))
    return (type(value), value)


def _label_keys(labels: list) -> dict:
    """{_raw(label): label_key(label)} over the distinct labels: a file has a handful of distinct
    labels and many rows (SST-2: 2 and 67,349), and label_key parsed every row again."""
    keys = {}
    for v in labels:
        raw = _raw(v)
        if raw not in keys:
            keys[raw] = label_key(v)
    return keys


def encode_labels(labels: list, vocab: dict, where: str) -> list[int]:
    keys = _label_keys(labels)
    out = []
    for v in labels:
        key = keys[_raw(v)]
        if key not in vocab:
            raise ValueError(f"label {key!r} in {where} does not occur in the training file; "
                             f"known labels: {sorted(vocab)}")
        out.append(vocab[key])
    return out
