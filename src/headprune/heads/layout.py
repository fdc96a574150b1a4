"""`Layout`: what a pruned model keeps, the one currency between selection, surgery, the exporters
and the bench.

A layout holds, per layer (original numbering throughout):
- `modes`: each KV unit's mode (a KV group under GQA, a head without it): `full` (keeps every
  token), `window` (keeps its first `sink` tokens and its last `window` ones, heads/windows.py)
  or `removed` (physically gone: heads.surgery);
- `heads`: the query heads the layer keeps, or None for "every head of each unit not removed"
  (a KV-mode choice decides whole units). A unit is `removed` exactly when it keeps no head.

Why one type: the kept heads lived as a HeadMask tensor, `model.headprune_layout` lists, removal
dicts, the KV layout and the GGUF exporter's own per-layer counts, each converted by hand where
two met. Now selection returns a `Layout` (the KV-mode choice) or one is read off the model
(`Layout.of_model`, with a HeadMask: its runtime view, `of_mask` / `to_mask`); surgery applies it
(`apply`); the exporters and the bench read it (`of_model`), and an export folder stores it in one
file (deploy/layout_file.py).

On a model: the physically kept heads are `model.headprune_layout` (heads.adapters.LAYOUT_ATTR,
kept by surgery), the window modes the layout attached by `heads.windows.KVWindows`
(`KV_LAYOUT_ATTR`); `of_model` joins the two.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from headprune.heads.adapters import get_adapter, head_layout, model_shape
from headprune.heads.sliding import native_windows

FULL, WINDOW, REMOVED = "full", "window", "removed"
MODES = (FULL, WINDOW, REMOVED)
KV_LAYOUT_ATTR = "headprune_kv_layout"  # the Layout a model's window hooks apply (heads.windows.KVWindows)


def _size(value, name: str, least: int, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{where}: field {name!r} is {value!r}; allowed: an integer >= {least}"
                         if where != "kv_modes" else f"kv_modes.{name}={value!r} must be an integer >= {least}")


@dataclass(frozen=True)
class Layout:
    """modes[l][u]: the mode of unit u (a KV group, original numbering) of layer l; `sink` +
    `window` tokens are what a windowed unit keeps; heads[l]: the query heads layer l keeps
    (original ids, ascending), None: every head of its units not removed (module docstring)."""

    modes: tuple[tuple[str, ...], ...]
    sink: int = 0
    window: int = 1
    heads: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", tuple(tuple(layer) for layer in self.modes))
        for name, least in (("sink", 0), ("window", 1)):
            _size(getattr(self, name), name, least, "kv_modes")
        for l, layer in enumerate(self.modes):
            for u, mode in enumerate(layer):
                if mode not in MODES:
                    raise ValueError(f"kv_modes layer {l} unit {u}: mode {mode!r} is not allowed; allowed: "
                                     f"{', '.join(MODES)}")
        if self.heads is not None:
            heads = tuple(tuple(layer) for layer in self.heads)
            if len(heads) != len(self.modes):
                raise ValueError(f"layout: kept heads for {len(heads)} layers, modes for {len(self.modes)}")
            for l, layer in enumerate(heads):
                if any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in layer) or \
                        list(layer) != sorted(set(layer)):
                    raise ValueError(f"layout layer {l}: kept heads {list(layer)}; allowed: distinct head ids >= 0, "
                                     "ascending")
            object.__setattr__(self, "heads", heads)

    # -- made from ------------------------------------------------------------------------------
    @classmethod
    def uniform(cls, model: nn.Module, mode: str, sink: int, window: int) -> "Layout":
        """Every unit of every layer in one mode."""
        n_layers, n_units = units_of(model)
        return cls(tuple((mode,) * n_units for _ in range(n_layers)), sink, window)

    @classmethod
    def of_model(cls, model: nn.Module, mask=None) -> "Layout":
        """The layout `model` has as it stands: the heads it physically keeps (surgery) and, with a
        HeadMask `mask`, not gated off; each unit removed when none of its heads is left, else its
        attached KV layout's mode (heads.windows), else full."""
        adapter, config = get_adapter(model), model.config
        kept = head_layout(model)
        if mask is not None:
            alive = mask.alive()  # (layers, heads) bool
            kept = [[h for h in layer if bool(alive[l, h])] for l, layer in enumerate(kept)]
        attached = getattr(model, KV_LAYOUT_ATTR, None)
        units = unit_heads(model)
        modes = []
        for l, layer in enumerate(kept):
            have = set(layer)
            modes.append(tuple(REMOVED if not have & set(heads) else
                               (attached.modes[l][u] if attached is not None else FULL)
                               for u, heads in enumerate(units)))
        sink, window = (attached.sink, attached.window) if attached is not None else (0, 1)
        return cls(tuple(modes), sink, window, tuple(tuple(sorted(layer)) for layer in kept))

    of_mask = of_model  # the HeadMask's view of a model as a Layout: `Layout.of_mask(model, mask)`

    # -- reading ----------------------------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Tokens a windowed unit keeps at most."""
        return self.sink + self.window

    @property
    def windowed(self) -> bool:
        """Whether any unit is windowed."""
        return any(WINDOW in layer for layer in self.modes)

    def count(self, layer: int, mode: str) -> int:
        return sum(m == mode for m in self.modes[layer])

    def options(self) -> list[tuple[int, int]]:
        """(units full, units windowed) per layer: the keys of a KV mode cost table."""
        return [(self.count(l, FULL), self.count(l, WINDOW)) for l in range(len(self.modes))]

    def kept_heads(self, model: nn.Module) -> list[list[int]]:
        """Per layer, the query heads kept (original ids): `heads`, or every head of the units not removed."""
        if self.heads is not None:
            return [list(layer) for layer in self.heads]
        units = unit_heads(model)
        return [sorted(h for u, mode in enumerate(layer) if mode != REMOVED for h in units[u]) for layer in self.modes]

    def removed_heads(self, model: nn.Module) -> dict[int, list[int]]:
        """{layer: query heads not kept}, for `HeadMask.prune` / `heads.surgery.prune_heads`."""
        n_heads = model_shape(model)[1]
        out = {}
        for l, kept in enumerate(self.kept_heads(model)):
            gone = sorted(set(range(n_heads)) - set(kept))
            if gone:
                out[l] = gone
        return out

    def check(self, model: nn.Module) -> "Layout":
        """Refuse a layout whose shape is not the model's (layers x units, original numbering), one
        that windows a natively sliding layer, or whose kept heads contradict its modes."""
        n_layers, n_units = units_of(model)
        shape = [len(layer) for layer in self.modes]
        if shape != [n_units] * n_layers:
            raise ValueError(f"kv_modes has {len(shape)} layers with {shape} units; the model has {n_layers} layers of "
                             f"{n_units} units (KV groups, or heads without GQA)")
        for l, native in enumerate(native_windows(model.config)):
            if native is not None and WINDOW in self.modes[l]:
                raise ValueError(f"kv_modes layer {l} windows unit {self.modes[l].index(WINDOW)}, but the model's layer {l} "
                                 f"already slides its own window of {native} tokens (heads.sliding); allowed there: "
                                 f"{FULL} (what its window keeps) or {REMOVED}")
        if self.heads is not None:
            n_heads, units = model_shape(model)[1], unit_heads(model)
            for l, layer in enumerate(self.heads):
                if any(h >= n_heads for h in layer):
                    raise ValueError(f"layout layer {l} keeps head {max(layer)}, outside the model's heads "
                                     f"0..{n_heads - 1}")
                for u, heads in enumerate(units):
                    if (self.modes[l][u] == REMOVED) != (not set(heads) & set(layer)):
                        raise ValueError(f"layout layer {l} unit {u} is {self.modes[l][u]} but keeps heads "
                                         f"{sorted(set(heads) & set(layer))}; a unit is removed exactly when it keeps "
                                         "no head")
        return self

    # -- runtime view and application --------------------------------------------------------------
    def to_mask(self, model: nn.Module, attach: bool = True):
        """A HeadMask of `model` whose gates keep exactly this layout's heads (its runtime view)."""
        from headprune.heads.mask import HeadMask

        mask = HeadMask.for_model(model, attach=attach)
        mask.prune(self.removed_heads(model))
        return mask

    def apply(self, model: nn.Module):
        """Put the layout on `model`: the heads it does not keep physically removed (heads.surgery;
        a head already removed stays removed, one the layout keeps must still be there), its windowed
        units restricted (`heads.windows.KVWindows`, returned so it can be detached)."""
        from headprune.heads.surgery import prune_heads
        from headprune.heads.windows import KVWindows

        self.check(model)
        now = head_layout(model)
        wanted = self.kept_heads(model)
        for l, (have, want) in enumerate(zip(now, wanted)):
            if set(want) - set(have):
                raise ValueError(f"layout layer {l} keeps heads {sorted(set(want) - set(have))}, which the model no "
                                 "longer has (removed heads cannot come back)")
        prune_heads(model, {l: [h for h in have if h not in set(want)] for l, (have, want) in enumerate(zip(now, wanted))
                            if set(have) - set(want)})
        return KVWindows(self).attach(model)

    # -- JSON ---------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = {"modes": [list(layer) for layer in self.modes], "sink": self.sink, "window": self.window}
        if self.heads is not None:
            data["heads"] = [list(layer) for layer in self.heads]
        return data

    @classmethod
    def from_json(cls, data: dict, where: str = "kv_modes") -> "Layout":
        """The layout a JSON object holds (`heads` optional); `where` (the file) is named in every
        refusal, with the field, since the values are the file's, not the user's settings."""
        if not isinstance(data, dict) or not {"modes", "sink", "window"} <= set(data):
            raise ValueError(f"{where}: expected an object with modes, sink and window, got {data!r}")
        modes = data["modes"]
        if not isinstance(modes, list) or not all(isinstance(layer, list) for layer in modes):
            raise ValueError(f"{where}: modes must be a list (layers) of lists of modes ({', '.join(MODES)})")
        for name, least in (("sink", 0), ("window", 1)):
            _size(data[name], name, least, where)
        heads = data.get("heads")
        if heads is not None and (not isinstance(heads, list) or not all(isinstance(layer, list) for layer in heads)):
            raise ValueError(f"{where}: field 'heads' must be a list (layers) of lists of kept head ids, got {heads!r}")
        try:
            return cls(tuple(tuple(layer) for layer in modes), data["sink"], data["window"],
                       None if heads is None else tuple(tuple(layer) for layer in heads))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def units_of(model: nn.Module) -> tuple[int, int]:
    """(layers, units per layer) of the original model: a unit is a KV head."""
    n_layers, _ = model_shape(model)
    return n_layers, get_adapter(model).num_kv_heads(model.config)


def unit_heads(model: nn.Module) -> list[list[int]]:
    """units[u]: the query heads (original ids) of KV unit u, the same in every layer."""
    adapter, config = get_adapter(model), model.config
    return list(adapter.kv_groups(config, range(adapter.num_heads(config))).values())

