"""Typed Hydra schemas, derived from the code they configure.

Every metric, schedule, layer policy and recovery gets a dataclass schema in Hydra's ConfigStore under
`schema/<group>/<name>`, built from the metric function's signature (options after the
positional inputs) or the schedule's / layer policy's / recovery's dataclass fields; the schema also sets
`_target_` (and `_partial_` for metrics), so the yaml files only hold values. Each
`conf/<group>/<name>.yaml` lists its schema first in its defaults, so a misspelt field
(`schedule.stpe=0.2`) or a value of the wrong type fails at compose time, naming the key.
Ranges are checked when the object is built.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Sequence
from typing import Any, List, Optional, Union

from hydra.core.config_store import ConfigStore

METRIC_POSITIONAL = 3  # a metric's inputs: (model, mask, dataloader)
METRIC_RUN_INPUTS = ("task",)  # what the run hands a metric (its Task, scoring.score), never a config field


def _omegaconf_type(annotation: Any) -> Any:
    """Map a code annotation to one OmegaConf structured configs accept (Any when unsure)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return Optional[_omegaconf_type(args[0])]
        return Any
    if origin in (list, Sequence, typing.Sequence, tuple):
        args = typing.get_args(annotation)
        inner = _omegaconf_type(args[0]) if args else Any
        return List[inner]
    if annotation in (int, float, bool, str):
        return annotation
    return Any


def _field(default: Any, factory=None):
    if factory is not None and factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d))
    return dataclasses.field(default=default)


def schema_for_function(name: str, fn, n_positional: int):
    hints = typing.get_type_hints(fn)
    fields = [("_target_", str, dataclasses.field(default=f"{fn.__module__}.{fn.__name__}")),
              ("_partial_", bool, dataclasses.field(default=True))]
    for i, param in enumerate(inspect.signature(fn).parameters.values()):
        if i < n_positional or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL) or \
                param.name in METRIC_RUN_INPUTS:
            continue
        default = None if param.default is inspect.Parameter.empty else param.default
        fields.append((param.name, _omegaconf_type(hints.get(param.name, Any)), _field(default)))
    return dataclasses.make_dataclass(f"{name.title().replace('_', '')}Schema", fields)


def schema_for_class(name: str, cls, kind: str):
    hints = typing.get_type_hints(cls)
    fields = [("_target_", str, dataclasses.field(default=f"{cls.__module__}.{cls.__name__}"))]
    for f in dataclasses.fields(cls):
        fields.append((f.name, _omegaconf_type(hints[f.name]), _field(f.default, f.default_factory)))
    return dataclasses.make_dataclass(f"{name.title().replace('_', '')}{kind}Schema", fields)


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore, and make the experiments' arms known (idempotent)."""
    from headprune.apps.arms import register_arm_source
    from headprune.evaluation.llm_suite import EvaluationSettings
    from headprune.data.self_calibration import SelfCalibration
    from headprune.recovery import RECOVERIES
    from headprune.selection.budgets import BUDGETS
    from headprune.selection.kv_modes import KVModes
    from headprune.scoring import METRICS
    from headprune.selection.layer_policies import LAYER_POLICIES
    from headprune.selection.schedules import SCHEDULES

    register_arm_source()  # experiment=<experiment>/<arm> from conf/experiment/<experiment>/arms.yaml
    cs = ConfigStore.instance()
    for name, fn in METRICS.items():
        cs.store(group="schema/metric", name=name, node=schema_for_function(name, fn, METRIC_POSITIONAL))
    for name, cls in LAYER_POLICIES.items():
        cs.store(group="schema/layer_policy", name=name, node=schema_for_class(name, cls, "LayerPolicy"))
    for name, cls in SCHEDULES.items():
        cs.store(group="schema/schedule", name=name, node=schema_for_class(name, cls, "Schedule"))
    for name, cls in RECOVERIES.items():
        cs.store(group="schema/recovery", name=name, node=schema_for_class(name, cls, "Recovery"))
    cs.store(group="schema", name="evaluation", node=EvaluationSettings)
    cs.store(group="schema/data", name="self_calibration", node=SelfCalibration)  # data.self_calibration
    for name, cls in BUDGETS.items():
        cs.store(group="schema/budget", name=name, node=schema_for_class(name, cls, "Budget"))
    cs.store(group="schema", name="kv_modes", node=schema_for_class("kv_modes", KVModes, ""))  # kv_modes=
