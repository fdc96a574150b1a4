"""Lightning components built from Hydra config groups (loggers, callbacks), shared by the apps."""
from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig


def build(node: DictConfig, **kwargs):
    """`instantiate(node)`, with the object's own error (a ValueError naming the field and what is
    allowed, a missing file) raised as it is rather than wrapped in Hydra's InstantiationException."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, OSError)):
            raise err.__cause__ from None
        raise


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every `_target_` entry of a name -> config mapping (`logger:`, `callbacks:`)."""
    if not group:
        return []
    return [instantiate(c) for c in group.values() if isinstance(c, DictConfig) and "_target_" in c]
