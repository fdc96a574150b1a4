"""The README's Python API examples run as written (on a few SST-2-like sentences)."""
import re
from pathlib import Path

from tests.helpers import tiny_batch

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_python_api_examples_run(tokenizer):
    section = README[README.index("## Python API"):README.index("## Tests")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    scope = {"train_loader": [tiny_batch(tokenizer, 8, seed=1)], "score_loader": [tiny_batch(tokenizer, 8, seed=2)],
             "val_loader": [tiny_batch(tokenizer, 8, seed=3)]}
    exec(blocks[0], scope)  # noqa: S102 - the README's own code
    report, model = scope["report"], scope["model"]
    assert [r["sparsity"] for r in report["rounds"]] == [0.25, 0.5] and report["final"]["stop_reason"] == "target_reached"
    assert sum(map(len, model.headprune_layout)) == 36 and scope["state"]["rounds"] == report["rounds"]
    exec(blocks[1], scope)  # noqa: S102
    assert scope["report"]["round"]["budget"]["predicted_share"] <= 0.5
    assert sum(map(len, scope["model"].headprune_layout)) < 72


def _config_table() -> dict[str, str]:
    """{group: its options cell} of the README's table under "## Configuration"."""
    section = README[README.index("## Configuration"):]
    table = section[section.index("| group |"):].split("\n\n")[0]
    return dict(re.findall(r"^\| `([\w/]+)` \| (.*?) \|", table, re.M))


def test_the_config_table_names_every_option_file():
    """Every conf/<group>/<option>.yaml (hydra/<group>/ too) is listed in its group's row, every row
    is a group, and the option marked `(default)` is train.yaml's default."""
    from omegaconf import OmegaConf

    from headprune.apps.config_paths import config_dir

    conf = config_dir()
    table = _config_table()
    groups = {str(p.parent.relative_to(conf)): set() for p in conf.rglob("*.yaml") if p.parent != conf}
    for path in conf.rglob("*.yaml"):
        if path.parent != conf:
            groups[str(path.parent.relative_to(conf))].add(path.stem)
    assert set(table) == set(groups)
    for group, options in groups.items():
        named = set(re.findall(r"`(\w+)`", table[group]))
        assert options <= named, (group, sorted(options - named))
    listed = OmegaConf.to_container(OmegaConf.load(conf / "train.yaml").defaults)
    defaults = {k.removeprefix("override "): v for entry in listed if isinstance(entry, dict) for k, v in entry.items()}
    for group, cell in table.items():
        for marked in re.findall(r"`(\w+)` \(default\)", cell):
            assert defaults.get(group) == marked, (group, marked)
