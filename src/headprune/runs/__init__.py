"""A training/pruning run as a library: a typed `RunSpec` (from a composed Hydra config with
`RunSpec.from_config`, or written in Python) and `run(spec)`, which checks everything, assembles
the run, runs it and returns the results document. `headprune-train` (apps/train.py) is this with
Hydra in front."""
from headprune.runs.assembly import Setup, assemble
from headprune.runs.execute import run
from headprune.runs.export import export_pruned
from headprune.runs.spec import (DataSpec, DiagnosticsSpec, ModelSpec, OptimSpec, OutputSpec, PruningSpec, RunSpec,
                                 TrainerSpec)

__all__ = ["DataSpec", "DiagnosticsSpec", "ModelSpec", "OptimSpec", "OutputSpec", "PruningSpec", "RunSpec", "Setup",
           "TrainerSpec", "assemble", "export_pruned", "run"]
