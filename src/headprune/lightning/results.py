"""results.json: one file per run, rewritten atomically after every change."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from headprune.atomic import write_json_atomic


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
