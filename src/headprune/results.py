"""results.json: one file per run, rewritten atomically after every change, strict JSON."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from headprune.atomic import write_json_atomic

log = logging.getLogger(__name__)


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
        """Write results.json. A number that is not finite (a loss that blew up) is written as
        null and its place listed under `nonfinite`, so the file stays strict JSON."""
        if self.path is None or not self.writer:
            return
        write_json_atomic(self.path, strict(self.data, self.path.name))


def strict(data: dict, name: str = "results.json") -> dict:
    """`data` as strict JSON: every number that is not finite written as null and its place listed
    under `nonfinite` (with a warning naming the file)."""
    places: list[str] = []
    out = _finite(data, "", places)
    if places:
        out["nonfinite"] = sorted(set(data.get("nonfinite", [])) | set(places))
        log.warning("%s: non-finite values written as null at %s", name, ", ".join(places[:5]))
    return out


def _finite(value, where: str, places: list[str]):
    """`value` with every non-finite float replaced by None (its path appended to `places`)."""
    if isinstance(value, float) and not math.isfinite(value):
        places.append(where or "/")
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{where}/{k}", places) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{where}/{i}", places) for i, v in enumerate(value)]
    return value


def flatten(block: dict, sep: str = "/", prefix: str = "") -> dict:
    """A nested mapping as one level, keys joined by `sep` ({"a": {"b": 1}} -> {"a/b": 1})."""
    out = {}
    for key, value in block.items():
        if isinstance(value, dict):
            out.update(flatten(value, sep, f"{prefix}{key}{sep}"))
        else:
            out[f"{prefix}{key}"] = value
    return out
