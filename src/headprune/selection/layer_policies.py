"""Layer policies: given importance scores and a number of heads to prune, pick which heads.

A policy is a small typed object holding its options (Hydra builds it from
`conf/layer_policy/<name>.yaml`); calling it is a pure function
`layer_policy(scores, alive, n_prune, sensitivity=None) -> list[(layer, head)]`:
`scores` is (layers, heads), higher = more important; `alive` is the bool keep-mask (True =
not yet pruned). Heads already pruned are never chosen again. Each policy returns exactly
`n_prune` heads or raises `ShortfallError` explaining which constraint makes that impossible.

Constraints shared by all policies (`LayerPolicy`):
- `min_heads_per_layer`: every layer keeps at least this many heads (0 lets a whole
  attention sub-layer go);
- `max_prune_per_layer`: no layer loses more than this many heads over the whole run
  (None = no limit).
`caps(alive)` says how many more heads each layer may lose under a policy's constraints
(protected layers included), for callers that plan a budget of their own.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, List, Optional

import torch

from headprune.selection.sensitivity import check_share


class ShortfallError(ValueError):
    """The constraints leave fewer prunable heads than requested; `available` says how many."""

    def __init__(self, message: str, available: int):
        super().__init__(message)
        self.available = available


def check_constraints(min_heads_per_layer: int, max_prune_per_layer: int | None) -> None:
    if min_heads_per_layer < 0:
        raise ValueError(f"layer_policy.min_heads_per_layer={min_heads_per_layer} must be >= 0")
    if max_prune_per_layer is not None and max_prune_per_layer < 0:
        raise ValueError(f"layer_policy.max_prune_per_layer={max_prune_per_layer} must be >= 0 or null")


def capacity(alive: torch.Tensor, min_heads_per_layer: int = 1,
             max_prune_per_layer: int | None = None) -> list[int]:
    """How many more heads each layer may lose under the constraints."""
    check_constraints(min_heads_per_layer, max_prune_per_layer)
    n_heads = alive.shape[1]
    caps = []
    for left in alive.sum(dim=1).tolist():
        cap = max(int(left) - min_heads_per_layer, 0)
        if max_prune_per_layer is not None:
            cap = min(cap, max(max_prune_per_layer - (n_heads - int(left)), 0))
        caps.append(cap)
    return caps


def _check(scores: torch.Tensor, alive: torch.Tensor, n_prune: int, caps: Sequence[int], why: str) -> None:
    if scores.shape != alive.shape:
        raise ValueError(f"scores shape {tuple(scores.shape)} != mask shape {tuple(alive.shape)}")
    if n_prune < 0:
        raise ValueError(f"n_prune={n_prune} must be >= 0")
    available = sum(caps)
    if n_prune > available:
        raise ShortfallError(f"asked to prune {n_prune} heads but only {available} may go ({why}; "
                          f"alive per layer: {alive.sum(dim=1).tolist()}, may lose: {list(caps)})", available)


def _constraints_text(min_heads_per_layer: int, max_prune_per_layer: int | None) -> str:
    text = f"layer_policy.min_heads_per_layer={min_heads_per_layer}"
    if max_prune_per_layer is not None:
        text += f", layer_policy.max_prune_per_layer={max_prune_per_layer}"
    return text


def layer_normalized(scores: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """Scores divided by the L2 norm of their layer's alive heads."""
    s = torch.where(alive, scores, torch.zeros_like(scores))
    return s / s.norm(dim=1, keepdim=True).clamp_min(1e-20)


def _lowest_first(scores: torch.Tensor, alive: torch.Tensor, caps: list[int], n_prune: int) -> list[tuple[int, int]]:
    """Greedy global ranking: lowest score first, skipping layers that hit their cap."""
    caps = list(caps)
    order = sorted((float(scores[l, h]), l, h) for l, h in alive.nonzero().tolist())
    chosen = []
    for _, layer, head in order:
        if len(chosen) == n_prune:
            break
        if caps[layer] > 0:
            chosen.append((layer, head))
            caps[layer] -= 1
    return chosen


def _by_quota(scores: torch.Tensor, alive: torch.Tensor, quota: list[int]) -> list[tuple[int, int]]:
    """Each layer's `quota[l]` lowest-scoring alive heads."""
    chosen = []
    for layer, q in enumerate(quota):
        heads = alive[layer].nonzero().flatten().tolist()
        heads.sort(key=lambda h: (float(scores[layer, h]), h))
        chosen.extend((layer, h) for h in heads[:q])
    return chosen


@dataclass
class LayerPolicy:
    """The constraints every policy honours; subclasses decide the order heads go in.
    `needs_sensitivity`: the policy reads a measured per-layer sensitivity profile (the
    pruning round measures it once, with `share` of each layer's weakest heads masked)."""

    min_heads_per_layer: int = 1
    max_prune_per_layer: Optional[int] = None

    needs_sensitivity: ClassVar[bool] = False
    # a cost budget (selection.budgets) keeps the same number of units in every layer
    same_units_per_layer: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_constraints(self.min_heads_per_layer, self.max_prune_per_layer)

    def unit_scores(self, scores: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """The scores as this policy ranks heads, for a cost budget's allocation (higher = keep)."""
        return scores

    def caps(self, alive: torch.Tensor) -> list[int]:
        """How many more heads each layer may lose."""
        return capacity(alive, self.min_heads_per_layer, self.max_prune_per_layer)

    def why(self) -> str:
        """The settings that limit the caps, for error messages."""
        return _constraints_text(self.min_heads_per_layer, self.max_prune_per_layer)

    def __call__(self, scores: torch.Tensor, alive: torch.Tensor, n_prune: int,
                 sensitivity: Sequence[float] | None = None) -> list[tuple[int, int]]:
        caps = self.caps(alive)
        _check(scores, alive, n_prune, caps, self.why())
        return self.select(scores, alive, n_prune, caps, sensitivity)

    def select(self, scores: torch.Tensor, alive: torch.Tensor, n_prune: int, caps: list[int],
               sensitivity: Sequence[float] | None) -> list[tuple[int, int]]:
        raise NotImplementedError


@dataclass
class GlobalPolicy(LayerPolicy):
    """Rank all alive heads together and prune the lowest. `normalize` divides scores by their
    layer's L2 norm first (Michel et al.), so layers with large raw scores are not spared."""

    normalize: bool = False

    def unit_scores(self, scores, alive):
        return layer_normalized(scores, alive) if self.normalize else scores

    def select(self, scores, alive, n_prune, caps, sensitivity=None):
        return _lowest_first(self.unit_scores(scores, alive), alive, caps, n_prune)


@dataclass
class UniformPolicy(LayerPolicy):
    """The same share of heads in every layer: each pick goes to the layer that has lost the
    fewest heads so far (ties: the layer whose weakest head scores lowest) and takes that
    layer's lowest-scoring alive head."""

    same_units_per_layer: ClassVar[bool] = True

    def select(self, scores, alive, n_prune, caps, sensitivity=None):
        lost = (~alive).sum(dim=1).tolist()
        quota = [0] * alive.shape[0]
        for _ in range(n_prune):
            def key(layer: int):
                heads = alive[layer].nonzero().flatten().tolist()
                heads.sort(key=lambda h: (float(scores[layer, h]), h))
                nxt = heads[quota[layer]]
                return (lost[layer] + quota[layer], float(scores[layer, nxt]), layer)

            layer = min((l for l in range(len(caps)) if quota[l] < caps[l]), key=key)
            quota[layer] += 1
        return _by_quota(scores, alive, quota)


def depth_weights(num_layers: int, protect_first: int = 0, protect_last: int = 0,
                  weights: Sequence[float] | None = None) -> list[float]:
    """Per-layer prior weights (higher = keep more). `weights` are values at evenly spaced
    relative depths from 0 (first layer) to 1 (last), linearly interpolated; the first and
    last `protect_*` layers get weight inf (never pruned)."""
    if protect_first < 0 or protect_last < 0:
        raise ValueError("layer_policy.protect_first / protect_last must be >= 0")
    if weights is not None and len(weights) == 0:
        raise ValueError("layer_policy.weights must be a non-empty list or null")
    if weights is not None and any(w <= 0 for w in weights):
        raise ValueError(f"layer_policy.weights={list(weights)} must all be > 0")
    out = []
    for layer in range(num_layers):
        if weights is None or len(weights) == 1:
            w = float(weights[0]) if weights else 1.0
        else:
            x = layer / max(num_layers - 1, 1) * (len(weights) - 1)
            i = min(int(x), len(weights) - 2)
            w = float(weights[i]) + (x - i) * (float(weights[i + 1]) - float(weights[i]))
        out.append(w)
    for layer in list(range(min(protect_first, num_layers))) + list(range(max(num_layers - protect_last, 0), num_layers)):
        out[layer] = float("inf")
    return out


@dataclass
class DepthPriorPolicy(LayerPolicy):
    """Global ranking of (layer-normalised) scores multiplied by a prior over depth: protected
    first/last layers are never pruned, and a layer with weight 2 needs half the score of one
    with weight 1 to survive. Scores are shifted to be non-negative first (metrics such as
    entropy's -H or signed LRP score below 0, and a larger weight must always mean keep more):
    non-negative scores are used as they are."""

    protect_first: int = 1
    protect_last: int = 1
    weights: Optional[List[float]] = None
    normalize: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        depth_weights(1, self.protect_first, self.protect_last, self.weights)

    def prior(self, num_layers: int) -> list[float]:
        return depth_weights(num_layers, self.protect_first, self.protect_last, self.weights)

    def caps(self, alive: torch.Tensor) -> list[int]:
        return [0 if w == float("inf") else c for w, c in zip(self.prior(alive.shape[0]), super().caps(alive))]

    def why(self) -> str:
        return (f"{super().why()}, layer_policy.protect_first={self.protect_first}, "
                f"layer_policy.protect_last={self.protect_last}")

    def unit_scores(self, scores, alive):
        """Scores x the depth prior (protected layers are capped at 0 by `caps`, not weighted)."""
        s = layer_normalized(scores, alive) if self.normalize else scores
        lowest = float(s[alive].min()) if bool(alive.any()) else 0.0
        s = s - min(lowest, 0.0)  # >= 0 on alive heads
        finite = torch.tensor([w if w != float("inf") else 1.0 for w in self.prior(alive.shape[0])], dtype=s.dtype)
        return s * finite[:, None]

    def select(self, scores, alive, n_prune, caps, sensitivity=None):
        return _lowest_first(self.unit_scores(scores, alive), alive, caps, n_prune)


@dataclass
class SensitivityPolicy(LayerPolicy):
    """Give more of the budget to less sensitive layers.

    `sensitivity[l]` is layer l's measured loss rise (see `selection.sensitivity`) with `share`
    of its lowest-scoring heads masked, clamped below at `floor`. Heads are handed out one at a
    time to the layer whose next removal costs least, estimated as sensitivity x (heads that
    layer would then have lost); each layer drops its lowest-scoring heads.
    """

    share: float = 0.5
    floor: float = 1e-3

    needs_sensitivity: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_share(self.share)

    def select(self, scores, alive, n_prune, caps, sensitivity=None):
        if sensitivity is None:
            raise ValueError("layer_policy=sensitivity needs the measured layer sensitivity profile "
                             "(prune_round measures it once before the first round)")
        if len(sensitivity) != alive.shape[0]:
            raise ValueError(f"sensitivity has {len(sensitivity)} entries for {alive.shape[0]} layers")
        sens = [max(float(s), self.floor) for s in sensitivity]
        lost = (~alive).sum(dim=1).tolist()
        quota = [0] * alive.shape[0]
        for _ in range(n_prune):
            layer = min((l for l in range(len(caps)) if quota[l] < caps[l]),
                        key=lambda l: (sens[l] * (lost[l] + quota[l] + 1), l))
            quota[layer] += 1
        return _by_quota(scores, alive, quota)


@dataclass
class MeasuringPolicy(LayerPolicy):
    """A policy that allocates a cost budget itself from measurements of the model on the
    calibration batches (`measures_layout`: `prune_round` calls `measure_allocation` with the
    model, mask and scoring loader instead of `budgets.allocate`). It may empty a layer
    (`min_heads_per_layer=0` by default); `protect_first` / `protect_last` layers lose nothing.
    It reads the model, so it needs a cost budget (budget=kv, flops or latency)."""

    min_heads_per_layer: int = 0
    protect_first: int = 0
    protect_last: int = 0

    measures_layout: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        depth_weights(1, self.protect_first, self.protect_last)

    def caps(self, alive: torch.Tensor) -> list[int]:
        prior = depth_weights(alive.shape[0], self.protect_first, self.protect_last)
        return [0 if w == float("inf") else c for w, c in zip(prior, super().caps(alive))]

    def why(self) -> str:
        return (f"{super().why()}, layer_policy.protect_first={self.protect_first}, "
                f"layer_policy.protect_last={self.protect_last}")

    def select(self, scores, alive, n_prune, caps, sensitivity=None):
        raise ValueError(f"layer_policy={self.name} allocates a cost budget from measurements and cannot place a "
                         "number of heads; allowed: budget=kv, flops or latency")

    @property
    def name(self) -> str:
        return next(k for k, v in LAYER_POLICIES.items() if v is type(self))

    def measure_allocation(self, model, mask, loader, scores, costs, share, model_units, max_batches=None, task=None):
        """(heads to prune, allocation report, shortfall or None) for `share` of the dense cost;
        `task`: the run's Task, for a policy that measures its loss."""
        raise NotImplementedError


@dataclass
class MeasuredPolicy(MeasuringPolicy):
    """Units per layer from measured loss rises (`selection.measured`): a cost curve per layer on
    the first `profile_samples` calibration sequences (null: all of them), a knapsack over
    layers, then at most `passes` greedy correction passes of the layout measured as a whole, each
    measuring `candidates` layers per side in context."""

    profile_samples: Optional[int] = 2
    passes: int = 2
    candidates: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.profile_samples is not None and self.profile_samples < 1:
            raise ValueError(f"layer_policy.profile_samples={self.profile_samples} must be >= 1 or null (every "
                             "calibration sequence)")
        if self.passes < 0:
            raise ValueError(f"layer_policy.passes={self.passes} must be >= 0")
        if self.candidates < 1:
            raise ValueError(f"layer_policy.candidates={self.candidates} must be >= 1")

    def measure_allocation(self, model, mask, loader, scores, costs, share, model_units, max_batches=None, task=None):
        from headprune.selection.measured import measured_allocation

        return measured_allocation(model, mask, loader, scores, costs, share, self, model_units,
                                   samples=self.profile_samples, passes=self.passes, candidates=self.candidates,
                                   max_batches=max_batches, task=task)


@dataclass
class AttentionDropPolicy(MeasuringPolicy):
    """He et al. 2024: whole attention sublayers go, those whose output changes the residual
    stream least (1 - cos, `selection.attention_drop`) first, until the budget is met; measured
    on the first `samples` calibration sequences (null: all of them)."""

    samples: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"layer_policy.samples={self.samples} must be >= 1 or null (every calibration sequence)")

    def measure_allocation(self, model, mask, loader, scores, costs, share, model_units, max_batches=None, task=None):
        """(module docstring of selection.attention_drop) It measures residual-stream change, no loss:
        `task` plays no part."""
        from headprune.selection.attention_drop import attention_drop_allocation

        return attention_drop_allocation(model, mask, loader, scores, costs, share, self, model_units,
                                         samples=self.samples, max_batches=max_batches)


LAYER_POLICIES: dict[str, type[LayerPolicy]] = {"global": GlobalPolicy, "uniform": UniformPolicy,
                                                "depth_prior": DepthPriorPolicy, "sensitivity": SensitivityPolicy,
                                                "measured": MeasuredPolicy, "attention_drop": AttentionDropPolicy}
