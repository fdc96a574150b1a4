"""Atomic file writes: a reader (or a kill) sees the old file or the new one, never half of one.

Every results file, layout file and report goes through here.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write strict JSON (no NaN or Infinity: a ValueError names the problem instead) to a
    temporary file in the same folder, then rename it over `path`."""
    write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False))


def _umask() -> int:
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
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
