"""Atomic file and folder writes: a reader (or a kill) sees the old file or folder or the new one,
never half of one.

Every results file, layout file and report goes through here, and so does every folder that is
written whole (a `save_pruned` export, a converted GGUF in the model cache): written under a
temporary name beside its place, then renamed into it. Files get the permissions a plain `open()`
would give them (0666 less the umask, folders 0777 less it), not mkstemp's and safetensors' 0600,
so other users of a shared folder can read them.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write strict JSON (no NaN or Infinity: a ValueError names the problem instead) to a
    temporary file in the same folder, then rename it over `path`."""
    write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False))


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write text to a temporary file in the same folder, then rename it over `path`. The file
    gets the permissions a plain `open(path, "w")` would (0666 less the umask), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def staged_folder(directory: str | Path, prefix: str | None = None) -> Iterator[Path]:
    """An empty temporary folder beside `directory` (named `prefix` + random + ".tmp"; default
    prefix ".<name>.") to write the new folder into. When the block completes it is published as
    `directory` (`publish_folder`); when it raises (a kill, Ctrl-C, an error) it is removed and
    `directory` is left as it was."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix or f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        yield staging
        publish_folder(staging, directory, prefix)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def publish_folder(staging: str | Path, directory: str | Path, prefix: str | None = None) -> None:
    """Give `staging`'s files the permissions a plain open() would, then rename it to `directory`;
    an existing `directory` is moved aside first (`prefix`...".old") and removed only once the new
    one is in place."""
    staging, directory = Path(staging), Path(directory)
    umask = current_umask()
    for path in staging.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    os.chmod(staging, 0o777 & ~umask)
    old = None
    if directory.exists():
        old = Path(tempfile.mkdtemp(prefix=prefix or f".{directory.name}.", suffix=".old", dir=directory.parent))
        os.replace(directory, old / directory.name)
    try:
        os.replace(staging, directory)
    except BaseException:
        if old is not None:
            os.replace(old / directory.name, directory)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
