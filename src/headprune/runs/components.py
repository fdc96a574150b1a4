"""The objects a run builds from Hydra `_target_` nodes: `build` (one object, the object's own
error raised as it is), `instantiate_group` (every entry of `logger:` / `callbacks:`), and the two
factories a `RunSpec` holds for what it builds only when the run needs it (`Factory`: the data
module, the Trainer; `GroupFactory`: loggers, callbacks)."""
from __future__ import annotations

import re
from dataclasses import dataclass

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
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(err.__cause__))
        if isinstance(err.__cause__, TypeError) and unexpected:
            group, field = node._key() or "config", unexpected.group(1)
            raise ValueError(f"{group}.{field} is not a setting of {group}={node.get('name') or node._target_} "
                             f"(another option of that group has it, e.g. set by an experiment); allowed: remove it "
                             f"with '~{group}.{field}', or choose an experiment made for this {group} (a causal LM: "
                             "experiment=llm_kv)") from None
        raise


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every `_target_` entry of a name -> config mapping (`logger:`, `callbacks:`)."""
    if not group:
        return []
    return [instantiate(c) for c in group.values() if isinstance(c, DictConfig) and "_target_" in c]


@dataclass(frozen=True)
class Factory:
    """One object of a `_target_` node, built when called (`build`), with the run's own arguments
    (the data module's tokenizer, the Trainer's callbacks)."""

    node: DictConfig

    def __call__(self, **kwargs):
        return build(self.node, **kwargs)

    def __repr__(self) -> str:
        return str(self.node.get("_target_"))


@dataclass(frozen=True)
class GroupFactory:
    """The objects of a name -> `_target_` node mapping (`logger:`, `callbacks:`), built when called."""

    node: DictConfig | None

    def __call__(self) -> list:
        return instantiate_group(self.node)
