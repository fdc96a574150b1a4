"""The dense model a pruned export came from: the baseline every `bench.pruned_dir` comparison uses.

Why: a dense model built from the export's own config is the pruned model again (the config of a
plain export says the kept head counts), which reported sparsity 0 and a KV ratio of 1.000. The
origin is `bench.dense_model` when given, else the `dense_model` the export records
(`save_pruned(..., origin=...)`, written by every headprune-train export); an export recording
none is refused before any work, naming the setting to give. Every message names the setting
the folder was given in (`bench.pruned_dir`, `bench.llm.pruned_dirs[i]`, ...), and a folder that
does not exist or holds no model is said to be that, not to record no dense model.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from headprune.deploy.hf import read_origin
from headprune.heads.adapters import head_layout
from headprune.models.build import resolve_pretrained
from headprune.tasks import CAUSAL_LM, task_for


def check_export(pruned_dir: str, setting: str = "bench.pruned_dir") -> None:
    """`pruned_dir` (given as `setting`) is a folder holding a saved model; else an error saying
    which and naming the setting."""
    path = Path(pruned_dir).expanduser()
    what = ("does not exist" if not path.exists() else "is not a folder" if not path.is_dir()
            else "holds no model (no config.json)" if not (path / "config.json").is_file() else None)
    if what:
        raise FileNotFoundError(f"{setting}={pruned_dir} {what}; allowed: a save_pruned folder or a headprune-train "
                                "run's export/ folder")


def origin_of(pruned_dir: str, dense_model: str | None, setting: str = "bench.pruned_dir") -> str:
    """`dense_model` when given, else the dense model recorded in `pruned_dir` (given as `setting`);
    raises when neither, or when `pruned_dir` holds no model."""
    check_export(pruned_dir, setting)
    if dense_model:
        return dense_model
    recorded = read_origin(pruned_dir)
    if recorded is None:
        raise ValueError(f"{setting}={pruned_dir} records no dense model it was pruned from (an export "
                         "written before headprune recorded it, or of a random-init model): give it as "
                         "bench.dense_model=<the model.pretrained name or folder it was pruned from>; the bench "
                         "never compares an export with a model of its own (pruned) config")
    return recorded


def load_dense(origin: str, exported: nn.Module, pruned_dir: str, device: torch.device,
               dtype: torch.dtype) -> nn.Module:
    """The dense `origin` as the export's model class (same head: LM or classifier), on `device`,
    checked to have the export's layers, width and vocabulary."""
    config = exported.config
    extra = {} if task_for(exported) is CAUSAL_LM else {"num_labels": config.num_labels}  # the export's head
    dense = type(exported).from_pretrained(resolve_pretrained(origin), dtype=dtype,
                                           attn_implementation=config._attn_implementation, **extra)
    for name, a, b in (("layers", len(head_layout(dense)), len(head_layout(exported))),
                       ("hidden size", dense.config.hidden_size, config.hidden_size),
                       ("vocabulary", dense.config.vocab_size, config.vocab_size)):
        if a != b:
            raise ValueError(f"bench.pruned_dir={pruned_dir} has {b} {name}, its dense model {origin!r} {a}: it was "
                             "not pruned from it; give the right one as bench.dense_model=<name or folder>")
    return dense.eval().to(device)


def export_name(pruned_dir: str) -> str:
    """A short row name for an export folder: `<run dir>/export` -> `<run dir name>`."""
    path = Path(pruned_dir)
    return path.parent.name if path.name == "export" else path.name
