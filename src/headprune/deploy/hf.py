"""Saving and loading pruned models as transformers checkpoints.

`save_pruned` writes a `save_pretrained` folder plus one sidecar, `headprune_layout.json`
(deploy/layout_file.py: the model's `heads.layout.Layout`, kept heads and KV unit modes, and
what the folder is): a plain transformers checkpoint when every layer keeps the same query and KV
heads of a family whose config carries `head_dim` (Llama, Mistral, Qwen2), otherwise the original
config, from which `load_pruned` rebuilds the uneven shapes before the weights load (with several
attention stacks, heads.stacks, the layout's rows are the sites the file's `sites` names, checked
on load). The sidecar can record the dense model the export was pruned from (`dense_model`, read
back by `read_origin`), so a benchmark compares the export with its real origin rather than with a
model of its own (pruned) config. A hybrid's sidecar also says which model layers the layout's
rows are and which layers have no heads (`heads.hybrid.layer_report`). A model with windowed KV
units (`heads.windows`) has them in the sidecar's `kv_modes`, and only `load_pruned` applies them:
it attaches the windows again. Folders written before the one sidecar (headprune_export.json,
headprune_kv_modes.json) still load. Plain
transformers cannot apply the windows (it would attend every head to every token), so such a
folder's config.json names a model_type transformers does not know (`WINDOWED_MODEL_TYPE`, which
says to load it with headprune.load_pruned; the family's own is kept as `headprune_model_type`):
AutoConfig / AutoModel* / pipeline() refuse it with transformers' message quoting that type. A model
class's own from_pretrained only warns on a model_type mismatch, so the config's head count is that
text too (the count kept under `headprune_marked`): its typed config refuses it, quoting the text,
while AutoTokenizer (transformers' untyped base config) still loads the folder's tokenizer.
Removal-only exports keep their family's model_type and load plainly where their shapes allow.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoConfig

from headprune.atomic import staged_folder, write_json_atomic
from headprune.heads.adapters import get_adapter, head_layout
from headprune.heads.hybrid import layer_report
from headprune.heads.stacks import by_stack, check_sites, site_names, stacked
from headprune.deploy.layout_file import LAYOUT_FILE, Sidecar, read_sidecar, write_sidecar
from headprune.heads.layout import Layout
from headprune.heads.surgery import apply_layout
from headprune.heads.windows import KVWindows

log = logging.getLogger(__name__)
# config.json's model_type in a windowed export: unknown to transformers, so its Auto* loaders refuse it
# quoting this text (their ValueError: "...has model type `<this>` but Transformers does not recognize...")
WINDOWED_MODEL_TYPE = "headprune-windowed-kv: load with headprune.load_pruned"
ORIGINAL_TYPE_KEY = "headprune_model_type"  # the family's own model_type in such a config.json
# its head count is that text too, so that a model class's own from_pretrained (LlamaForCausalLM...), which
# only warns on a model_type mismatch, fails building its typed config, quoting it; the counts are kept here
# ({"<key>" or "<sub_config>.<key>": count}); transformers' untyped base config (AutoTokenizer's) still loads
MARKED_KEY = "headprune_marked"


@dataclass(frozen=True)
class Saved:
    """Where `save_pruned` wrote the model and whether plain `from_pretrained` loads it (`plain_hf`)
    or `load_pruned` is needed; `why` says which. Usable as the folder's path."""

    path: Path
    plain_hf: bool
    why: str

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def save_pruned(model: nn.Module, directory: str | Path, tokenizer=None, overwrite: bool = False,
                origin: str | None = None) -> Saved:
    """`save_pretrained` folder the model loads from, with its tokenizer if given.

    When every layer keeps the same numbers of query heads and KV heads (whole KV groups, none
    left empty) and the family's config carries `head_dim` (Llama, Mistral, Qwen2), the folder is a
    standard checkpoint whose config says those numbers: plain `AutoModel*.from_pretrained` loads
    it with no headprune code. Otherwise the folder holds the original config, and `load_pruned`
    rebuilds the uneven shapes. Either way `headprune_layout.json` beside it (deploy/layout_file.py)
    records the layout (the original ids of the heads kept, the KV unit modes) and which of the two
    the folder is. The return value and the log say which.

    `origin`: the dense model it was pruned from (a `model.pretrained` name or a folder), recorded as
    `dense_model` in headprune_layout.json for `read_origin` (the bench's
    dense baseline); None records none.

    A folder that already holds files is refused (old tokenizers or weights would be left beside
    the new model) unless `overwrite=True`, which replaces it.

    The folder is written as a temporary sibling and renamed into place once complete, so a kill
    mid-write leaves the old folder (or none), never a 0-byte config.json; an old folder is removed
    only after the new one is complete. Files get 0666 less the umask (save_pretrained's weights
    would be 0600), the folder 0777 less the umask."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save_pruned: {directory} exists and is not a folder")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"save_pruned: {directory} is not empty ({sorted(p.name for p in directory.iterdir())[:5]}"
                              "...); pass overwrite=True to replace its contents, or choose an empty folder")
    with staged_folder(directory) as staging:
        plain_hf, why = _write(model, staging, tokenizer, origin)
    result = Saved(directory, plain_hf, why)
    log.info("save_pruned: %s is %s (%s)", directory,
             "a plain transformers checkpoint" if result.plain_hf else "loadable with headprune.load_pruned", why)
    return result


def _write(model: nn.Module, directory: Path, tokenizer, origin: str | None) -> tuple[bool, str]:
    """Write the model (and tokenizer) into the empty folder `directory`: (plain_hf, why)."""
    adapter, layout = get_adapter(model), Layout.of_model(model)
    counts, why = plain_counts(model)
    if layout.windowed:
        counts, why = None, "windowed KV units: load_pruned attaches their masks and cache"
    recorded = {"model_type": model.config.model_type, "num_heads": adapter.num_heads(model.config)}
    recorded.update({"dense_model": origin} if origin is not None else {})
    recorded.update(layer_report(model))  # a hybrid: which model layers the layout's rows are, which have no heads
    if counts is None:
        model.save_pretrained(directory)
        if layout.windowed:
            _mark_windowed(directory / "config.json", model)
        if stacked(model):
            recorded.update(sites=site_names(model), layout_by_stack=by_stack(model, head_layout(model)))
    else:
        config, head_dim = model.config, adapter.head_dim(model.config)
        names = (adapter.heads_attr, adapter.kv_heads_attr, "head_dim")
        saved = {k: config.__dict__[k] for k in names if k in config.__dict__}  # absent ones are removed again
        try:
            setattr(config, adapter.heads_attr, counts[0])
            setattr(config, adapter.kv_heads_attr, counts[1])
            config.head_dim = head_dim
            model.save_pretrained(directory)
        finally:
            for k in names:
                if k in saved:
                    setattr(config, k, saved[k])
                elif k in config.__dict__:
                    delattr(config, k)
        recorded["original"] = saved
    write_sidecar(directory, layout, counts is not None, **recorded)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return counts is not None, why


def _mark_windowed(path: Path, model: nn.Module) -> None:
    """Give a windowed export's config.json the model_type transformers refuses and the head count its
    typed configs refuse (module docstring)."""
    config = json.loads(path.read_text())
    config[ORIGINAL_TYPE_KEY], config["model_type"] = config["model_type"], WINDOWED_MODEL_TYPE
    adapter = get_adapter(model)
    key = model.config.attribute_map.get(adapter.heads_attr, adapter.heads_attr)
    scope, prefix = (config.get(adapter.sub_config), f"{adapter.sub_config}.") if adapter.sub_config else (config, "")
    if isinstance(scope, dict) and isinstance(scope.get(key), int):
        config[MARKED_KEY] = {prefix + key: scope[key]}
        scope[key] = WINDOWED_MODEL_TYPE
    write_json_atomic(path, config)


def read_config(directory: str | Path):
    """The transformers config of a `save_pruned` folder: a windowed export's (whose config.json names
    `WINDOWED_MODEL_TYPE`) rebuilt with its family's own model_type, any other by AutoConfig."""
    from transformers import CONFIG_MAPPING

    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON (truncated or edited?): {err}") from None
    if not isinstance(data, dict) or data.get("model_type") != WINDOWED_MODEL_TYPE:
        return AutoConfig.from_pretrained(directory)
    original = data.pop(ORIGINAL_TYPE_KEY, None)
    if original not in CONFIG_MAPPING:
        raise ValueError(f"{path}: model_type {WINDOWED_MODEL_TYPE!r} with {ORIGINAL_TYPE_KEY}={original!r}, which "
                         "transformers does not know; allowed: the model_type of a transformers family (save_pruned "
                         "writes it)")
    sidecar = read_sidecar(directory)
    if sidecar is None or sidecar.kv is None:
        raise ValueError(f"{path} says the folder holds windowed KV units, but no {LAYOUT_FILE} with their modes is "
                         "beside it; restore it (save_pruned writes both)")
    data["model_type"] = original
    for name, value in data.pop(MARKED_KEY, {}).items():  # folders written before it have none
        *sub, key = name.split(".")
        (data[sub[0]] if sub else data)[key] = value
    return CONFIG_MAPPING[original].from_dict(data)


def plain_counts(model: nn.Module) -> tuple[tuple[int, int] | None, str]:
    """((query heads, KV heads) per layer, why) when the pruned model is a plain model of a config
    with those numbers; (None, why not) otherwise."""
    adapter, layout = get_adapter(model), head_layout(model)
    if not adapter.config_head_dim:
        return None, f"the {adapter.name} family's config has no head_dim of its own"
    per_layer = set()
    for kept in layout:
        groups = adapter.kv_groups(model.config, kept)
        sizes = {len(heads) for heads in groups.values()}
        if not kept or len(sizes) != 1:
            return None, "a layer has no heads or a KV group partly kept"
        per_layer.add((len(kept), len(groups)))
    if len(per_layer) != 1:
        return None, f"layers keep different numbers of heads ({sorted(per_layer)})"
    counts = per_layer.pop()
    refusal = _config_refusal(model.config, adapter, counts)
    if refusal:
        return None, refusal
    return counts, "the same query and KV heads in every layer"


def _config_refusal(config, adapter, counts: tuple[int, int]) -> str:
    """Why the family's own config class refuses these head counts (transformers 5 validates,
    e.g., that the hidden size is a multiple of the query heads), or ''. Such a layout is saved
    with its layout file instead, so the folder still loads (`load_pruned`)."""
    values = {**config.to_dict(), adapter.heads_attr: counts[0], adapter.kv_heads_attr: counts[1],
              "head_dim": adapter.head_dim(config)}
    try:
        type(config).from_dict(values)
    except Exception as err:  # noqa: BLE001 - huggingface_hub's StrictDataclassClassValidationError and kin
        return f"the {config.model_type} config refuses {counts[0]} query / {counts[1]} KV heads ({err})".replace("\n", " ")
    return ""


def load_pruned(directory: str | Path, device: str | torch.device | None = None,
                **from_pretrained_kwargs) -> nn.Module:
    """Load a `save_pruned` folder onto `device`; kwargs (dtype, attn_implementation, device_map
    with `accelerate` installed, ...) go to `from_pretrained`.

    Plain `from_pretrained` fails on uneven heads (size mismatches), so the model class named
    in `config.architectures` is built from the config, pruned to the saved layout, and only
    then given the weights. A folder without a layout file loads as a plain HF model.
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"load_pruned: {directory} holds no model (no config.json)")
    shapes = weight_shapes(directory)
    config = read_config(directory)
    cls = _model_class(config)
    if config.model_type != json.loads((directory / "config.json").read_text()).get("model_type"):
        from_pretrained_kwargs = {"config": config, **from_pretrained_kwargs}  # a windowed export's own type
    sidecar = read_sidecar(directory)
    if sidecar is None or sidecar.plain_hf:  # plain transformers shapes
        try:
            model = cls.from_pretrained(directory, **from_pretrained_kwargs)
        except RuntimeError as err:
            if "ignore_mismatched_sizes" not in str(err) and "size mismatch" not in str(err):
                raise
            raise ValueError(f"load_pruned: {directory} holds weights of a pruned model but no {LAYOUT_FILE} saying "
                             "which heads each layer kept; save it with headprune.save_pruned") from err
        return _windowed(model.to(device) if device is not None else model, sidecar)
    layout = sidecar.heads
    sites = sidecar.record.get("sites")

    class Pruned(cls):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            check_sites(self, sites, str(sidecar.path))  # several stacks: the rows are these sites
            apply_layout(self, layout, verify=False)  # the saved weights replace these next: nothing to compare
            check_layout_shapes(self, shapes, sidecar.path)

    Pruned.__name__ = Pruned.__qualname__ = cls.__name__
    # transformers renames legacy checkpoint keys (GPT-NeoX's embed_out -> lm_head) only for its own
    # classes (`is_custom_code` reads the module): without this the renamed weights would not load
    Pruned.__module__ = cls.__module__
    model = Pruned.from_pretrained(directory, **from_pretrained_kwargs)
    model.__class__ = cls
    return _windowed(model.to(device) if device is not None else model, sidecar)


def _windowed(model: nn.Module, sidecar: Sidecar | None) -> nn.Module:
    """`model` with the sidecar's windowed KV units attached, if it has any (the KV layout as the run
    attached it, after the whole layout is checked against the model)."""
    if sidecar is not None and sidecar.kv is not None and sidecar.kv.windowed:
        sidecar.layout(model)
        KVWindows(sidecar.kv).attach(model)
    return model


def read_layout(directory: str | Path) -> list[list[int]]:
    """The kept heads of a folder's sidecar (deploy/layout_file.py), checked: a list of lists of head ids."""
    sidecar = read_sidecar(directory)
    if sidecar is None:
        raise ValueError(f"{Path(directory) / LAYOUT_FILE} does not exist: {directory} is no headprune export")
    return sidecar.heads


def read_origin(directory: str | Path) -> str | None:
    """The dense model a `save_pruned` folder records it was pruned from (its sidecar's
    `dense_model`), or None when it records none (older exports, or no sidecar)."""
    sidecar = read_sidecar(directory)
    return None if sidecar is None else sidecar.record.get("dense_model")


def weight_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in a folder's *.safetensors files, read from their headers (cheap).
    A file that cannot be read (0 bytes, truncated by a kill or a full disk, not safetensors) is a
    ValueError naming it, rather than a SafetensorError naming nothing."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path} cannot be read ({err}): the weights file is truncated or not a safetensors "
                             "file; write the folder again (save_pruned, or the run's export)") from None
    return shapes


def check_layout_shapes(model: nn.Module, shapes: dict[str, tuple[int, ...]], layout_path: Path) -> None:
    """The model pruned to the layout file must have the weights' shapes; otherwise from_pretrained
    would re-initialise the mismatched tensors or fail naming neither file nor layer."""
    layout = head_layout(model)
    for key, tensor in model.state_dict().items():
        want = shapes.get(key)
        if want is None or tuple(tensor.shape) == want:
            continue
        layer = re.search(r"\.(\d+)\.", key)
        where = (f"layer {layer.group(1)} keeps {len(layout[int(layer.group(1))])} heads "
                 f"({layout[int(layer.group(1))]})") if layer and int(layer.group(1)) < len(layout) else "its layout"
        raise ValueError(f"{layout_path} says {where}, but {_weights_file(layout_path.parent, key)} holds {key} "
                         f"of shape {list(want)}, not {list(tensor.shape)}: the layout does not match the weights "
                         "(edited?); restore the file written with them")


def _weights_file(directory: Path, key: str) -> str:
    """The name of the safetensors file in `directory` that holds `key` (for error messages)."""
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if key in f.keys():
                return str(path)
    return f"{directory}/*.safetensors"


def _model_class(config) -> type:
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    raise ValueError(f"config.architectures={config.architectures} names no transformers model class; "
                     "cannot tell which model head to load")
