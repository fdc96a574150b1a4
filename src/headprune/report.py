"""Experiments' reports: raw result files -> rows (one dict a run) -> tables declared as columns,
rendered as Markdown and CSV. Every experiments/<name>/collect.py builds its tables here, so a
table has one shape (a heading row, an alignment row, a line a row), a missing value one mark
(`DASH`), and a collect script one contract: `render(folder) -> {file name: text}`, which its
`main` writes (`write`) and the consistency test compares with the committed files.

    rows = [{"arm": "iterative", "acc": 0.8125}, {"arm": "one_shot", "acc": None}]
    markdown([text("arm"), column("final acc", "acc", ".2f", scale=100)], rows)
    # ['| arm | final acc |', '|---|---:|', '| iterative | 81.25 |', '| one_shot | – |']
"""
from __future__ import annotations

import csv
import importlib.util
import io
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from headprune.atomic import write_json_atomic, write_text_atomic

DASH = "–"  # a value the raw file holds as null or lacks


def number(value: float | None, spec: str = ".2f", scale: float = 1.0, missing: str = DASH) -> str:
    """`scale * value` formatted with `spec` (an int stays an int at scale 1: spec "d" or ","
    works); `missing` (DASH) for None."""
    if value is None:
        return missing
    return format(value if scale == 1 else scale * value, spec)


def change(value: float | None, base: float | None, digits: int = 1) -> str:
    """The change of `value` from `base` in percent, signed ("+12.3%"); DASH when either is None."""
    return DASH if value is None or base is None else f"{100 * (value / base - 1):+.{digits}f}%"


def spread(values: Iterable[float | None], digits: int = 2, scale: float = 1.0, count: bool = False) -> str:
    """Mean, and with more than one value " ± " the sample standard deviation (and with `count`
    " (n=N)"), of the values that are not None; DASH when none is."""
    values = [v for v in values if v is not None]
    if not values:
        return DASH
    mean = f"{scale * statistics.fmean(values):.{digits}f}"
    if len(values) == 1:
        return mean
    return f"{mean} ± {scale * statistics.stdev(values):.{digits}f}" + (f" (n={len(values)})" if count else "")


def cell_text(value: Any) -> str:
    """A free text (a model's answer) as one Markdown cell: no line breaks, no column bars."""
    return str(value).replace("|", "/").replace("\n", " ")


@dataclass(frozen=True)
class Column:
    """One column of a table: its heading, the cell text of a row, and whether it is right-aligned
    (numbers) or left-aligned (names)."""

    heading: str
    cell: Callable[[dict], str]
    right: bool = True


def column(heading: str, key: str | Callable[[dict], Any], spec: str = ".2f", scale: float = 1.0,
           unit: str = "", right: bool = True, bold: bool = False, missing: str = DASH) -> Column:
    """A number column: `row[key]` (or `key(row)`) formatted by `number(value, spec, scale)` and
    followed by `unit` ("%", "x"); `missing` for None; `bold` wraps the cell in ** (a headline figure)."""
    get = key if callable(key) else (lambda row: row[key])

    def cell(row: dict) -> str:
        value = get(row)
        if value is None:
            return missing
        value = number(value, spec, scale) + unit
        return f"**{value}**" if bold else value

    return Column(heading, cell, right)


def text(heading: str, key: str | Callable[[dict], Any] | None = None, right: bool = False) -> Column:
    """A text column: str(row[key]) (default key: the heading), or `key(row)` when callable."""
    get = key if callable(key) else (lambda row: row[heading if key is None else key])
    return Column(heading, lambda row: str(get(row)), right)


def markdown(columns: list[Column], rows: Iterable[dict]) -> list[str]:
    """The table's lines: heading row, alignment row ("---:" right, "---" left), one line a row."""
    return ["| " + " | ".join(c.heading for c in columns) + " |",
            "|" + "|".join("---:" if c.right else "---" for c in columns) + "|",
            *("| " + " | ".join(c.cell(row) for c in columns) + " |" for row in rows)]


def to_csv(rows: list[dict]) -> str:
    """One CSV line a row; the columns are every key of every row, in first-seen order (a row
    without a key leaves that cell empty). Lines end in \\r\\n, as the csv module writes them."""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def script(path: Path):
    """A script (an experiment's collect.py, another's table code) imported as a module, fresh on each
    call: experiments hold scripts, not a package, and one experiment's tables reuse another's
    rendering this way rather than copying it."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def load_results(folder: Path, names: Iterable[str] | None = None) -> dict[str, dict]:
    """{stem: parsed JSON} of `folder`/<name>.json for each of `names` that exists, in their order;
    without `names`, of every *.json there, by name."""
    folder = Path(folder)
    if names is None:
        return {p.stem: read_json(p) for p in sorted(folder.glob("*.json"))}
    return {name: read_json(folder / f"{name}.json") for name in names if (folder / f"{name}.json").is_file()}


def gather(runs: Path, results: Path, finished: Callable[[dict], bool], names: Iterable[str] | None = None) -> list[str]:
    """Copy each finished run's results.json (`runs`/<name>/results.json, `finished(data)` true) to
    `results`/<name>.json with the run's wall.json, when there, under "wall"; `names`: the run
    folders to look at (default: every folder in `runs`, by name). Returns the names copied."""
    runs, results = Path(runs), Path(results)
    if names is None:
        names = sorted(p.name for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []
    copied = []
    for name in names:
        source = runs / name / "results.json"
        if not source.is_file():
            continue
        data = read_json(source)
        if not finished(data):
            continue
        wall = runs / name / "wall.json"
        if wall.is_file():
            data["wall"] = read_json(wall)
        write_json_atomic(results / f"{name}.json", data)
        copied.append(name)
    return copied


def dense_evaluation(runs: dict[str, dict]) -> dict:
    """The dense model's evaluation block, from the first run that evaluated it (evaluation.dense);
    a ValueError when none did."""
    for data in runs.values():
        dense = (data.get("evaluation") or {}).get("dense")
        if dense:
            return dense
    raise ValueError("no run holds evaluation.dense: run one arm with evaluation.dense=true")


def write(out: Path, files: dict[str, str]) -> None:
    """Write each rendered file (`render`'s {name: text}) under `out`, each in one step."""
    for name, body in files.items():
        write_text_atomic(Path(out) / name, body)


def stale(folder: Path, files: dict[str, str]) -> list[str]:
    """The names of rendered files whose committed copy in `folder` differs (or is missing)."""
    def committed(name: str) -> str | None:
        path = Path(folder) / name
        if not path.is_file():
            return None
        with open(path, encoding="utf-8", newline="") as f:  # as written: a CSV's \r\n kept
            return f.read()

    return [name for name, body in files.items() if committed(name) != body]
