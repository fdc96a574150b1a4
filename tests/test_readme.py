"""README.md: its Python example runs as written, its measured result is the committed raw file's,
it fits in 150 lines and every link in it points at a file of the repository."""
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


@pytest.mark.slow  # ~7 s: MiniLM scored, tuned and folded
def test_python_example_runs_as_written():
    """The README's one Python block, self-contained (the real MiniLM, offline): a FLOPs budget of
    one half, tuned by least squares and folded, leaves fewer than 72 heads."""
    blocks = re.findall(r"```python\n(.*?)```", _section("Python"), re.S)
    assert len(blocks) == 1
    assert len(blocks[0].splitlines()) <= 20
    imports = re.findall(r"^(?:from|import) (\S+)", blocks[0], re.M)
    assert all(name == "torch" or name == "headprune" or name.startswith("headprune.") and
               not any(part.startswith("_") for part in name.split(".")) for name in imports), imports
    scope: dict = {}
    exec(blocks[0], scope)  # noqa: S102 - the README's own code
    assert scope["report"]["round"]["budget"]["predicted_share"] <= 0.5
    assert sum(map(len, scope["model"].headprune_layout)) < 72


def test_measured_result_is_the_committed_quickstart_run():
    """The table and the printed line in the README are experiments/quickstart/results.json's."""
    results = json.loads((REPO / "experiments" / "quickstart" / "results.json").read_text())
    base, final = results["baseline"]["val"]["acc"], results["final"]["val"]["acc"]
    heads = results["model"]["layers"] * results["model"]["heads"]
    kept = sum(results["final"]["heads_per_layer"])
    result = _section("One measured result")
    assert f"| {heads} / {heads} | {100 * base:.2f}% |" in result
    assert f"| {kept} / {heads} | {100 * final:.2f}% |" in result
    line = (f"baseline val acc {base} -> final val acc {final} at sparsity {results['final']['sparsity']:.2f} "
            "(results: <run dir>/results.json)")
    assert line in _section("Install and run")


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert links
    missing = [link for link in links if not link.startswith("http") and not (REPO / link).exists()]
    assert not missing, missing
