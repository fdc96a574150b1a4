"""The documentation site builds with `mkdocs build --strict` and no network: every page in the nav
exists, every link between pages and to the experiments' raw files resolves, mkdocstrings reads the
API, and nothing is fetched (a socket opened during the build fails the test). A copy of the site
with a broken link, or with a page left out of the nav, fails to build."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

NO_NETWORK = '''
import os, socket

def _refuse(*args, **kwargs):
    with open(os.environ["HEADPRUNE_NETWORK_LOG"], "a") as log:
        log.write(repr(args[:2]) + "\\n")
    raise OSError("network access during the docs build")

socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.create_connection = _refuse
socket.getaddrinfo = _refuse
'''


def build(config: Path, site: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config` into `site`, in a process whose sockets refuse to connect
    (a sitecustomize on PYTHONPATH), logging any attempt to HEADPRUNE_NETWORK_LOG."""
    hooks = tmp_path / "no_network"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(NO_NETWORK)
    env = {**os.environ, "PYTHONPATH": str(hooks), "NO_MKDOCS_2_WARNING": "1",
           "HEADPRUNE_NETWORK_LOG": str(tmp_path / "network.log")}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow  # ~10 s: the whole site, the API read from the source
def test_site_builds_strictly_and_offline(tmp_path):
    site = tmp_path / "site"
    done = build(REPO / "mkdocs.yml", site, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not (tmp_path / "network.log").exists(), (tmp_path / "network.log").read_text()
    assert "schedule.target_sparsity" in (site / "configuration" / "index.html").read_text()
    assert 'id="headprune.Pruner"' in (site / "api" / "index.html").read_text()
    for page in sorted((REPO / "docs" / "arms").glob("*.md")):  # the experiments' arm pages (tools/arms_reference.py)
        built = site / "arms" / ("" if page.stem == "index" else page.stem) / "index.html"
        assert built.is_file(), page.name
    assert "kv_modes=retrieval" in (site / "arms" / "llm_kv_modes" / "index.html").read_text()
    index = (site / "experiments" / "index.html").read_text()
    for folder in sorted((REPO / "experiments").iterdir()):
        if (folder / "README.md").is_file():
            assert f'href="{folder.name}/"' in index, folder.name  # its README, rendered
            assert (site / "experiments" / folder.name / "index.html").is_file()
    assert (site / "experiments" / "quickstart" / "results.json").read_text() == \
        (REPO / "experiments" / "quickstart" / "results.json").read_text()  # raw files served as they are


def _copy_of_the_site(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("docs", "src", "experiments"):
        shutil.copytree(REPO / name, root / name, ignore=skip)
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    return root


@pytest.mark.slow  # two builds of a copy of the site
@pytest.mark.parametrize("defect", ["broken link", "page not in the nav"])
def test_a_defect_fails_the_strict_build(tmp_path, defect):
    root = _copy_of_the_site(tmp_path)
    if defect == "broken link":
        page = root / "docs" / "concepts.md"
        page.write_text(page.read_text() + "\nSee [the missing page](no_such_page.md).\n")
        expected = "contains a link 'no_such_page.md', but the target is not found"
    else:
        (root / "docs" / "orphan.md").write_text("# A page nobody put in the nav\n")
        expected = 'are not included in the "nav" configuration:\n  - orphan.md'

    done = build(root / "mkdocs.yml", tmp_path / "site", tmp_path)
    output = done.stdout + done.stderr  # the warnings are logged to stderr, "Aborted ..." printed to stdout
    assert done.returncode != 0
    warnings = [line for line in output.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and expected in output and "Aborted with 1 warnings" in output, output[-2000:]
