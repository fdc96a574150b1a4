"""docs/configuration.md is what `python -m tools.config_reference` generates from conf/
and the typed schemas: current, naming every option file, the defaults Hydra composes, and the
ranges the code refuses (quoted from the errors the option classes raise)."""
import re

import pytest
from omegaconf import OmegaConf

from tools import config_reference
from headprune.apps.config_paths import config_dir


@pytest.fixture(scope="module")
def rendered() -> str:
    """The page as the code makes it now (~10-20 s: every option composed, every typed class probed)."""
    return config_reference.render()


@pytest.mark.slow
def test_the_committed_page_is_current(rendered):
    """Fails after any change to conf/ or to a schema until the page is regenerated."""
    assert config_reference.page_path().read_text() == rendered, \
        "docs/configuration.md is stale: run python -m tools.config_reference"


def test_check_exits_1_on_a_stale_page_and_writing_makes_it_current(tmp_path, monkeypatch):
    monkeypatch.setattr(config_reference, "render", lambda: "# Configuration reference\n")
    out = tmp_path / "configuration.md"
    assert config_reference.main(["--check", "--out", str(out)]) == 1  # missing
    out.write_text("# an old page\n")
    assert config_reference.main(["--check", "--out", str(out)]) == 1
    assert config_reference.main(["--out", str(out)]) == 0
    assert config_reference.main(["--check", "--out", str(out)]) == 0 and out.read_text() == "# Configuration reference\n"


@pytest.mark.slow
def test_every_option_file_has_a_section_and_the_defaults_are_marked(rendered):
    conf = config_dir()
    groups = config_reference.groups(conf)
    assert set(groups) >= {"metric", "schedule", "layer_policy", "recovery", "budget", "model", "data", "experiment"}
    for path in conf.rglob("*.yaml"):
        if path.parent != conf:
            group = path.parent.relative_to(conf).as_posix()
            top = group.split("/")[0]
            if top in config_reference.GLOBAL_GROUPS and group != top:  # an experiment's arms: docs/arms/
                assert path.name == "arms.yaml" and f"### `experiment={path.parent.name}/" not in rendered, path
                continue
            option = path.stem
            assert f"### `{group}={option}`" in rendered, (group, option)
    listed = OmegaConf.to_container(OmegaConf.load(conf / "train.yaml").defaults)
    defaults = {k.removeprefix("override "): v for e in listed if isinstance(e, dict) for k, v in e.items() if v}
    marked = dict(re.findall(r"^### `([\w/]+)=(\w+)` \(default\)$", rendered, re.M))
    assert marked == {g: o for g, o in defaults.items() if g in groups}


@pytest.mark.slow
def test_rows_hold_composed_defaults_types_and_the_codes_refusals(rendered):
    """Each typed row: the schema's type, the composed default (the yaml's value over the schema's),
    and the message the class raises for an out-of-range value."""
    section = rendered[rendered.index("### `schedule=iterative`"):rendered.index("### `schedule=one_shot`")]
    row = next(line for line in section.splitlines() if line.startswith("| `schedule.step` |"))
    cells = [c.strip() for c in row.split(" | ")]
    assert cells[1] == "float" and cells[2] == "`0.1`"
    assert "schedule.step=… is outside (0, 1)" in cells[4]
    budget = rendered[rendered.index("### `budget=kv67`"):]
    assert "| `budget.target` | float | `0.67` |" in budget  # kv67's own value over kv's 0.5
    assert "`recovery.teacher_logits`" in rendered and "allowed: live" in rendered
    untyped = rendered[rendered.index("### `model=minilm`"):]
    assert "| `model.task` | str | `classification` |" in untyped  # build_model's annotation
    groups = dict(re.findall(r"^\| \[`([\w/]+)`\].*\| (yes|no|in part) \|$", rendered, re.M))
    assert groups["schedule"] == groups["recovery"] == "yes" and groups["model"] == groups["trainer"] == "no"


def test_yaml_comments_are_read_per_key():
    header, comments = config_reference.yaml_comments(
        "# What it is.\n#   headprune-train x=1\ndefaults:\n  - a\n  # the block\nouter:\n  # inner one\n"
        "  inner: 1  # beside\nplain: 2\n")
    assert header == "What it is.\n\n```bash\nheadprune-train x=1\n```"
    assert comments == {"outer": "the block", "outer.inner": "inner one beside"}


def test_a_top_level_key_says_its_comment_once_and_a_block_says_its_own_first(rendered):
    """train.yaml's scalar keys (overwrite, check_consistency) are their own block: their comment is
    written once; a block's comment (pruning:) leads its first key's description."""
    section = rendered[rendered.index("## Outside the groups"):rendered.index("### `evaluation`")]
    row = next(line for line in section.splitlines() if line.startswith("| `overwrite` |"))
    said = "Allow a new run to replace the results.json already in its run dir."
    assert row.count(said) == 1
    physical = next(line for line in section.splitlines() if line.startswith("| `pruning.physical` |"))
    assert physical.count("(pruning.physical_effective: false)") == 1  # pruning:'s own comment, once
