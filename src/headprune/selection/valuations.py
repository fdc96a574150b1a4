"""KV unit valuations (`kv_modes=<name>`): what each KV unit (a GQA group, or a head without GQA) of
each layer is worth kept full and kept windowed (its first `sink` + last `window` tokens), removed
being worth 0; the three-way knapsack of `selection.kv_modes` then keeps the layout worth most
within the budget's mode table. One registry, as the metrics' (`scoring.METRIC_INFO`):

    fn(model, batches, units, sink, window, *, <what it reads>) -> (full, windowed, measured)

`batches`: the calibration blocks (dicts of (B, T) tensors on the mask's device, at least
`budget.seq` tokens long); `units[u]`: the query heads of unit u; `full[l][u]`, `windowed[l][u]`:
the values (floats, higher = keep); `measured`: a dict of what it measured, recorded in the round's
`budget.kv_modes` (results.json). Keyword parameters are given by name, only those the function
declares (`OFFERED`): `mask` (the run's HeadMask), `task` (the run's Task), `unit_scores` (per
layer and unit the metric's scores summed over the unit's heads as the layer policy ranks them,
shifted to be >= 0), `removal_used` (False when no option the knapsack may take removes a unit:
removal=last with every unit windowed fitting, or caps forbidding removal; a valuation may then skip
measuring removal), and the `kv_modes.unit_value` / `kv_modes.retrieval_blocks` settings (a
valuation that does not declare one refuses a non-default value of it, before any work).
`check(settings, block_size)` refuses, before any work, blocks it cannot measure on.

Built in: `measured` (`selection.measured_values`), `attention_mass` and `retrieval`
(`selection.attention_values`). `register_valuation` adds one (docs/extending.md); its
`conf/kv_modes/<name>.yaml` sets `choice: <name>`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from headprune.heads.adapters import model_shape
from headprune.selection.attention_values import check_retrieval, mass_values, retrieval_values
from headprune.selection.measured_values import check_measured, measured

# keyword parameters a valuation may declare, and the kv_modes setting's value that means "unused"
OFFERED = ("mask", "task", "unit_scores", "unit_value", "retrieval_blocks", "removal_used")
SETTINGS = {"unit_value": "metric", "retrieval_blocks": 0}
RESERVED = ("none", "given")  # kv_modes choices that are no valuation: removal only; an earlier run's layout


@dataclass(frozen=True)
class Valuation:
    """A registered valuation: `fn` (module docstring), `about` (one line for listings), `check`
    (settings, block_size) refusing blocks it cannot measure on, or None."""

    fn: Callable[..., tuple]
    about: str
    check: Callable[[Any, int | None], None] | None = None

    @property
    def reads(self) -> tuple[str, ...]:
        """The offered keywords `fn` declares."""
        return tuple(p for p in inspect.signature(self.fn).parameters if p in OFFERED)


VALUATIONS: dict[str, Valuation] = {
    "measured": Valuation(measured, "calibration loss rise of the unit alone removed / windowed", check_measured),
    "attention_mass": Valuation(mass_values, "the metric's unit score x (1 - attention mass beyond the window)"),
    "retrieval": Valuation(retrieval_values, "as attention_mass, with the larger of the mass and the unit's "
                           "echo + induction attention on repeating random tokens", check_retrieval),
}


def register_valuation(name: str, fn: Callable[..., tuple], about: str = "",
                       check: Callable[[Any, int | None], None] | None = None) -> Valuation:
    """Add valuation `name` (then `kv_modes.choice=<name>`); refused, naming what is wrong, when the
    name is taken or reserved, or `fn` has a keyword parameter without default that is not offered."""
    if name in RESERVED or name in VALUATIONS:
        raise ValueError(f"kv_modes valuation {name!r} is already a kv_modes choice; taken: "
                         f"{', '.join((*RESERVED, *VALUATIONS))}")
    params = list(inspect.signature(fn).parameters.values())[5:]  # after model, batches, units, sink, window
    unknown = [p.name for p in params if p.name not in OFFERED and p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if unknown:
        raise ValueError(f"kv_modes valuation {name!r}: parameter {unknown[0]!r} is not offered; allowed: "
                         f"{', '.join(OFFERED)}")
    VALUATIONS[name] = Valuation(fn, about, check)
    return VALUATIONS[name]


def get_valuation(name: str) -> Valuation:
    if name not in VALUATIONS:
        raise ValueError(f"kv_modes valuation {name!r} is not registered; allowed: {', '.join(VALUATIONS)}")
    return VALUATIONS[name]


def readers(setting: str) -> list[str]:
    """The valuations that read the kv_modes setting `setting`."""
    return [name for name, v in VALUATIONS.items() if setting in v.reads]


def value_units(name: str, model, batches: list[dict], units: list[list[int]], sink: int, window: int,
                offered: dict[str, Callable[[], Any]]) -> tuple[list[list[float]], list[list[float]], dict]:
    """(full, windowed, measured) of valuation `name`, given the offered values it declares
    (`offered[k]()` made only when read); refused, naming the valuation, when the values are not one
    number per layer and unit or `measured` is not a dict."""
    valuation = get_valuation(name)
    out = valuation.fn(model, batches, units, sink, window, **{k: offered[k]() for k in valuation.reads})
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], dict)):
        raise ValueError(f"kv_modes valuation {name!r} returned {type(out).__name__}; it must return (full, windowed, "
                         "measured: dict)")
    layers = model_shape(model)[0]
    for what, values in zip(("full", "windowed"), out[:2]):
        if len(values) != layers or any(len(row) != len(units) for row in values):
            raise ValueError(f"kv_modes valuation {name!r}: {what} must hold one value per layer and unit "
                             f"({layers} x {len(units)}); got {[len(row) for row in values]}")
    return out
