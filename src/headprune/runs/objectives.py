"""What a sweep optimises (`objectives` in train.yaml): the names a run may return, checked at
start (`preflight.check_settings`), and their values read from the finished run's results. The
val_* objectives and `headline` read `final.val`: the run's Task evaluated on the masked model in
the run's memory (results.json `final.val_source: in_memory_masked`), not the saved export, which
a causal-LM run's `evaluation.pruned` block reads (`source: export`)."""
from __future__ import annotations

from headprune.tasks import headline

OBJECTIVES = {
    "headline": lambda final: headline(final["val"])[1],
    "val_acc": lambda final: final["val"]["acc"],
    "val_loss": lambda final: final["val"]["loss"],
    "val_ppl": lambda final: final["val"]["ppl"],
    "sparsity": lambda final: final["sparsity"],
    "kept_share": lambda final: 1.0 - final["sparsity"],
    "latency_share": lambda final: final["latency"]["measured_share"],
}


def objectives(results: dict, names) -> float | list[float]:
    """The values a sweeper optimises: one float, or a list."""
    out = [float(OBJECTIVES[name](results["final"])) for name in names]
    return out[0] if len(out) == 1 else out
