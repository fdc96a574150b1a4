"""One name per concept across the package (docs/architecture.md): checked on the source, so a new
module that reuses a name for something else fails here rather than in a reader's head."""
import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "headprune"


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE), ast.parse(path.read_text())


def test_no_two_public_classes_share_a_name():
    """`Setup` was once both the training run's pieces (apps/train.py) and what the bench hands a
    section (now `bench.sections.SectionInputs`)."""
    where = defaultdict(list)
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(str(path))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_the_layer_policy_is_called_layer_policy_in_code_too():
    """Config and results.json say `layer_policy`; no parameter or keyword argument of the package
    calls it `policy` (prune_to_budget(policy=...) once did)."""
    named = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.arg == "policy":
                named.append(f"{path}:{node.lineno} parameter")
            if isinstance(node, ast.keyword) and node.arg == "policy":
                named.append(f"{path}:{node.lineno} keyword")
    assert named == []
