"""Logger factories with headprune's defaults."""
from __future__ import annotations

import logging
import os
import socket
from urllib.parse import urlparse

from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

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


# -- what a run sends to its loggers, with or without a Trainer ----------------------------------
class LogSink:
    """A run's loggers and the step their metrics are logged at: a Trainer's (`of_trainer`: its
    loggers at its global step, rank 0 writes summaries) or, for a run that trains nothing, the
    loggers the app built (`LogSink(loggers)`: a step that counts the records sent). Every
    function below takes one, so a retraining-free run logs exactly what a trained one does."""

    def __init__(self, loggers: list | None = None, trainer=None):
        self.trainer = trainer
        self._loggers = list(loggers or [])
        self._step = 0

    @classmethod
    def of_trainer(cls, trainer) -> "LogSink":
        return cls(trainer=trainer)

    @property
    def loggers(self) -> list:
        return list(self.trainer.loggers) if self.trainer is not None else self._loggers

    @property
    def writer(self) -> bool:
        return self.trainer is None or self.trainer.is_global_zero

    def step(self) -> int:
        return self.trainer.global_step if self.trainer is not None else self._step

    def wandb(self) -> list:
        return [logger for logger in self.loggers if isinstance(logger, WandbLogger)]

    def log_metrics(self, metrics: dict) -> None:
        """`metrics` to every logger at the sink's step."""
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.step())
        if self.trainer is None and self.loggers:
            self._step += 1

    def log_hyperparams(self, params: dict) -> None:
        for logger in self.loggers:
            logger.log_hyperparams(params)

    def summary(self, values: dict) -> None:
        """`values` in every wandb run's summary (one point per run on a sweep's dashboard)."""
        if not self.writer:
            return
        for logger in self.wandb():
            logger.experiment.summary.update(values)


def log_metrics(sink: LogSink | None, metrics: dict) -> None:
    if sink is not None:
        sink.log_metrics(metrics)


def log_round(sink: LogSink | None, record: dict) -> None:
    """A round's sparsity, validation metrics, heads per layer and the wall time and throughput
    of its fine-tuning, once its `val` is known."""
    log_metrics(sink, {"prune/round": record["round"], "prune/sparsity": record["sparsity"],
                       **{f"prune/val_{name}": value for name, value in (record.get("val") or {}).items()},
                       **{f"prune/{k}": record[k] for k in ("train_seconds", "train_samples_per_s", "teacher_seconds")
                          if k in record},
                       **{f"prune/heads_layer_{i}": n for i, n in enumerate(record["heads_per_layer"])}})


def log_baseline(sink: LogSink | None, baseline: dict) -> None:
    """The unpruned model's validation metrics (round 0 of the sparsity curve)."""
    if baseline.get("val"):
        log_metrics(sink, {"prune/round": 0, "prune/sparsity": 0.0,
                           **{f"prune/val_{k}": v for k, v in baseline["val"].items()}})


def log_run_summary(sink: LogSink | None, data: dict) -> None:
    """Final sparsity and metrics in the wandb run summary, so a dashboard can plot a sweep's
    metric against sparsity, one point per run."""
    if sink is None:
        return
    final, base = data["final"], data["baseline"].get("val") or {}
    summary = {"final/sparsity": final["sparsity"], "final/stop_reason": final["stop_reason"],
               **{f"final/val_{k}": v for k, v in (final.get("val") or {}).items()},
               **{f"baseline/val_{k}": v for k, v in base.items()}}
    if "acc" in base and "acc" in (final.get("val") or {}):
        summary["final/acc_drop"] = base["acc"] - final["val"]["acc"]
    sink.summary(summary)


def flat(prefix: str, value, out: dict | None = None) -> dict:
    """{prefix/key/...: number} for every number in a nested dict (lists and strings left out)."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for key, item in value.items():
            flat(f"{prefix}/{key}", item, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = value
    return out


def log_evaluation(sink: LogSink | None, which: str, block: dict) -> None:
    """An `evaluation.<which>` block (perplexities, zero-shot accuracies, seconds) as metrics and
    in the summary: `eval/<which>/perplexity/seq2048/ppl`, ..."""
    if sink is None:
        return
    values = flat(f"eval/{which}", {k: v for k, v in block.items() if k != "generation"})
    if values:
        sink.log_metrics(values)
        sink.summary(values)


def log_stages(sink: LogSink | None, stages: dict) -> None:
    """Seconds per stage of the run (load, evaluations, pruning, export) in the summary."""
    if sink is not None and stages:
        sink.summary(flat("stages", stages))


def log_figures(sink: LogSink | None, figures: dict) -> None:
    """{key: matplotlib figure} as images in every wandb logger."""
    if sink is None:
        return
    for logger in sink.wandb():
        for key, fig in figures.items():
            logger.log_image(key=key, images=[fig], step=sink.step())


def log_head_mask(sink: LogSink | None, mask, round_no: int) -> None:
    """The kept-heads heatmap after a round, in every wandb logger."""
    if sink is None or not sink.wandb():
        return
    from headprune.heads.stacks import mask_sites
    from headprune.plots import close, head_heatmap

    fig = head_heatmap(mask.mask, f"kept heads after round {round_no}", cmap="Greys_r", vmin=0, vmax=1,
                       rows=mask_sites(mask))
    log_figures(sink, {"prune/head_mask": fig})
    close(fig)


def finish_wandb(loggers: list) -> None:
    """Finish every wandb run among `loggers` that was started, so its files are complete and a
    failed job in a sweep does not leave its run open."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and getattr(logger, "_experiment", None) is not None:
            logger.experiment.finish()


class SinkLogger(Logger):
    """A Lightning logger that sends a fit's metrics (a recovery's step budget: `recovery/loss`,
    `recovery/lr`, `recovery/tokens_per_s`) to a run's `LogSink`, at the sink's step: they land in
    the run's own loggers, between its rounds, with steps that only increase (wandb drops a step
    lower than one it has seen). The run finalizes its loggers itself."""

    def __init__(self, sink: LogSink):
        super().__init__()
        self.sink = sink

    @property
    def name(self) -> str:
        return "headprune-run"

    @property
    def version(self) -> str:
        return "0"

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.sink.log_metrics({k: v for k, v in metrics.items() if k != "epoch"})

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # the run logged its settings once

    def finalize(self, status: str) -> None:
        pass
