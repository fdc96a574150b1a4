"""Logger factories with headprune's defaults."""
from __future__ import annotations

import logging
import os

from lightning.pytorch.loggers import WandbLogger

log = logging.getLogger(__name__)


def wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import wandb

        return bool(wandb.api.api_key)
    except Exception:  # noqa: BLE001 - any failure to read credentials means "not logged in"
        return False


def wandb_logger(project: str = "headprune", save_dir: str = ".", name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None,
                 offline: bool | None = None, **kwargs) -> WandbLogger:
    """A WandbLogger that runs offline unless the user is logged in (or WANDB_MODE says so)."""
    if offline is None:
        mode = os.environ.get("WANDB_MODE")
        offline = mode in ("offline", "dryrun") if mode else not wandb_logged_in()
        if offline:
            log.warning("wandb: not logged in, logging offline under %s (sync later with `wandb sync`)", save_dir)
    return WandbLogger(project=project, save_dir=save_dir, name=name, group=group, tags=list(tags or []),
                       offline=offline, **kwargs)
