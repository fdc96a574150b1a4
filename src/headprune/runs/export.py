"""A run's export: the mask folded into the trained model and saved as a user loads it
(`export_pruned`), and loaded back as a user does (`load_export`) for the evaluation of the export."""
from __future__ import annotations

import logging
from pathlib import Path

from headprune.deploy.fold import fold
from headprune.deploy.hf import load_pruned, save_pruned
from headprune.heads.surgery import count_params
from headprune.lightning.module import HeadPruneModule
from headprune.results import RunResults

log = logging.getLogger(__name__)


def export_pruned(module: HeadPruneModule, directory: Path, results: RunResults, baseline_params: dict,
                  tokenizer=None) -> None:
    """Fold the mask into the trained model (`deploy.fold`: gate values other than 0 and 1 scale
    their heads' output-projection columns, closed L0 gates and pruned heads leave the model) and
    save it with `save_pruned`, recording the dense model it came from (`model.pretrained` of the
    run's `config`, a folder made absolute; none for a random-init model, which no name rebuilds)
    so headprune-bench compares the export with that model; record the export folder and
    parameter counts in results.json."""
    results.data["final"].update(fold(module.model, module.head_mask))
    model_cfg = results.data.get("config", {}).get("model") or {}
    origin = None if model_cfg.get("random_init") else model_cfg.get("pretrained")
    if origin is not None and Path(origin).expanduser().is_dir():
        origin = str(Path(origin).expanduser().resolve())
    save_pruned(module.model, directory, tokenizer=tokenizer, overwrite=True,  # the run owns its export folder
                origin=origin)
    results.data["baseline"]["params"] = baseline_params
    results.data["final"].update(export_dir=str(directory), params=count_params(module.model))
    results.save()
    log.info("pruned model exported to %s (%s)", directory, results.data["final"]["params"])


def load_export(directory: Path, model) -> object:
    """The saved export, loaded as a user loads it (`load_pruned`: plain `from_pretrained` when the
    layout is uniform), in the run model's dtype and on its device: what the evaluation reads, so
    a save bug cannot hide behind the in-memory model."""
    param = next(model.parameters())
    return load_pruned(directory, device=param.device, dtype=param.dtype).eval()
