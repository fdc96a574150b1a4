"""The configuration reference (docs/configuration.md), generated from conf/ and the typed schemas.

No table here is kept by hand: every group and option is a file under conf/, every option's keys
and defaults are what Hydra composes for `headprune-train <group>=<option>` (the typed schemas'
defaults merged with the yaml), the types come from the schemas in Hydra's ConfigStore
(`apps/config_schema.py`, derived from the code), the descriptions from the comments in the yaml
files and the schema classes' source, and the "refused" column from the code itself: each typed
option's class is built with a few out-of-range values per field (-1, 0, 1.5, an unknown word) and
the error it raises is quoted, so the ranges shown are the ones the code enforces.

    python -m tools.config_reference            # rewrite docs/configuration.md
    python -m tools.config_reference --check    # exit 1 if it is not current

tests/test_config_reference.py runs the check, so a new option or a changed default fails the suite
until the page is regenerated. Repository tooling (tools/, run from the repository root): not in the wheel.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from headprune.apps.config_paths import config_dir
from headprune.apps.config_schema import register_schemas

GLOBAL_GROUPS = ("experiment", "debug")  # `# @package _global_` overrides of the whole config
PROBES = {int: (-1, 0), float: (-1.0, 0.0, 1.5), str: ("no_such_value",)}
KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*)\s*:(.*)$")


# -- reading conf/ ------------------------------------------------------------------------------
def groups(conf: Path) -> dict[str, list[str]]:
    """{group (`hydra/sweeper` for nested ones): its option names}, from the yaml files. A folder
    inside a global group holds an experiment's arms file (conf/experiment/llm_kv/arms.yaml): not an
    option; the arms have their own pages, docs/arms/<experiment>.md (tools/arms_reference.py)."""
    found: dict[str, list[str]] = {}
    for path in sorted(conf.rglob("*.yaml")):
        if path.parent == conf:
            continue
        group = path.parent.relative_to(conf).as_posix()
        if group.split("/")[0] in GLOBAL_GROUPS and "/" in group:
            continue
        found.setdefault(group, []).append(path.stem)
    return {group: sorted(names) for group, names in found.items()}


def default_options(conf: Path) -> dict[str, str]:
    """{group: the option train.yaml's defaults list picks}."""
    listed = OmegaConf.to_container(OmegaConf.load(conf / "train.yaml").defaults)
    picked = {}
    for entry in listed:
        if isinstance(entry, dict):
            for key, value in entry.items():
                if value is not None:
                    picked[key.removeprefix("override ")] = value
    return picked


def yaml_comments(text: str) -> tuple[str, dict[str, str]]:
    """(the file's leading comment block as Markdown, {dotted key: the comment above it or beside it}).
    Header lines indented after their `#` (`#   headprune-train ...`) are commands: a code block."""
    lines = text.splitlines()
    prose, commands, i = [], [], 0
    while i < len(lines) and lines[i].lstrip().startswith("#"):
        raw = lines[i].strip()[1:]
        line = raw.strip()
        if raw.startswith("  ") and line:
            commands.append(line)
        elif line and not line.startswith("@package"):
            prose.append(line)
        i += 1
    header = cell(" ".join(prose))
    if commands:
        header += "\n\n```bash\n" + "\n".join(commands) + "\n```"
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    above: list[str] = []
    in_defaults = False
    for line in lines[i:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = KEY.match(line)
        if not match or stripped.startswith("-"):
            above = []
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
        if indent == 0:
            in_defaults = key == "defaults"
        if in_defaults:
            above = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        beside = rest.split(" #", 1)[1].strip() if " #" in rest else ""
        text_ = " ".join(part for part in (" ".join(above), beside) if part)
        if text_:
            comments[".".join(k for _, k in stack)] = text_
        above = []
    return header, comments


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of a nested dict (lists and empty dicts are leaves)."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


# -- the typed schemas --------------------------------------------------------------------------
def schema_class(target: str | None):
    """The class (or function) a `_target_` names, or None."""
    if not target:
        return None
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def source_comments(obj) -> dict[str, str]:
    """{field: the comment beside its declaration} in a dataclass's source (and its bases')."""
    found: dict[str, str] = {}
    for cls in reversed(getattr(obj, "__mro__", ())):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        for match in re.finditer(r"^\s+(\w+)\s*:[^=\n]+=[^#\n]*#\s*(.+)$", source, re.M):
            found[match.group(1)] = match.group(2).strip()
    return found


def field_types(obj) -> dict[str, str]:
    """{option: its annotated type, as written} of a dataclass's fields or a metric's keyword options."""
    try:
        hints = typing.get_type_hints(obj)
    except Exception:  # noqa: BLE001 - an annotation the docs cannot resolve is shown as unknown
        hints = {}
    names = ([f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj)
             else list(inspect.signature(obj).parameters) if callable(obj) else [])
    return {name: _type_name(hints[name]) for name in names if name in hints}


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def refusals(cls, values: dict[str, Any], group: str) -> dict[str, list[str]]:
    """{field: the errors the class raises when built with an out-of-range value of it}: what the
    code refuses at start, quoted. Only dataclasses that check their fields when built are probed."""
    if not (dataclasses.is_dataclass(cls) and hasattr(cls, "__post_init__")):
        return {}
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    base = {k: v for k, v in values.items() if k in names}
    try:
        cls(**base)
    except Exception:  # noqa: BLE001 - an option whose defaults need a model cannot be probed alone
        return {}
    hints = typing.get_type_hints(cls)
    found: dict[str, list[str]] = {}
    for name in sorted(names):
        kind = _probe_kind(hints.get(name))
        for probe in PROBES.get(kind, ()):
            try:
                cls(**{**base, name: probe})
            except (ValueError, TypeError) as err:
                message = str(err).splitlines()[0].replace(f"{name}={probe!r}", f"{name}=…")
                if f"{group}.{name}" in message or name in message:
                    found.setdefault(name, [])
                    if message not in found[name]:
                        found[name].append(message)
    return found


def _probe_kind(annotation: Any):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1:
        annotation = args[0]
    if annotation is bool:
        return None
    return annotation if annotation in PROBES else None


# -- the page -----------------------------------------------------------------------------------
def cell(value: Any) -> str:
    """A Markdown table cell: values in code, text with | and < escaped."""
    return str(value).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def code(value: Any) -> str:
    if isinstance(value, str) and value == "":
        return '`""`'
    if isinstance(value, (list, dict)):
        text = json.dumps(value, ensure_ascii=False)
    else:
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{cell(text)}`"


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def node_types(node, prefix: str = "") -> dict[str, str]:
    """{dotted key: its declared type} of a composed config node: the annotations of the schemas
    it was built from (a group's option schema, or a typed block inside it such as
    data.self_calibration); keys without a schema are left out."""
    from omegaconf import DictConfig

    found: dict[str, str] = {}
    for key in node.keys() if isinstance(node, DictConfig) else ():
        child = node._get_node(key)
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(child, DictConfig) and len(child):
            found.update(node_types(child, path))
            continue
        ref = child._metadata.ref_type
        if ref is not Any and ref is not None:
            name = _type_name(ref)
            found[path] = f"Optional[{name}]" if child._metadata.optional else name
    return found


def typed_blocks(node, prefix: str = ""):
    """(dotted path, dataclass) of every block below `node` built from a dataclass schema that
    checks its fields (`__post_init__`): what `refusals` can probe."""
    from omegaconf import DictConfig

    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and len(child):
            path = f"{prefix}.{key}" if prefix else str(key)
            cls = OmegaConf.get_type(child)
            if dataclasses.is_dataclass(cls) and "__post_init__" in vars(cls):
                yield path, cls
            yield from typed_blocks(child, path)


def option_table(group: str, values: dict, node, comments: dict[str, str], target) -> list[str]:
    """The rows of one option: key, declared type, composed default, description, refusals."""
    types = {**(field_types(target) if target is not None else {}), **node_types(node)}
    beside = source_comments(target) if target is not None else {}
    refused = refusals(target, values, group) if target is not None else {}
    for path, cls in typed_blocks(node):
        block = path.split(".")
        sub = values
        for part in block:
            sub = sub[part]
        for key, messages in refusals(cls, sub, f"{group}.{path}").items():
            refused[f"{path}.{key}"] = messages
        beside.update({f"{path}.{k}": v for k, v in source_comments(cls).items()})
    rows = ["| key | type | default | description | refused when built (the code's message) |",
            "|---|---|---|---|---|"]
    for key, value in flatten(values).items():
        if key in ("_target_", "_partial_") or not key:
            continue
        kind = types.get(key)
        rows.append(f"| `{group}.{key}` | {cell(kind or value_type(value))} "
                    f"| {code(value)} | {cell(comments.get(key) or beside.get(key, ''))} "
                    f"| {'<br>'.join(cell(m) for m in refused.get(key, []))} |")
    return rows + [""]


def value_type(value: Any) -> str:
    """The yaml value's type name; nothing for null and for `${...}` interpolations."""
    if value is None or (isinstance(value, str) and "${" in value):
        return ""
    return type(value).__name__


def render() -> str:
    register_schemas()
    conf = config_dir()
    options = groups(conf)
    defaults = default_options(conf)
    base = OmegaConf.to_container(compose([]), resolve=False)
    out = ["# Configuration reference", "",
           "Generated by `python -m tools.config_reference` from `conf/` and the typed schemas",
           "(`src/headprune/apps/config_schema.py`); `tests/test_config_reference.py` fails when this page is not",
           "current. Do not edit it by hand.", "",
           "Choose an option of a group with `group=option`, set a key with `group.key=value`",
           "(`headprune-train schedule=one_shot schedule.target_sparsity=0.7`). Defaults are what Hydra",
           "composes for that option; `${...}` values are interpolations resolved when a run starts. The last",
           "column quotes the error the code raises when the option's object is built with an out-of-range",
           "value of that key (probed with -1, 0, 1.5 or an unknown word): the ranges the code enforces.",
           "Typed options (a schema in Hydra's ConfigStore, `schema/...`; `in part`: only a block inside them)",
           "also refuse a misspelt key or a wrong type when the config is composed.", "",
           "## Groups", "", "| group | options | default | typed |", "|---|---|---|---|"]
    table_at = len(out)
    typed: dict[str, set[str]] = {}
    out += ["", "## Outside the groups", "",
            "Keys of `conf/train.yaml` itself, and the `evaluation` block (its schema: `schema/evaluation`).", ""]
    header, comments = yaml_comments((conf / "train.yaml").read_text())
    top = {k: v for k, v in base.items() if k not in options and k not in ("evaluation", "hydra")}
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    said = set()
    for key, value in flatten(top).items():
        block = key.split(".")[0]
        text = comments.get(key, "")
        if block != key and block in comments and block not in said:  # a block's comment, on its first key
            text = f"{comments[block]} {text}".strip()
            said.add(block)
        rows.append(f"| `{key}` | {value_type(value)} | {code(value)} | {cell(text)} |")
    out += rows
    from hydra.core.config_store import ConfigStore

    evaluation = ConfigStore.instance().repo["schema"]["evaluation.yaml"].node
    settings = OmegaConf.get_type(evaluation)
    out += ["", "### `evaluation`", "", cell(inspect.getdoc(settings) or ""), ""]
    out += option_table("evaluation", base["evaluation"], compose([])["evaluation"], {}, settings)
    from headprune.apps.arms import experiments_with_arms

    with_arms = experiments_with_arms(conf)
    for group, names in options.items():
        out += ["", f"## {group}", ""]
        if group in GLOBAL_GROUPS:
            out += [f"`{group}=<option>` overrides the whole config (`# @package _global_`); each option's table is",
                    "what it sets, relative to the defaults.", ""]
        for name in names:
            path = conf / group / f"{name}.yaml"
            header, comments = yaml_comments(path.read_text())
            mark = " (default)" if defaults.get(group) == name else ""
            out += [f"### `{group}={name}`{mark}", "", header or "(no description in the file)", ""]
            if group == "experiment" and name in with_arms:
                out += [f"Its arms, `experiment={name}/<arm>`: [Arms of {name}](arms/{name}.md).", ""]
            if group.startswith("hydra/") or group in GLOBAL_GROUPS:
                raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
                chosen = [f"`{next(iter(e)).removeprefix('override ').lstrip('/')}={next(iter(e.values()))}`"
                          for e in raw.pop("defaults", []) if isinstance(e, dict)]
                if chosen:
                    out += ["Options chosen: " + ", ".join(chosen), ""]
                flat = flatten(raw)
                if flat:
                    out += ["| key | value | description |", "|---|---|---|"]
                    out += [f"| `{k}` | {code(v)} | {cell(comments.get(k, ''))} |" for k, v in flat.items()]
                    out.append("")
                continue
            node = compose([f"{group}={name}"])[group]
            values = OmegaConf.to_container(node, resolve=False)
            target = schema_class(values.get("_target_"))
            typed.setdefault(group, set()).add("yes" if dataclasses.is_dataclass(OmegaConf.get_type(node))
                                               else "in part" if node_types(node) else "no")
            if not [k for k, v in flatten(values).items() if k and k not in ("_target_", "_partial_")]:
                out += ["No keys.", ""]
                continue
            out += option_table(group, values, node, comments, target)
    rows = []
    for group, names in options.items():
        kinds = typed.get(group, {"no"})
        kind = "yes" if kinds == {"yes"} else "no" if kinds == {"no"} else "in part"
        rows.append(f"| [`{group}`](#{group.replace('/', '')}) | {', '.join(f'`{n}`' for n in names)} "
                    f"| {code(defaults[group]) if group in defaults else '–'} | {kind} |")
    out[table_at:table_at] = rows
    return "\n".join(out) + "\n"


def page_path() -> Path:
    """docs/configuration.md of this repository (the tool is not in the wheel: it documents the checkout)."""
    return Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is not current")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default docs/configuration.md)")
    args = parser.parse_args(argv)
    text = render()
    target = args.out or page_path()
    if args.check:
        if not target.is_file() or target.read_text() != text:
            print(f"{target} is not current: run python -m tools.config_reference", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
