"""Where the Hydra configs live: `conf/` at the repository root in a source checkout
(editable install), or `headprune/conf` inside an installed wheel."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # src/headprune


def config_dir() -> Path:
    for candidate in (_PACKAGE / "conf", _PACKAGE.parent.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"headprune's Hydra configs were not found next to {_PACKAGE}")
