"""Logger factories with headprune's defaults."""
from __future__ import annotations

import logging
import os
import socket
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger

log = logging.getLogger(__name__)

# config groups whose chosen option becomes a wandb tag, e.g. "metric:taylor"
TAGGED_GROUPS = ("experiment", "model", "data", "metric", "schedule", "layer_policy")
WANDB_GROUP_MAX = 128  # wandb's limit on a group name


def wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import wandb

        return bool(wandb.api.api_key)
    except Exception:  # noqa: BLE001 - any failure to read credentials means "not logged in"
        return False


def wandb_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the wandb server (WANDB_BASE_URL, default api.wandb.ai) opens
    within `timeout` seconds; checked before going online so that a logged-in user without
    network gets an offline run instead of a long hang and a failed job."""
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def hydra_run_identity() -> tuple[str | None, str | None, list[str]]:
    """(group, name, tags) for the current Hydra job: in a multirun the sweep dir is the group
    (every job of the sweep shares it) and the job's overrides are its name; the tags are the
    chosen options of TAGGED_GROUPS. (None, None, []) outside a Hydra app."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except (ImportError, ValueError):
        return None, None, []
    choices = hc.runtime.choices
    tags = [f"{g}:{choices[g]}" for g in TAGGED_GROUPS if choices.get(g) not in (None, "null")]
    if hc.mode != RunMode.MULTIRUN:
        return None, None, tags
    group = str(hc.sweep.dir)[-WANDB_GROUP_MAX:]
    return group, hc.job.override_dirname or None, tags


def wandb_logger(project: str = "headprune", save_dir: str = ".", name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None,
                 offline: bool | None = None, **kwargs) -> WandbLogger:
    """A WandbLogger that runs offline unless the user is logged in and the server answers (or
    WANDB_MODE says so). Inside a Hydra multirun, `group` defaults to the sweep and `name` to the
    job's overrides; the chosen config options are always added to `tags`."""
    if offline is None:
        mode = os.environ.get("WANDB_MODE")
        if mode:
            offline = mode in ("offline", "dryrun")
        elif not wandb_logged_in():
            offline = True
            log.warning("wandb: not logged in, logging offline under %s (sync later with `wandb sync`)", save_dir)
        elif not wandb_reachable():
            offline = True
            log.warning("wandb: logged in but the server is unreachable, logging offline under %s "
                        "(sync later with `wandb sync`)", save_dir)
        else:
            offline = False
    auto_group, auto_name, auto_tags = hydra_run_identity()
    tags = list(dict.fromkeys([*auto_tags, *(tags or [])]))
    return WandbLogger(project=project, save_dir=save_dir, name=name or auto_name, group=group or auto_group,
                       tags=tags, offline=offline, **kwargs)
