"""The model variants the bench compares, all derived from one dense model.

- `dense`: the model as given.
- `masked`: HeadMask gates the heads off; every head is still computed (same shapes).
- `pruned`: the heads are physically removed (`prune_heads`), with a `uniform` layout (the same
  number of heads per layer) or a `skewed` one (the same total, more taken from middle layers).
  Removal goes by KV group, so with grouped-query attention whole groups (and their cache) go.
- `unstructured_dense` / `unstructured_sparse`: as many Q/K/V/O weights as the uniform head
  pruning removes are zeroed by global magnitude, then run with the usual dense kernels, or
  with the projections stored as CSR tensors and multiplied by `torch.sparse.mm`.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from headprune.heads.adapters import get_adapter, head_layout, out_in_weight
from headprune.heads.layout import Layout
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import heads_of_kv_groups, kv_group_heads, prune_heads

KINDS = ("dense", "masked", "pruned", "unstructured_dense", "unstructured_sparse")
LAYOUTS = ("uniform", "skewed")


@dataclass
class Variant:
    """One model to time, with what the FLOP count needs: query and KV heads computed per layer,
    and the nonzero share of each layer's Q/K/V/O weights."""

    name: str
    kind: str
    layout: str | None
    sparsity: float
    model: nn.Module
    heads: list[int]
    kv_heads: list[int]
    densities: list[float] = field(default_factory=list)

    def row(self) -> dict:
        return {"variant": self.name, "kind": self.kind, "layout": self.layout, "sparsity": round(self.sparsity, 4)}


def removal_counts(layout: str, n_layers: int, units: int, sparsity: float) -> list[int]:
    """How many units (KV groups; heads without GQA) each layer loses at `sparsity`.

    `uniform`: round(sparsity * units) per layer. `skewed`: the same total, handed out one at a
    time to the layer with the largest weight / (removed + 1), weights rising linearly towards
    the middle layers (ties: nearer the middle, then lower index); every layer keeps a unit.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"bench.layouts contains {layout!r}; allowed: {', '.join(LAYOUTS)}")
    if not 0 <= sparsity < 1:
        raise ValueError(f"bench.sparsities contains {sparsity}; allowed: 0 <= sparsity < 1")
    per_layer = round(sparsity * units)
    if layout == "uniform":
        return [per_layer] * n_layers
    total, cap = per_layer * n_layers, units - 1
    if total > cap * n_layers:
        raise ValueError(f"bench.sparsities: {sparsity} leaves no head in some layer of a skewed layout "
                         f"({units} units per layer); allowed: sparsity <= {cap / units:.3f}")
    middle = (n_layers - 1) / 2
    weight = [1 + min(layer, n_layers - 1 - layer) for layer in range(n_layers)]
    counts = [0] * n_layers
    for _ in range(total):
        open_layers = [layer for layer in range(n_layers) if counts[layer] < cap]
        best = max(open_layers, key=lambda l: (weight[l] / (counts[l] + 1), -abs(l - middle), -l))
        counts[best] += 1
    return counts


def heads_to_remove(model: nn.Module, counts: list[int]) -> dict[int, list[int]]:
    """Query heads (original ids) of the first `counts[layer]` KV groups of each layer."""
    return heads_of_kv_groups(model, {layer: range(n) for layer, n in enumerate(counts) if n})


def build_variants(dense: nn.Module, kinds: Mapping[str, Iterable[float]], layouts: list[str]) -> list[Variant]:
    """`dense` first, then each kind at each of its sparsities (`kinds`: kind -> sparsities; pruned
    once per layout). Unstructured pruning zeroes as many weights as uniform head pruning removes.
    A variant's `sparsity` is the share of heads actually removed (requested, up to rounding)."""
    n_layers, units = len(head_layout(dense)), len(kv_group_heads(dense))
    n_heads = n_layers * get_adapter(dense).num_heads(dense.config)
    at = {kind: {float(s) for s in kinds.get(kind) or ()} for kind in KINDS}
    variants = [_described(dense, "dense", "dense", None, 0.0)]
    for requested in sorted(set().union(*at.values())):
        uniform = heads_to_remove(dense, removal_counts("uniform", n_layers, units, requested))
        sparsity = sum(map(len, uniform.values())) / n_heads
        if requested in at["masked"]:
            variants.append(masked(dense, uniform, sparsity, "uniform"))
        if requested in at["pruned"]:
            for layout in layouts:
                spec = heads_to_remove(dense, removal_counts(layout, n_layers, units, requested))
                variants.append(_described(prune_heads(copy.deepcopy(dense), spec), f"pruned_{layout}", "pruned",
                                           layout, sparsity))
        variants += unstructured(dense, [k for k in KINDS if requested in at[k]], uniform, sparsity)
    return variants


def exported_variants(dense: nn.Module, exported: nn.Module, kinds: Iterable[str]) -> list[Variant]:
    """For a loaded pruned model: `dense` (same config), then of `kinds` the same heads masked
    and unstructured pruning of as many weights, and the model itself."""
    kinds = list(kinds)
    layout = Layout.of_model(exported)  # the dense numbering: the same heads removed from `dense`
    n_heads = get_adapter(dense).num_heads(dense.config)
    removed = layout.removed_heads(dense)
    sparsity = sum(map(len, removed.values())) / (n_heads * len(layout.modes))
    variants = [_described(dense, "dense", "dense", None, 0.0)]
    if "masked" in kinds:
        variants.append(masked(dense, removed, sparsity, "exported"))
    variants.append(_described(exported, "exported", "pruned", "exported", sparsity))
    return variants + unstructured(dense, kinds, removed, sparsity)


def masked(dense: nn.Module, heads: dict[int, list[int]], sparsity: float, layout: str) -> Variant:
    model = copy.deepcopy(dense)
    mask = HeadMask.for_model(model).to(next(model.parameters()).device)  # no host-to-device copy per call
    mask.prune((layer, h) for layer, ids in heads.items() for h in ids)
    return _described(model, "masked", "masked", layout, sparsity)


def unstructured(dense: nn.Module, kinds: list[str], heads: dict[int, list[int]], sparsity: float) -> list[Variant]:
    """Magnitude-pruned copies zeroing as many Q/K/V/O weights as removing `heads` does."""
    wanted = [kind for kind in ("unstructured_dense", "unstructured_sparse") if kind in kinds]
    if not wanted:
        return []
    n_zero = qkvo_weight_count(dense) - qkvo_weight_count(prune_heads(copy.deepcopy(dense), heads))
    zeroed = copy.deepcopy(dense)
    zero_smallest(zeroed, n_zero)
    variants = []
    for kind in wanted:
        model = zeroed if kind == "unstructured_dense" else to_sparse(copy.deepcopy(zeroed))
        variant = _described(model, kind, kind, None, sparsity)
        variant.densities = layer_densities(zeroed)
        variants.append(variant)
    return variants


# -- weights ----------------------------------------------------------------------------------
def qkvo_modules(model: nn.Module) -> list[list[nn.Module]]:
    """Each layer's distinct Q/K/V/O projection modules (one for GPT-2's fused Q/K/V)."""
    adapter = get_adapter(model)
    layers = []
    for block in adapter.blocks(model):
        attn = adapter.attention(block)
        found = {}
        for path in (adapter.q, adapter.k, adapter.v, adapter.o):
            module = attn.get_submodule(path)
            found[id(module)] = module
        layers.append(list(found.values()))
    return layers


def qkvo_weight_count(model: nn.Module) -> int:
    return sum(module.weight.numel() for layer in qkvo_modules(model) for module in layer)


def zero_smallest(model: nn.Module, n_zero: int) -> None:
    """Zero the `n_zero` Q/K/V/O weights (biases excluded) of smallest magnitude, model-wide."""
    weights = [module.weight for layer in qkvo_modules(model) for module in layer]
    flat = torch.cat([w.detach().abs().flatten() for w in weights])  # (N,)
    keep = torch.ones_like(flat, dtype=torch.bool)
    keep[torch.topk(flat, n_zero, largest=False).indices] = False
    with torch.no_grad():
        for w, part in zip(weights, keep.split([w.numel() for w in weights])):
            w.mul_(part.view_as(w))


def layer_densities(model: nn.Module) -> list[float]:
    """Nonzero share of each layer's Q/K/V/O weights."""
    return [sum(int(m.weight.count_nonzero()) for m in layer) / sum(m.weight.numel() for m in layer)
            for layer in qkvo_modules(model)]


class SparseLinear(nn.Module):
    """A Linear (or GPT-2 Conv1D) whose weight is a CSR tensor, applied with `torch.sparse.mm`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        weight = out_in_weight(module).detach()  # (out, in)
        self.out_features = weight.shape[0]
        with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
            warnings.simplefilter("ignore", UserWarning)
            self.register_buffer("weight", weight.contiguous().to_sparse_csr())
        bias = module.bias.detach().clone() if module.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        out = torch.sparse.mm(self.weight, flat.t()).t()  # (N, out)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def to_sparse(model: nn.Module) -> nn.Module:
    """Replace every Q/K/V/O projection by a SparseLinear, in place."""
    adapter = get_adapter(model)
    for block in adapter.blocks(model):
        attn = adapter.attention(block)
        for path in dict.fromkeys((adapter.q, adapter.k, adapter.v, adapter.o)):
            parent, _, name = path.rpartition(".")
            owner = attn.get_submodule(parent) if parent else attn
            setattr(owner, name, SparseLinear(getattr(owner, name)))
    return model


def _described(model: nn.Module, name: str, kind: str, layout: str | None, sparsity: float) -> Variant:
    """A Variant with the heads each layer computes (all of them unless physically removed)."""
    adapter, layout_now = get_adapter(model), head_layout(model)
    heads = [len(kept) for kept in layout_now]
    kv_heads = [len(adapter.kv_groups(model.config, kept)) for kept in layout_now]
    return Variant(name, kind, layout, sparsity, model, heads, kv_heads, [1.0] * len(heads))
