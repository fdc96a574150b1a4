"""Head diagnostics: which heads duplicate each other, and which park their attention on
special tokens.

- Redundancy: for two heads i, j of one layer and one real query, the Jensen-Shannon
  distance between their attention distributions over the real keys,
      d = sqrt(JSD(p_i, p_j)),  JSD in bits, so 0 <= d <= 1,
  averaged over real queries, then over examples. Pairs below `duplicate_threshold` are
  reported as near-duplicates: one of the two can usually go.
- Degenerate heads: the share of a head's attention that lands on special tokens ([CLS],
  [SEP], BOS/EOS), averaged over real queries and examples. Clark et al. 2019 found many BERT
  heads that put most of their attention on [SEP], a learned "no-op"; heads at or above
  `special_threshold` are listed.
- Importance: the heatmap-ready scores of a few cheap metrics (by default entropy,
  confidence and magnitude) on the same model.

Only heads that are alive (unpruned and physically present) are described; the others are
NaN in tensors and null in JSON.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from headprune.heads.adapters import head_layout
from headprune.heads.mask import HeadMask
from headprune.scoring import METRICS
from headprune.scoring.attention import attention_maps, end_of_sentence_ids, query_mean, real_tokens
from headprune.scoring.reduce import mean_over_ranks

SPECIAL_ID_NAMES = ("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id")


def special_token_ids(model: nn.Module, tokenizer=None) -> list[int]:
    """Ids of the sequence-marking special tokens ([CLS], [SEP], BOS, EOS): from the tokenizer
    when given, else from the model config."""
    source = tokenizer if tokenizer is not None else model.config
    ids = {getattr(source, name, None) for name in SPECIAL_ID_NAMES}
    return sorted(int(i) for i in ids if isinstance(i, int))


def js_distances(p: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B, h, T, T) attention maps -> (B, h, h) JS distance of every head pair, per example,
    averaged over real queries."""
    b, h, t, _ = p.shape
    out = torch.zeros(b, h, h, dtype=p.dtype, device=p.device)
    self_term = torch.special.xlogy(p, p).sum(-1)  # (B, h, T): sum p log p
    for i in range(h):
        pi = p[:, i:i + 1]  # (B, 1, T, T)
        m = 0.5 * (pi + p)  # (B, h, T, T)
        kl_i = self_term[:, i:i + 1] - torch.special.xlogy(pi, m).sum(-1)  # (B, h, T)
        kl_j = self_term - torch.special.xlogy(p, m).sum(-1)  # (B, h, T)
        jsd = (0.5 * (kl_i + kl_j) / math.log(2)).clamp(0.0, 1.0)
        out[:, i] = query_mean(jsd.sqrt(), real)
    return out


def special_share(p: torch.Tensor, special: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B, h, T, T) maps, (B, T) bool special keys -> (B, h) attention share on them."""
    on_special = (p * special[:, None, None, :].to(p.dtype)).sum(-1)  # (B, h, T)
    return query_mean(on_special, real)


@dataclass
class HeadDiagnostics:
    js_distance: torch.Tensor  # (L, H, H), NaN unless both heads alive
    special_token_share: torch.Tensor  # (L, H)
    importance: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (L, H)
    duplicate_threshold: float = 0.2
    special_threshold: float = 0.8
    special_token_ids: list[int] = field(default_factory=list)
    examples: int = 0

    def redundancy(self) -> torch.Tensor:
        """(L, H) distance of each head to its closest alive neighbour in the layer (low = redundant)."""
        d = self.js_distance.clone()
        d.diagonal(dim1=1, dim2=2).fill_(float("nan"))
        return torch.where(d.isnan(), torch.full_like(d, float("inf")), d).amin(-1).nan_to_num(posinf=float("nan"))

    def near_duplicates(self) -> list[dict]:
        pairs = []
        for layer, i, j in (self.js_distance < self.duplicate_threshold).nonzero().tolist():
            if i < j:
                pairs.append({"layer": layer, "heads": [i, j],
                              "js_distance": round(float(self.js_distance[layer, i, j]), 4)})
        return pairs

    def degenerate_heads(self) -> list[dict]:
        return [{"layer": layer, "head": head, "special_token_share": round(float(self.special_token_share[layer, head]), 4)}
                for layer, head in (self.special_token_share >= self.special_threshold).nonzero().tolist()]

    def to_json(self) -> dict:
        return {
            "examples": self.examples,
            "redundancy": {"duplicate_threshold": self.duplicate_threshold, "near_duplicates": self.near_duplicates(),
                           "min_js_distance": _json(self.redundancy()), "js_distance": _json(self.js_distance)},
            "special_tokens": {"ids": self.special_token_ids, "special_threshold": self.special_threshold,
                               "degenerate_heads": self.degenerate_heads(), "share": _json(self.special_token_share)},
            "importance": {name: _json(scores) for name, scores in self.importance.items()},
        }


def _json(t: torch.Tensor):
    """Nested lists of rounded floats, NaN -> None."""
    if t.dim() == 0:
        value = float(t)
        return None if math.isnan(value) else round(value, 6)
    return [_json(row) for row in t]


def check_options(metrics: Sequence[str], duplicate_threshold: float, special_threshold: float) -> None:
    """The `diagnostics:` options head_diagnostics takes, refused naming the field and what is
    allowed (a run checks them when its settings are built, before any work)."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"diagnostics.metrics={list(metrics)!r} has unknown names {unknown}; "
                         f"allowed: {', '.join(sorted(METRICS))}")
    for name, value in (("duplicate_threshold", duplicate_threshold), ("special_threshold", special_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"diagnostics.{name}={value!r} must be in [0, 1]")


def head_diagnostics(model: nn.Module, mask: HeadMask, dataloader, tokenizer=None,
                     metrics: Sequence[str] = ("entropy", "confidence", "magnitude"),
                     duplicate_threshold: float = 0.2, special_threshold: float = 0.8,
                     max_batches: int | None = None) -> HeadDiagnostics:
    """Redundancy, special-token share and `metrics` importance of the alive heads on `dataloader`."""
    check_options(metrics, duplicate_threshold, special_threshold)
    n_layers, n_heads = mask.num_layers, mask.num_heads
    layout = head_layout(model)
    ids = special_token_ids(model, tokenizer)
    device = mask.mask.device
    js = torch.zeros(n_layers, n_heads, n_heads, dtype=torch.float64, device=device)
    share = torch.zeros(n_layers, n_heads, dtype=torch.float64, device=device)
    count = 0
    for batch, maps in attention_maps(model, dataloader, mask.mask.device, max_batches):
        real = real_tokens(batch)
        if "special_tokens_mask" in batch:
            special = batch["special_tokens_mask"].bool() & real
        else:
            special = torch.isin(batch["input_ids"], torch.tensor(ids, dtype=torch.long, device=real.device)) & real
        for layer, p in enumerate(maps):  # (B, h, T, T)
            if p is None:
                continue
            kept = torch.tensor(layout[layer], device=device)
            js[layer, kept[:, None], kept[None, :]] += js_distances(p, real).sum(0).double()
            share[layer, kept] += special_share(p, special, real).sum(0).double()
        count += real.shape[0]
    js, share = mean_over_ranks(js, count).cpu(), mean_over_ranks(share, count).cpu()
    alive = mask.alive().cpu().clone()
    for layer, kept in enumerate(layout):
        present = torch.zeros(n_heads, dtype=torch.bool)
        present[kept] = True
        alive[layer] &= present
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    js = torch.where(alive[:, :, None] & alive[:, None, :], js, nan)
    share = torch.where(alive, share, nan)
    eos_ids = end_of_sentence_ids(model, tokenizer)  # none known: confidence over every key
    eos = {"confidence": {"eos_token_ids": eos_ids} if eos_ids else {"exclude_eos": False}}
    importance = {name: torch.where(alive, METRICS[name](model, mask, dataloader, max_batches=max_batches,
                                                         **eos.get(name, {})).double(), nan) for name in metrics}
    return HeadDiagnostics(js, share, importance, duplicate_threshold, special_threshold, ids, count)


def diagnostic_figures(diag: HeadDiagnostics, output_dir: str | Path | None = None) -> dict[str, object]:
    """Heatmaps {file stem: figure}: `importance_<metric>`, `redundancy` and `special_token_share`,
    saved as PNGs under `output_dir` when given. Close them with plots.close."""
    from headprune.plots import head_heatmap

    def path(stem: str):
        return Path(output_dir) / f"{stem}.png" if output_dir is not None else None

    figures = {f"importance_{name}": head_heatmap(scores, f"{name} importance (higher = keep)",
                                                  path(f"importance_{name}"))
               for name, scores in diag.importance.items()}
    figures["redundancy"] = head_heatmap(diag.redundancy(), "JS distance to the closest head in the layer "
                                         "(low = redundant)", path("redundancy"), cmap="magma", vmin=0, vmax=1)
    figures["special_token_share"] = head_heatmap(diag.special_token_share, "attention share on special tokens",
                                                  path("special_token_share"), cmap="Reds", vmin=0, vmax=1)
    return figures
