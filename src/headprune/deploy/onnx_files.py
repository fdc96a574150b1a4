"""An ONNX graph, its external-data file and its check report written as one set, so that an
interrupted export (Ctrl-C, a kill, a failed check) leaves the earlier set at that path intact
and consistent.

Why: the exporter writes `<name>.onnx` and the weights beside it (`<name>.onnx.data`) in place.
Interrupted while it overwrote an earlier export, the old graph was left with the new model's
weights, ONNX Runtime ran it (logits off by ~10) and the old `<name>.check.json` still said
`passed: true`.

How (`staged_onnx`): the graph is exported into a temporary folder beside its path and checked
there; then it is published in an order where every moment on disk is a consistent set:

1. the weights move beside the path under a name of their own (`<name>.onnx.<8 hex>.data`; the
   graph's references are rewritten to it), so the old graph's weights file is never touched;
2. the old check report is removed (from here until step 4 the old graph has no report, rather
   than one that describes another graph);
3. the new graph is renamed over the old one: the commit point;
4. the new check report is written (atomically) and the old graph's weights file is removed.

A kill before step 3 leaves the old graph with its own weights (and its report, or none after
step 2), and at most an unreferenced weights file and the staging folder (`.<name>.<random>.tmp`),
both removed by the next export to that path. The staging folder, its lock and the permissions
(0666 less the umask) are atomic.py's, as for every other file headprune publishes.
"""
from __future__ import annotations

import os
import re
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from headprune.atomic import publish as publish_file
from headprune.atomic import share, staging, write_json_atomic


def check_path(path: Path) -> Path:
    """Where the check report of the graph at `path` goes: `<name>.check.json` beside it."""
    return path.with_suffix(".check.json")


def data_files(path: Path) -> list[Path]:
    """The external-data files the graph at `path` references (beside it), in order; [] when
    the graph holds its weights itself or there is no graph."""
    import onnx

    if not path.is_file():
        return []
    graph = onnx.load(str(path), load_external_data=False)
    names: list[str] = []
    for tensor in _tensors(graph):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value not in names:
                names.append(entry.value)
    return [path.parent / name for name in names]


def onnx_bytes(path: Path) -> int | None:
    """The bytes of an .onnx file and of the external-data files it references (None: no file)."""
    if not path.is_file():
        return None
    return path.stat().st_size + sum(f.stat().st_size for f in data_files(path) if f.is_file())


@contextmanager
def staged_onnx(path: Path) -> Iterator[Path]:
    """A path in an empty temporary folder beside `path`, with `path`'s name, to export and check
    the graph at; the block must end by calling `publish(staged, path, report)`. The folder is
    removed however the block ends, and `path`'s set is untouched unless `publish` ran."""
    with staging(path, folder=True) as folder:  # atomic.py: locked; a killed export's is removed first
        yield folder / path.name


def publish(staged: Path, path: Path, report: dict) -> None:
    """Move the staged graph and its weights to `path` and write `report` as its check report, in
    the order of the module docstring; `report["onnx_bytes"]` is set to the published set's bytes."""
    import onnx

    if not staged.is_file():
        raise FileNotFoundError(f"the ONNX export of {path} wrote no graph (nothing at {staged}); {path} is unchanged")
    old_data = set(data_files(path))
    new_data = data_files(staged)
    token = secrets.token_hex(4)
    renamed = {f.name: f"{path.name}.{token}.data" if len(new_data) == 1 else f"{path.name}.{token}.{i}.data"
               for i, f in enumerate(new_data)}
    if renamed:
        graph = onnx.load(str(staged), load_external_data=False)
        for tensor in _tensors(graph):
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = renamed[entry.value]
        onnx.save(graph, str(staged))
    for f in new_data:  # 1. beside the path, under names no earlier graph uses
        share(f)
        os.replace(f, path.parent / renamed[f.name])
    check = check_path(path)
    if check.exists():  # 2.
        check.unlink()
    publish_file(staged, path)  # 3. the commit point
    report["onnx_bytes"] = onnx_bytes(path)
    write_json_atomic(check, report)  # 4.
    keep = {path.parent / name for name in renamed.values()}
    ours = re.compile(re.escape(path.name) + r"\.[0-9a-f]{8}(\.\d+)?\.data")
    left = {f for f in path.parent.iterdir() if ours.fullmatch(f.name)}  # weights files a kill left behind
    for f in old_data | left:
        if f not in keep and f.is_file():
            f.unlink()


def _tensors(model) -> Iterator:
    """Every tensor of the model that can hold external data: initializers and tensor
    attributes of nodes, subgraphs included."""
    yield from _graph_tensors(model.graph)


def _graph_tensors(graph) -> Iterator:
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _graph_tensors(attribute.g)
            for sub in attribute.graphs:
                yield from _graph_tensors(sub)
