"""Head diagnostics of a run's final model on the scoring slice: results.json `diagnostics`, PNG
heatmaps in the run dir, images in a wandb logger (`scoring.diagnostics` computes them)."""
from __future__ import annotations

import torch

from headprune.lightning import loggers


def diagnose(sink, pl_module, datamodule, pruner, options: dict) -> None:
    """Every rank computes (the diagnostics hold collectives), rank 0 draws and logs."""
    from headprune.plots import close
    from headprune.scoring import metric_name
    from headprune.scoring.diagnostics import diagnostic_figures, head_diagnostics

    results = pruner.results
    diag = head_diagnostics(pl_module.model, pl_module.head_mask, datamodule.score_dataloader(),
                            tokenizer=getattr(datamodule, "tokenizer", None), max_batches=pruner.max_batches, **options)
    if pruner.rounds and pruner.rounds[-1]["scores"] is not None:  # None: a KV-mode choice that read no score
        last = pruner.rounds[-1]
        diag.importance[f"{metric_name(pruner.metric) or 'metric'}_round{last['round']}"] = torch.tensor(last["scores"])
    results.data["diagnostics"] = diag.to_json()
    results.save()
    if not results.writer:
        return
    figures = diagnostic_figures(diag, results.output_dir)
    loggers.log_figures(sink, {f"diagnostics/{stem}": fig for stem, fig in figures.items()})
    for fig in figures.values():
        close(fig)
