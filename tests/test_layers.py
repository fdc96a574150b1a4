"""The layering in pyproject.toml's import-linter contracts (docs/architecture.md): the package
keeps it, and an upward import (selection/ reading bench/, as the latency table once did) breaks it."""
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _lint(src: Path) -> subprocess.CompletedProcess:
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(REPO / 'pyproject.toml')!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})


def test_the_layering_contracts_hold():
    run = _lint(REPO / "src")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_an_upward_import_breaks_them(tmp_path):
    shutil.copytree(REPO / "src" / "headprune", tmp_path / "headprune", ignore=shutil.ignore_patterns("__pycache__"))
    budgets = tmp_path / "headprune" / "selection" / "budgets.py"
    budgets.write_text(budgets.read_text() + "\nimport headprune.bench.encoder  # noqa\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "headprune.selection.budgets -> headprune.bench.encoder" in run.stdout
