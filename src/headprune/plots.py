"""Figures written to run dirs and loggers. The one place matplotlib is set up headless (Agg):
every other module draws with `from headprune.plots import plt`."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def head_heatmap(values: torch.Tensor, title: str, path: str | Path | None = None,
                 cmap: str = "viridis", vmin: float | None = None, vmax: float | None = None,
                 rows: list[str] | None = None):
    """A (layers, heads) heatmap; saved to `path` when given. Returns the figure. `rows`: a name per
    row (a model with several attention stacks: its sites, "encoder.0" ... "cross.5"), else layer ids."""
    values = values.detach().float().cpu()
    layers, heads = values.shape
    fig, ax = plt.subplots(figsize=(0.45 * heads + 2.0, 0.4 * layers + 1.5))
    im = ax.imshow(values.numpy(), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("layer" if rows is None else "site (stack.layer)")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    if rows is not None:
        if len(rows) != layers:
            raise ValueError(f"head_heatmap: {len(rows)} row names for {layers} rows")
        ax.set_yticklabels(rows)
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def close(fig) -> None:
    plt.close(fig)


def layer_profile(values, title: str, path: str | Path | None = None, ylabel: str = "loss rise"):
    """A bar chart of one value per layer."""
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(values) + 2), 3.0))
    ax.bar(range(len(values)), list(values), color="tab:blue")
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_xticks(range(len(values)))
    ax.set_title(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
