"""The one sidecar file of an export folder, `headprune_layout.json`, and its one reader.

What it holds (format 2, written by `deploy.hf.save_pruned` beside config.json and the weights):

    {"format": 2,
     "layout": [[kept query head ids, original numbering], ...],    # per layer
     "kv_modes": {"modes": [["full" | "window" | "removed", ...], ...],  # per layer, per KV unit
                  "sink": int, "window": int},
     "plain_hf": bool,            # true: config.json already has the pruned head counts
     "original": {...},           # plain_hf only: the config's head attributes before (restored on load)
     "model_type": str, "num_heads": int,  # the dense model's family and query heads per layer
     "dense_model": str,          # optional: the model it was pruned from (the bench's baseline)
     "sites": [...], "layout_by_stack": {...},  # several attention stacks: which rows are which
     "hybrid": ...}               # a hybrid model: which layers the rows are (heads.hybrid.layer_report)

`layout` + `kv_modes` are one `heads.layout.Layout` (`Layout.to_json`'s modes / sink / window,
with `layout` its `heads`). Why one file: an export used to carry the kept heads in
headprune_layout.json (uneven shapes) or headprune_export.json (plain transformers shapes), and
its windows in headprune_kv_modes.json, each read by its own code. Folders written before
(no "format") still load: `read_sidecar` reads those files and returns the same `Sidecar`; saving
such a model again writes this one file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from headprune.atomic import write_json_atomic
from headprune.heads.layout import Layout
from headprune.heads.surgery import integer_id

LAYOUT_FILE = "headprune_layout.json"
FORMAT = 2
# written before format 2 (read, never written): the kept heads of a plain-shaped export, and the windows
OLD_EXPORT_FILE = "headprune_export.json"
OLD_MODES_FILE = "headprune_kv_modes.json"
RECORD_KEYS = ("model_type", "num_heads", "dense_model", "sites", "layout_by_stack", "original")


@dataclass(frozen=True)
class Sidecar:
    """What an export folder's sidecar says: the kept heads per layer (`heads`), the KV layout
    (`kv`: None for an old folder written without windows, whose units' modes follow from the
    heads once the model is known: `layout`), whether config.json holds the pruned shapes
    (`plain_hf`), the rest of the file (`record`), and the file(s) read (`path`, for messages)."""

    heads: list[list[int]]
    kv: Layout | None
    plain_hf: bool
    record: dict = field(default_factory=dict)
    path: Path = Path(LAYOUT_FILE)

    def layout(self, model) -> Layout:
        """The folder's Layout on `model` (the dense-shaped model it is loaded into): the kept heads
        with the file's modes (or, for an old folder without windows, each unit full unless it
        keeps no head), checked against the model."""
        base = Layout.from_json({**self.kv.to_json(), "heads": self.heads}, where=str(self.path)) if self.kv \
            else _modes_from_heads(model, self.heads)
        try:
            return base.check(model)
        except ValueError as err:
            raise ValueError(f"{self.path}: {err}") from None


def _modes_from_heads(model, heads: list[list[int]]) -> Layout:
    from headprune.heads.layout import FULL, REMOVED, unit_heads

    units = unit_heads(model)
    modes = tuple(tuple(FULL if set(u) & set(kept) else REMOVED for u in units) for kept in heads)
    return Layout(modes, heads=tuple(tuple(sorted(kept)) for kept in heads))


def write_sidecar(directory: str | Path, layout: Layout, plain_hf: bool, **record) -> Path:
    """Write `directory`'s sidecar (module docstring) for `layout` (complete: `Layout.of_model`)."""
    if layout.heads is None:
        raise ValueError("write_sidecar needs the kept heads of every layer (Layout.of_model gives them)")
    data = {"format": FORMAT, "layout": [list(layer) for layer in layout.heads],
            "kv_modes": {k: v for k, v in layout.to_json().items() if k != "heads"}, "plain_hf": plain_hf, **record}
    path = Path(directory) / LAYOUT_FILE
    write_json_atomic(path, data)
    return path


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON (truncated or edited?): {err}") from None


def read_sidecar(directory: str | Path) -> Sidecar | None:
    """The sidecar of export folder `directory` (format 2, or the files written before it), checked;
    None when the folder has none (a plain transformers folder)."""
    directory = Path(directory)
    path, old_export, old_modes = (directory / n for n in (LAYOUT_FILE, OLD_EXPORT_FILE, OLD_MODES_FILE))
    if path.is_file():
        data = _json(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds {type(data).__name__}, not an object with a 'layout' entry")
        if "format" in data and data["format"] != FORMAT:
            raise ValueError(f"{path}: field 'format' is {data['format']!r}; allowed: {FORMAT} (written by this "
                             "headprune) or none (older exports)")
        heads = _heads(data, "layout", path)
        if "format" in data:
            kv_data = data.get("kv_modes")
            kv = Layout.from_json(kv_data, where=f"{path}: field 'kv_modes'")
            plain = data.get("plain_hf")
            if not isinstance(plain, bool):
                raise ValueError(f"{path}: field 'plain_hf' is {plain!r}; allowed: true or false")
        else:  # before format 2: uneven shapes here, windows in their own file
            kv, plain = (_old_modes(old_modes) if old_modes.is_file() else None), False
    elif old_export.is_file():  # before format 2: plain transformers shapes
        data = _json(old_export)
        path, plain = old_export, True
        heads = _heads(data, "kept_heads", path)
        kv = None
    else:
        return None
    if kv is not None and len(kv.modes) != len(heads):
        raise ValueError(f"{path}: 'kv_modes' has {len(kv.modes)} layers, 'layout' {len(heads)}")
    record = {k: data[k] for k in RECORD_KEYS if k in data}
    record.update({k: v for k, v in data.items() if k not in RECORD_KEYS and k not in
                   ("format", "layout", "kv_modes", "plain_hf", "kept_heads")})
    return Sidecar(heads, kv, plain, record, path)


def _old_modes(path: Path) -> Layout:
    return Layout.from_json(_json(path), where=str(path))


def _heads(data: dict, key: str, path: Path) -> list[list[int]]:
    """`data[key]`: one list of kept head ids per layer, each id once and within `num_heads` when given."""
    if not isinstance(data, dict) or key not in data:
        raise ValueError(f"{path} has no {key!r} entry (the original ids of the heads each layer kept)")
    layout = data[key]
    if not isinstance(layout, list) or not all(isinstance(kept, list) for kept in layout):
        raise ValueError(f"{path}: {key!r} must be a list with one list of kept head ids per layer; got {layout!r}")
    layout = [[integer_id(h, f"{path.name} layer {i} head") for h in kept] for i, kept in enumerate(layout)]
    num_heads = data.get("num_heads")
    for i, kept in enumerate(layout):
        twice = sorted({h for h in kept if kept.count(h) > 1})
        if twice:
            raise ValueError(f"{path}: layer {i} lists head {twice[0]} twice ({kept}); each kept head id once")
        if isinstance(num_heads, int) and any(not 0 <= h < num_heads for h in kept):
            bad = next(h for h in kept if not 0 <= h < num_heads)
            raise ValueError(f"{path}: layer {i} keeps head {bad}, outside the original heads 0..{num_heads - 1}")
    return layout


def read_layout(path: str | Path, where: str | None = None) -> Layout:
    """The KV layout (modes, sink, window; no kept heads: a KV-mode choice decides whole units) at
    `path`: a run's results.json (`final.kv_layout`), an export folder or its
    sidecar file (either format: for an old folder, its headprune_kv_modes.json), or a bare layout
    JSON; refused, naming the file, when it holds none. `where` prefixes the refusals (the setting)."""
    where = where or str(path)
    file = Path(path)
    if file.is_dir():
        sidecar = read_sidecar(file)
        if sidecar is None or sidecar.kv is None:
            raise ValueError(f"{where}: {file} holds no KV layout (no {LAYOUT_FILE} with kv_modes, nor an older "
                             f"{OLD_MODES_FILE}); allowed: a run's results.json, an export folder of a kv_modes run, "
                             "or its layout file")
        return sidecar.kv
    if not file.is_file():
        raise ValueError(f"{where}: no such file ({file}); allowed: a run's results.json, an export folder with "
                         f"{LAYOUT_FILE}, or such a file")
    data = _json(file)
    if isinstance(data, dict) and isinstance(data.get("final"), dict):
        if "kv_layout" not in data["final"]:
            raise ValueError(f"{where}: {file} is a results.json without final.kv_layout (a run without kv modes, or "
                             "one that did not finish)")
        data = data["final"]["kv_layout"]
    elif isinstance(data, dict) and "format" in data:  # a sidecar file itself
        sidecar = read_sidecar(file.parent) if file.name == LAYOUT_FILE else None
        if sidecar is None:
            raise ValueError(f"{where}: {file} is a sidecar named otherwise; allowed: {LAYOUT_FILE}")
        return sidecar.kv
    elif isinstance(data, dict) and "layout" in data and "modes" not in data:  # an old uneven-shapes sidecar
        raise ValueError(f"{where}: {file} holds kept heads but no KV layout (an older export without windows); "
                         "allowed: a run's results.json, a kv_modes run's export folder, or its layout file")
    return Layout.from_json(data, where=str(file))
