"""Lightning components built from Hydra config groups (loggers, callbacks), shared by the apps."""
from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every `_target_` entry of a name -> config mapping (`logger:`, `callbacks:`)."""
    if not group:
        return []
    return [instantiate(c) for c in group.values() if isinstance(c, DictConfig) and "_target_" in c]
