"""mkdocs hook: the repository's experiments/ folder becomes part of the site.

Every file under experiments/ that git tracks (or would: .gitignore's run outputs stay out) is added to the site at the same path
(`experiments/<name>/...`): each README.md as a page, the raw files (JSON, CSV, logs, plots,
scripts, and the Markdown tables the collect scripts write) copied as they are, so a page that cites a raw file links to it and
`mkdocs build --strict` fails when that file is gone. The index page `experiments/index.md` is
generated here from the folders themselves (each one's README title, its README, run.sh and raw
files), so an experiment added or removed changes the index without anyone editing it.
Links in the site's own pages use the repository-root paths README.md uses (`experiments/...`),
which is why the pages that quote experiment tables sit at the top of docs/.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "experiments"
RAW = {".json", ".csv", ".log", ".txt", ".png", ".md", ".py", ".sh", ".yaml"}


def tracked(folder: Path) -> list[str]:
    """Paths (relative to the repository root) of the files under `folder` that git tracks or would
    (untracked files .gitignore does not exclude: run outputs stay out); every file under it when
    this is not a git checkout (an unpacked source archive)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              str(folder.relative_to(REPO))], cwd=REPO,
                             capture_output=True, check=True, text=True).stdout
        paths = [p for p in out.split("\0") if p]
        if paths:
            return sorted(p for p in paths if (REPO / p).is_file())  # a tracked file deleted in the work tree is gone
    except (OSError, subprocess.CalledProcessError):
        pass
    return sorted(str(p.relative_to(REPO)) for p in folder.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith("."))


def title(readme: Path) -> str:
    """A README's first `# ` heading, else its folder's name."""
    for line in readme.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return readme.parent.name


def index_page(paths: list[str]) -> str:
    """The Experiments index: per folder under experiments/, its README and its raw files."""
    by_folder: dict[str, list[str]] = {}
    for path in paths:
        parts = Path(path).parts
        if len(parts) > 2:
            by_folder.setdefault(parts[1], []).append(str(Path(*parts[2:])))
    lines = ["# Experiments", "",
             "Each folder under `experiments/` holds a `run.sh` with the exact commands, a README with the",
             "measured numbers, the conditions (threads, load, commit) and the raw files every number comes from.",
             "This index is generated from the folders when the site is built (`docs/_hooks/experiments.py`).", ""]
    for name in sorted(by_folder):
        files = sorted(by_folder[name])
        readme = EXPERIMENTS / name / "README.md"
        lines.append(f"## {name}")
        lines.append("")
        if readme.is_file():
            lines.append(f"[{title(readme)}]({name}/README.md)")
        else:
            lines.append("No README yet: only the files below.")
        lines.append("")
        groups: dict[str, list[str]] = {}
        for f in files:
            if f != "README.md" and Path(f).suffix in RAW:
                groups.setdefault(str(Path(f).parent), []).append(f)
        for sub in sorted(groups):
            where = "this folder" if sub == "." else f"`{sub}/`"
            links = ", ".join(f"[`{Path(f).name}`]({name}/{f})" for f in groups[sub])
            lines.append(f"- {where}: {links}")
        lines.append("")
    return "\n".join(lines)


class RawFile(File):
    """A file copied into the site as it is, Markdown included: an experiment's results.md or
    summary.md is a raw table its collect script wrote (summary.md files are written to be quoted
    from the repository root), so it is served as text, not rendered as a page of its own."""

    def is_documentation_page(self) -> bool:
        return False


def on_files(files: Files, config) -> Files:
    paths = tracked(EXPERIMENTS)
    for path in paths:
        if Path(path).suffix not in RAW:
            continue
        if Path(path).name == "README.md":  # a page, reached from the index (not one nav entry each)
            files.append(File(path, str(REPO), config["site_dir"], config["use_directory_urls"],
                              inclusion=InclusionLevel.NOT_IN_NAV))
        else:
            files.append(RawFile(path, str(REPO), config["site_dir"], config["use_directory_urls"]))
    files.append(File.generated(config, "experiments/index.md", content=index_page(paths)))
    return files
