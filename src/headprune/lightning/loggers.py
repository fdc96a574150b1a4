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


# -- what the pruning callback sends to a Trainer's loggers ------------------------------------
def log_metrics(trainer, metrics: dict) -> None:
    """`metrics` to every logger of `trainer` at its global step (nothing without a Trainer)."""
    if trainer is None:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def log_round(trainer, record: dict) -> None:
    """A round's sparsity, validation metrics, heads per layer and the wall time and throughput
    of its fine-tuning, once its `val` is known."""
    log_metrics(trainer, {"prune/round": record["round"], "prune/sparsity": record["sparsity"],
                          **{f"prune/val_{name}": value for name, value in record["val"].items()},
                          **{f"prune/{k}": record[k] for k in ("train_seconds", "train_samples_per_s", "teacher_seconds")
                             if k in record},
                          **{f"prune/heads_layer_{i}": n for i, n in enumerate(record["heads_per_layer"])}})


def log_run_summary(trainer, data: dict) -> None:
    """Final sparsity and metrics in the wandb run summary, so a dashboard can plot a sweep's
    metric against sparsity, one point per run."""
    if trainer is None or not trainer.is_global_zero:
        return
    final, base = data["final"], data["baseline"].get("val", {})
    summary = {"final/sparsity": final["sparsity"], "final/stop_reason": final["stop_reason"],
               **{f"final/val_{k}": v for k, v in final["val"].items()},
               **{f"baseline/val_{k}": v for k, v in base.items()}}
    if "acc" in base and "acc" in final["val"]:
        summary["final/acc_drop"] = base["acc"] - final["val"]["acc"]
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update(summary)


def log_figures(trainer, figures: dict) -> None:
    """{key: matplotlib figure} as images in every wandb logger of `trainer`."""
    if trainer is None:
        return
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            for key, fig in figures.items():
                logger.log_image(key=key, images=[fig], step=trainer.global_step)


def log_head_mask(trainer, mask, round_no: int) -> None:
    """The kept-heads heatmap after a round, in every wandb logger."""
    if trainer is None or not any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
        return
    from headprune.plots import close, head_heatmap

    fig = head_heatmap(mask.mask, f"kept heads after round {round_no}", cmap="Greys_r", vmin=0, vmax=1)
    log_figures(trainer, {"prune/head_mask": fig})
    close(fig)


def finish_wandb(loggers: list) -> None:
    """Finish every wandb run among `loggers` that was started, so its files are complete and a
    failed job in a sweep does not leave its run open."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and getattr(logger, "_experiment", None) is not None:
            logger.experiment.finish()
