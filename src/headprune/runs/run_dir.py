"""A run's folder: refused or checked before anything is written into it; the log records of the
checks held until the run's log file exists (the Hydra app writes its config record `.hydra/` and
train.log once every check has passed: apps/train.py).

Hydra itself is told not to write there (`hydra.output_subdir: null`, console-only job logging in
conf/train.yaml), because it would do so before the task starts: a run refused for landing on a
finished run's folder would already have replaced that folder's `.hydra/config.yaml`.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import shutil
import tempfile
from pathlib import Path

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def is_rank_zero() -> bool:
    """Rank 0 of a data-parallel launch (other ranks start while rank 0 already owns the folder)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


class LogBuffer:
    """Holds the log records of a run's checks until its log file exists (`release`), so that
    train.log still starts at the beginning while a refused run writes no file at all."""

    def __init__(self) -> None:
        self.handler = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)
        self.handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger().addHandler(self.handler)

    def release(self, into: logging.Handler | None) -> None:
        """Stop holding; replay what was held into `into` (None: drop it)."""
        logging.getLogger().removeHandler(self.handler)
        if into is not None:
            for record in self.handler.buffer:
                into.handle(record)
        self.handler.buffer.clear()
        self.handler.close()


def refuse_to_overwrite(output_dir: Path, resuming: bool, overwrite: bool) -> None:
    """A finished or running run's folder is never written over by a new run, unless asked to
    (`overwrite=true`) or resuming it (`ckpt_path=...`; offered only when the folder holds a
    checkpoint). Rank 0 decides (other ranks start while rank 0 already owns the folder)."""
    if is_rank_zero() and not (resuming or overwrite) and (output_dir / "results.json").exists():
        last = output_dir / "checkpoints" / "last.ckpt"
        in_recovery = output_dir / "recovery" / "last.ckpt"  # a run without epochs, killed in a step budget
        resume = next((f"resume it with ckpt_path={path}, " for path in (last, in_recovery) if path.is_file()),
                      "(it wrote no checkpoint to resume from: runs that train no epoch write one only during a "
                      "recovery's step budget) ")
        raise FileExistsError(f"{output_dir} already holds a run's results.json; choose another hydra.run.dir, "
                              f"{resume}or pass overwrite=true to run it again in this folder")


def check_writable(output_dir: Path) -> None:
    """The folder exists (created if needed) and a file can be created in it."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as err:
        raise PermissionError(f"the run dir {output_dir} (hydra.run.dir / paths.output_dir) cannot be written: "
                              f"{err.strerror}; allowed: a folder you can create files in") from None


def retire_old_export(output_dir: Path, resuming: bool, overwrite: bool) -> None:
    """`overwrite=true` (a new run, not a resume) over a folder holding an earlier run's export/: the
    export goes before the new run writes its first results.json, so the folder never holds a
    results.json beside an export it does not describe (a rerun dying before its own export left the
    old, differently pruned export/ beside the new results). Renamed aside in one step, then removed.
    Rank 0 only."""
    export = output_dir / "export"
    if resuming or not overwrite or not is_rank_zero() or not export.exists():
        return
    aside = output_dir / f".export.{os.getpid()}.retired"
    os.replace(export, aside)
    shutil.rmtree(aside, ignore_errors=True)
    logging.getLogger(__name__).info("overwrite=true: the earlier run's export %s was removed", export)


def creation_problem(output_dir: Path) -> str:
    """Why `output_dir` cannot be created (or written, when it exists), or '': the nearest existing
    folder on its path must take new entries (a read-only file system or a folder without write
    permission does not). For the check before Hydra creates the run dir itself."""
    path = Path(output_dir).absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return ""
    if not existing.is_dir():
        return f"{existing} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{existing} does not take new files ({err.strerror})"
    return ""
