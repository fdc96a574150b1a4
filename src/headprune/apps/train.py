"""`headprune-train`: fine-tune, score, prune, repeat — composed by Hydra from conf/train.yaml.

The thin Hydra entry: the composed config becomes a typed `RunSpec` (checked there, naming any bad
field, before any work), `headprune.runs.run` runs it, and the app returns what the sweep optimises
(`objectives`: the final validation accuracy for classification, higher is better; perplexity for
a causal LM, lower is better). Here too: the run dir's Hydra record (.hydra/ and train.log),
written once every check has passed.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from headprune.apps.config_paths import config_dir
from headprune.apps.config_schema import register_schemas
from headprune.engine import UnavailableRuntime
from headprune import runs
from headprune.runs import RunSpec, run_dir
from headprune.runs.objectives import objectives

register_schemas()

RECORD_DIR = ".hydra"


def run(cfg: DictConfig) -> dict:
    """Run the job `cfg` describes (a composed conf/train.yaml); returns the results document."""
    return runs.run(RunSpec.from_config(cfg), record=lambda output_dir: record(output_dir, cfg))


def record(output_dir: Path, cfg: DictConfig) -> logging.Handler | None:
    """The run dir's record of a Hydra job, once every check has passed: `.hydra/` (the config as
    composed, Hydra's own, the overrides; rank 0 only) and the job's log file (returned: the run
    closes it at the end). None when called as a function (tests, notebooks): no Hydra job."""
    hydra_cfg = _hydra_config()
    if hydra_cfg is None:
        return None
    if run_dir.is_rank_zero():
        folder = output_dir / RECORD_DIR
        folder.mkdir(exist_ok=True)
        OmegaConf.save(cfg, folder / "config.yaml")
        OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), folder / "hydra.yaml")
        OmegaConf.save(hydra_cfg.overrides.task, folder / "overrides.yaml")
    handler = logging.FileHandler(output_dir / f"{hydra_cfg.job.name}.log")
    handler.setFormatter(logging.Formatter(run_dir.LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


class RunDirCheck(Callback):
    """A Hydra callback (conf/train.yaml `hydra.callbacks.run_dir_check`): before Hydra creates the run
    dir of a single run (which it does before the app starts, with its own traceback when it cannot),
    a run dir that cannot be created is refused naming hydra.run.dir: exit 2, nothing written."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        target = Path(str(config.hydra.run.dir))
        problem = run_dir.creation_problem(target)
        if problem:
            print(f"headprune-train: hydra.run.dir={target} cannot be created: {problem}; allowed: a folder you can "
                  "create files in (hydra.run.dir=<path>)", file=sys.stderr)
            raise SystemExit(2)


def _hydra_config():
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get()
    except ValueError:
        return None


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> float | list[float]:
    try:
        spec = RunSpec.from_config(cfg)
        data = runs.run(spec, record=lambda output_dir: record(output_dir, cfg))
    except UnavailableRuntime as err:  # a usage error: exit 2, nothing written
        print(f"headprune-train: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return objectives(data, spec.objectives)


if __name__ == "__main__":
    main()
