"""Atomic file and folder writes: a reader (or a kill) sees the old file or folder or the new one,
never half of one, never none.

The one mechanism every writer uses (results files, layout files and reports, `save_pruned` and
`save_deci` folders, GGUF files, the model cache's converted folders, the staging of ONNX graphs):

- `staging(path)`: the new file or folder is written under a hidden name beside its place
  (`.<name>.<random>.tmp`, same file system, so the publish is a rename). The writer holds an
  exclusive lock (flock) on it while it exists, which the kernel drops when the writer dies.
- Before creating one, the staging of the same name that a killed writer left behind (unlocked,
  older than `STALE_AFTER_S`) is removed (`remove_stale`), so kill -9 leaves no garbage for long.
- `publish(staging, path)`: the staged files get the permissions a plain `open()` would give them
  (0666 less the umask, folders 0777 less it; mkstemp and safetensors write 0600), so other users
  of a shared folder can read them; then a file is renamed over `path` (rename(2) is atomic), and
  a folder is exchanged with an existing `path` in one step (Linux renameat2 RENAME_EXCHANGE), the
  old folder then removed from the staging name. Where the system cannot exchange, the old folder
  is renamed aside (`.<name>.<random>.old`) and back if the rename in fails; a kill between those
  two renames leaves the old folder under its `.old` name, and no target.
- `staged_file` / `staged_folder`: the block writes into the staging; when it completes the
  staging is published, when it raises (an error, Ctrl-C) the staging is removed and `path` is
  left as it was.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

STALE_AFTER_S = 2.0  # a staging this recent may belong to a writer that has not locked it yet


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
    with staged_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def share(path: str | Path) -> None:
    """Give `path` (a file, or a folder and everything under it) the permissions a plain open() or
    mkdir() would: 0666 / 0777 less the umask."""
    path, umask = Path(path), current_umask()
    for p in [*path.rglob("*"), path] if path.is_dir() else [path]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def remove_stale(parent: str | Path, prefix: str, min_age: float | None = None) -> list[Path]:
    """Remove the staging files and folders named `prefix`...`.tmp` / `.old` in `parent` that no live
    writer holds (a killed export's or conversion's leftovers) and that are older than `min_age`
    seconds (default STALE_AFTER_S; 0 where the caller holds a lock no other writer of that prefix
    could be working without); returns what was removed."""
    parent, removed = Path(parent), []
    if not parent.is_dir():
        return removed
    now, min_age = time.time(), STALE_AFTER_S if min_age is None else min_age
    for entry in parent.glob(glob.escape(prefix) + "*"):
        if not entry.name.endswith((".tmp", ".old")):
            continue
        try:
            if now - entry.lstat().st_mtime < min_age:
                continue
            fd = os.open(entry, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            os.close(fd)
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.unlink(entry)
            removed.append(entry)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


@contextmanager
def staging(path: str | Path, folder: bool, prefix: str | None = None) -> Iterator[Path]:
    """A new, locked, empty staging file or folder beside `path` (named `prefix` + random + ".tmp";
    default prefix ".<name>."), after removing the stale ones of that prefix. Removed when the block
    ends unless it was published (renamed away) in it."""
    path = Path(path)
    prefix = prefix or f".{path.name}."
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path.parent, prefix)
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent))
        fd = os.open(tmp, os.O_RDONLY)
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
        tmp = Path(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        try:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            elif os.path.lexists(tmp):
                os.unlink(tmp)
        finally:
            os.close(fd)


def publish(staged: str | Path, path: str | Path) -> None:
    """Put the staged file or folder at `path` in one step (module docstring), with the permissions
    a plain open() would give it; an existing `path` is replaced. A folder that was at `path` is
    removed once the new one is in place."""
    staged, path = Path(staged), Path(path)
    share(staged)
    if not staged.is_dir():
        os.replace(staged, path)
        return
    if not path.is_dir():
        os.replace(staged, path)  # none there (a file there: an error, nothing changed)
        return
    if _exchange(staged, path):  # `staged` now holds the old folder
        shutil.rmtree(staged, ignore_errors=True)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    try:
        os.replace(path, aside / path.name)
    except BaseException:
        shutil.rmtree(aside, ignore_errors=True)
        raise
    try:
        os.replace(staged, path)
    except BaseException:
        os.replace(aside / path.name, path)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths `a` and `b` in one step (Linux renameat2 with RENAME_EXCHANGE): True when done,
    False where the C library or the file system cannot (then nothing changed)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextmanager
def staged_file(path: str | Path) -> Iterator[Path]:
    """A staging path beside `path` to write the new file at (the writer may open it by name);
    published over `path` when the block completes, removed when it raises."""
    with staging(path, folder=False) as tmp:
        yield tmp
        publish(tmp, path)


@contextmanager
def staged_folder(directory: str | Path, prefix: str | None = None) -> Iterator[Path]:
    """An empty staging folder beside `directory` (named `prefix` + random + ".tmp"; default
    prefix ".<name>.") to write the new folder into. When the block completes it is published as
    `directory`, replacing an existing one; when it raises (an error, Ctrl-C) it is removed and
    `directory` is left as it was."""
    with staging(directory, folder=True, prefix=prefix) as tmp:
        yield tmp
        publish(tmp, directory)

