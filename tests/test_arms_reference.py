"""docs/arms/ is what tools/arms_reference.py generates from the arms files (a changed arm fails here
until the pages are regenerated), each page is in the docs site's nav, and docs/configuration.md
documents options, not arms."""
import re
import shutil
from pathlib import Path

import yaml

from headprune.apps import arms
from tools import arms_reference

REPO = Path(__file__).resolve().parent.parent


def test_the_arm_pages_are_current():
    assert arms_reference.main(["--check"]) == 0, "run python -m tools.arms_reference"


def test_a_changed_arm_or_a_stray_page_makes_the_pages_stale(tmp_path):
    out = tmp_path / "arms"
    shutil.copytree(REPO / "docs" / "arms", out)
    assert arms_reference.main(["--check", "--out", str(out)]) == 0
    page = out / "llm_kv_modes.md"
    page.write_text(page.read_text().replace("`budget.target=0.15`", "`budget.target=0.2`", 1))
    assert arms_reference.main(["--check", "--out", str(out)]) == 1
    assert arms_reference.main(["--out", str(out)]) == 0 and arms_reference.main(["--check", "--out", str(out)]) == 0
    (out / "gone.md").write_text("# an experiment without arms now\n")
    assert arms_reference.main(["--check", "--out", str(out)]) == 1
    assert arms_reference.main(["--out", str(out)]) == 0 and not (out / "gone.md").exists()


def test_every_arm_has_a_row_with_its_command():
    for experiment in arms.experiments_with_arms():
        text = (REPO / "docs" / "arms" / f"{experiment}.md").read_text()
        rows = re.findall(r"^\| `(\w+)` \|", text, re.M)
        assert rows == list(arms.arms(experiment)), experiment
        assert f"headprune-train experiment={experiment}/<arm>" in text


def _nav_pages(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav))
    return set().union(*(_nav_pages(v) for v in nav.values()))


def test_each_arm_page_is_in_the_site_nav():
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = _nav_pages(config["nav"])
    wanted = {f"arms/{name}" for name in arms_reference.pages()}
    assert wanted <= pages, wanted - pages


def test_the_configuration_reference_lists_no_arm():
    text = (REPO / "docs" / "configuration.md").read_text()
    assert "### `experiment=llm_kv_modes`" in text and "[Arms of llm_kv_modes](arms/llm_kv_modes.md)" in text
    assert not re.search(r"^### `experiment=\w+/\w+`", text, re.M)
