"""A preset yaml built on a typed schema (`defaults: [/schema/<group>/<name>@_here_]`: the schema's
defaults are the code's, derived from the dataclass or function signature by apps/config_schema.py)
sets only what differs from the code: a value equal to the schema's default is a copy that would
stop a change of the code's default from reaching `headprune-train <group>=<option>`."""
from pathlib import Path

import pytest
import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from headprune.apps.config_paths import config_dir
from headprune.apps.config_schema import register_schemas

register_schemas()


def schema_of(doc: dict) -> str | None:
    """The `/schema/...@_here_` entry of a yaml's defaults list, as a ConfigStore path."""
    found = [d for d in doc.get("defaults") or [] if isinstance(d, str) and d.startswith("/schema/")
             and d.endswith("@_here_")]
    return found[0].removeprefix("/").removesuffix("@_here_") + ".yaml" if found else None


def repeated(path: Path) -> dict:
    """{key: value} the yaml sets to exactly the schema's default (a nested mapping compared key by key)."""
    doc = yaml.safe_load(path.read_text()) or {}
    schema = OmegaConf.to_container(ConfigStore.instance().load(schema_of(doc)).node, resolve=False)

    def walk(own: dict, base: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in own.items():
            if key == "defaults" and not prefix or key not in base:
                continue
            if isinstance(value, dict) and isinstance(base[key], dict) and value:
                out.update(walk(value, base[key], f"{prefix}{key}."))
            elif value == base[key]:
                out[f"{prefix}{key}"] = value
        return out
    return walk(doc, schema)


PRESETS = sorted(p for p in config_dir().rglob("*.yaml")
                 if isinstance(doc := yaml.safe_load(p.read_text()), dict) and schema_of(doc))


def test_the_typed_groups_have_presets():
    groups = {p.parent.name for p in PRESETS}
    assert groups >= {"schedule", "kv_modes", "recovery", "budget", "layer_policy", "metric"}, groups


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_preset_sets_only_what_differs_from_the_codes_default(path):
    assert not repeated(path), (f"{path.relative_to(config_dir())} repeats the schema's defaults (drop them: the "
                                f"code's default applies): {repeated(path)}")


def test_a_repeated_default_is_found(tmp_path):
    """The check itself: schedule=iterative with its step written out again fails."""
    copy = tmp_path / "iterative.yaml"
    copy.write_text((config_dir() / "schedule" / "iterative.yaml").read_text() + "\nstep: 0.1\ntarget_sparsity: 0.4\n")
    assert repeated(copy) == {"step": 0.1}
