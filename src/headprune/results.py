"""results.json: one file per run, rewritten atomically after every change."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to a temporary file in the same folder, then rename it over `path`."""
    write_text_atomic(path, json.dumps(data, indent=2))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write text to a temporary file in the same folder, then rename it over `path`: a reader
    sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class RunResults:
    """The results document of one run; `save()` writes it to `<output_dir>/results.json`."""

    def __init__(self, output_dir: str | Path | None, config: dict | None = None):
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.data: dict[str, Any] = {"config": config or {}, "model": {}, "baseline": {}, "rounds": [],
                                     "final": {}}
        self.writer = True  # False on every data-parallel rank but 0: only rank 0 writes files

    @property
    def path(self) -> Path | None:
        return self.output_dir / "results.json" if self.output_dir is not None else None

    def save(self) -> None:
        if self.path is not None and self.writer:
            write_json_atomic(self.path, self.data)
