"""Where the attention heads live in each supported architecture.

An adapter answers, for one model family: which module is each layer's attention, which
module is its output projection (whose input is the concatenation of the heads' contexts),
how many query / key-value heads of what size the config declares, and which rows and
columns of which weights belong to each head (`head_rows`, in the family's own weight layout:
GPT-2's fused `c_attn` included). Head gating (`mask.py`), scoring, physical removal
(`surgery.py`) and optimizer-state surgery only talk to adapters, so adding a family means
adding one `register_adapter(ArchAdapter(...))` entry here (docs/adding_an_architecture.md).

Two facts live here and nowhere else: which KV head a query head reads (`ArchAdapter.kv_head`,
and `kv_groups` built on it), and how a projection stores its weight (Linear (out, in), GPT-2's
Conv1D (in, out): `feature_dim`, `out_in_weight`, `num_features`, `set_num_features`,
`stores_in_out`); surgery, folding, the headless layer, the bench's sparse copies and saving
ask these instead of testing for Conv1D themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

PARTS = ("q", "k", "v", "o")


@dataclass(frozen=True)
class Rows:
    """The features of one projection that belong to one head: output features `start:stop`
    (Q/K/V rows, `outputs=True`) or input features (output-projection columns). Knows where
    they sit in the module's weight: Linear stores (out, in), GPT-2's Conv1D (in, out)."""

    module: nn.Module
    outputs: bool
    start: int
    stop: int

    @property
    def index(self) -> range:
        return range(self.start, self.stop)

    def weight_dim(self) -> int:
        """The dimension of `module.weight` along which these features lie."""
        return feature_dim(self.module, self.outputs)

    def param_slices(self, with_bias: bool = True) -> list[tuple[nn.Parameter, int, slice]]:
        """(parameter, dim, slice) of the weight, and of the bias for output features."""
        cut = slice(self.start, self.stop)
        out = [(self.module.weight, self.weight_dim(), cut)]
        if with_bias and self.outputs and getattr(self.module, "bias", None) is not None:
            out.append((self.module.bias, 0, cut))
        return out

    def weight(self) -> torch.Tensor:
        """The weight slice as (features, other side): rows for Q/K/V, columns (transposed) for O."""
        dim = self.weight_dim()
        w = self.module.weight.narrow(dim, self.start, self.stop - self.start)
        return w if dim == 0 else w.t()



# -- a projection's weight layout: Linear (out, in), GPT-2's Conv1D (in, out) -----------------------
PROJECTION_TYPES = (nn.Linear, Conv1D)  # the module types a projection of the blocks may be


def stores_in_out(module: nn.Module) -> bool:
    """True when `module.weight` is stored (in, out) (GPT-2's Conv1D), False for (out, in) (Linear)."""
    return isinstance(module, Conv1D)


def feature_dim(module: nn.Module, outputs: bool) -> int:
    """The dimension of `module.weight` that indexes its output features (`outputs=True`) or its
    input features."""
    return int(stores_in_out(module)) if outputs else int(not stores_in_out(module))


def num_features(module: nn.Module, outputs: bool) -> int:
    """How many output (or input) features the projection's weight has now."""
    return int(module.weight.shape[feature_dim(module, outputs)])


def set_num_features(module: nn.Module, outputs: bool, n: int) -> None:
    """Record on the module that it now has `n` output (or input) features, under the attribute
    its class reads (Conv1D `nf` / `nx`, Linear `out_features` / `in_features`)."""
    conv = stores_in_out(module)
    setattr(module, ("nf" if conv else "out_features") if outputs else ("nx" if conv else "in_features"), n)


def out_in_weight(module: nn.Module) -> torch.Tensor:
    """The projection's weight as (out, in), a view (transposed for Conv1D)."""
    return module.weight.t() if stores_in_out(module) else module.weight


LAYOUT_ATTR = "headprune_layout"


@dataclass(frozen=True)
class ArchAdapter:
    """Describes one architecture family.

    `layers_path` is the dotted path from the *base* model (`model.base_model`) to the list
    of transformer blocks; `attn_path` leads from a block to the module that owns the head
    attributes; `q`, `k`, `v`, `o` name the projections inside that module (`o` may be a
    dotted path, as in BERT where the output projection sits beside the attention).
    When `q`, `k` and `v` name one module, its outputs are the fused [q | k | v] (GPT-2).

    Only Linear and GPT-2's Conv1D projections are supported.

    `config_head_dim`: the family's config carries `head_dim` apart from the hidden size, so a
    model that keeps the same numbers of query and KV heads in every layer is a plain model of
    a config with those numbers (`save_pruned` then writes a folder plain `from_pretrained` loads).

    For physical removal (`surgery.py`): `core` leads from the attention module to the module
    that computes the heads' context (and owns the attributes its forward reads); "" means the
    attention module itself. `size_attrs` lists those attributes as (name, quantity) with
    quantity one of "heads" (query heads kept), "width" (heads * head_dim) or "groups" (query
    heads per KV head, i.e. `num_key_value_groups`).
    """

    name: str
    model_types: tuple[str, ...]
    layers_path: str
    attn_path: str
    q: str
    k: str
    v: str
    o: str
    heads_attr: str = "num_attention_heads"
    kv_heads_attr: str | None = None
    core: str = ""
    size_attrs: tuple[tuple[str, str], ...] = ()
    config_head_dim: bool = False  # the config's head_dim is its own field, so fewer heads fit a plain config

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.base_model.get_submodule(self.layers_path))

    def attention(self, block: nn.Module) -> nn.Module:
        return block.get_submodule(self.attn_path)

    def out_proj(self, block: nn.Module) -> nn.Module:
        return self.attention(block).get_submodule(self.o)

    def num_heads(self, config) -> int:
        return int(getattr(config, self.heads_attr))

    def num_kv_heads(self, config) -> int:
        if self.kv_heads_attr is None:
            return self.num_heads(config)
        value = getattr(config, self.kv_heads_attr, None)
        return int(value) if value is not None else self.num_heads(config)

    def head_dim(self, config) -> int:
        explicit = getattr(config, "head_dim", None)
        if explicit:
            return int(explicit)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "dim")
        return int(hidden) // self.num_heads(config)

    @property
    def fused_qkv(self) -> bool:
        """Q, K and V are one projection whose outputs are [q | k | v] (GPT-2's `c_attn`)."""
        return self.q == self.k == self.v

    def group_size(self, config) -> int:
        """Query heads per KV head (1 without grouped-query attention)."""
        return self.num_heads(config) // self.num_kv_heads(config)

    def kv_head(self, config, head: int) -> int:
        """The KV head (original id) that query head `head` reads: the one place that knows it is
        `head // group_size` (HF's `repeat_kv` repeats each KV head for consecutive query heads)."""
        return head // self.group_size(config)

    def kv_groups(self, config, heads) -> dict[int, list[int]]:
        """{KV head id: the query heads of `heads` that read it}, KV heads and their query heads in
        ascending order (`kv_head`); `kv_groups(config, range(num_heads))` is every group."""
        out: dict[int, list[int]] = {}
        for h in sorted(heads):
            out.setdefault(self.kv_head(config, h), []).append(h)
        return dict(sorted(out.items()))

    def head_rows(self, model: nn.Module, layer: int) -> dict[int, dict[str, Rows]]:
        """{original head id: {"q"|"k"|"v"|"o": Rows}} for the heads `layer` physically holds.

        A head owns `head_dim` query rows and output-projection columns at its position among
        the layer's kept heads. Its "k"/"v" rows are those of its KV head: under grouped-query
        attention the query heads of a group share them (same Rows). A fused projection holds
        [all kept q | all kept KV k | all kept KV v] along its outputs."""
        attn = self.attention(self.blocks(model)[layer])
        kept = layer_heads(model, layer)
        d = self.head_dim(model.config)
        kv_kept = list(self.kv_groups(model.config, kept))  # KV heads the layer holds, in order
        q, k, v, o = (attn.get_submodule(path) for path in (self.q, self.k, self.v, self.o))
        k_offset = len(kept) * d if self.fused_qkv else 0
        v_offset = k_offset + len(kv_kept) * d if self.fused_qkv else 0
        rows = {}
        for pos, head in enumerate(kept):
            kv = kv_kept.index(self.kv_head(model.config, head))
            rows[head] = {"q": Rows(q, True, pos * d, (pos + 1) * d),
                          "k": Rows(k, True, k_offset + kv * d, k_offset + (kv + 1) * d),
                          "v": Rows(v, True, v_offset + kv * d, v_offset + (kv + 1) * d),
                          "o": Rows(o, False, pos * d, (pos + 1) * d)}
        return rows

    def qk_output_features(self, model: nn.Module, layer: int) -> dict[nn.Module, torch.Tensor]:
        """{projection: bool (out_features,)} True where an output feature is a query or key
        (a separate Q or K projection is all True; a fused one is True on its q and k thirds)."""
        attn = self.attention(self.blocks(model)[layer])
        flags: dict[nn.Module, torch.Tensor] = {}
        for path in dict.fromkeys((self.q, self.k, self.v)):
            module = attn.get_submodule(path)
            flags[module] = torch.zeros(num_features(module, outputs=True), dtype=torch.bool)
        for parts in self.head_rows(model, layer).values():
            for part in ("q", "k"):
                r = parts[part]
                flags[r.module][r.start:r.stop] = True
        return flags


ADAPTERS: dict[str, ArchAdapter] = {}


def register_adapter(adapter: ArchAdapter) -> ArchAdapter:
    for model_type in adapter.model_types:
        ADAPTERS[model_type] = adapter
    return adapter


_BERT_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "xlm_roberta")
register_adapter(ArchAdapter(
    name="bert", model_types=_BERT_TYPES, layers_path="encoder.layer", attn_path="attention",
    q="self.query", k="self.key", v="self.value", o="output.dense",
    core="self", size_attrs=(("num_attention_heads", "heads"), ("all_head_size", "width")),
))
register_adapter(ArchAdapter(
    name="distilbert", model_types=("distilbert",), layers_path="transformer.layer",
    attn_path="attention", q="q_lin", k="k_lin", v="v_lin", o="out_lin", heads_attr="n_heads",
    size_attrs=(("n_heads", "heads"),),
))
register_adapter(ArchAdapter(
    name="gpt2", model_types=("gpt2",), layers_path="h", attn_path="attn",
    q="c_attn", k="c_attn", v="c_attn", o="c_proj", heads_attr="n_head",
    size_attrs=(("num_heads", "heads"), ("split_size", "width")),
))
register_adapter(ArchAdapter(
    name="llama", model_types=("llama", "mistral", "qwen2"), layers_path="layers",
    attn_path="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
    kv_heads_attr="num_key_value_heads", size_attrs=(("num_key_value_groups", "groups"),), config_head_dim=True,
))


def get_adapter(model: nn.Module) -> ArchAdapter:
    """The adapter for `model`'s family, or an error listing the supported families."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        supported = ", ".join(sorted(ADAPTERS))
        raise NotImplementedError(
            f"headprune has no head adapter for model_type={model_type!r}. Supported model types: "
            f"{supported}. To add one, register an ArchAdapter naming the block list and the Q/K/V/O "
            "projections (see docs/adding_an_architecture.md)."
        )
    return ADAPTERS[model_type]


def head_layout(model: nn.Module) -> list[list[int]]:
    """Original ids of the heads each layer still physically has (all of them until pruned)."""
    layout = getattr(model, LAYOUT_ATTR, None)
    if layout is not None:
        return [list(layer) for layer in layout]
    adapter = get_adapter(model)
    n_layers = len(adapter.blocks(model))
    return [list(range(adapter.num_heads(model.config))) for _ in range(n_layers)]


def layer_heads(model: nn.Module, layer: int) -> list[int]:
    """Original ids of the heads `layer` still physically has: `head_layout(model)[layer]`
    without building the whole layout (the mask hook asks on every forward)."""
    layout = getattr(model, LAYOUT_ATTR, None)
    if layout is not None:
        return list(layout[layer])
    return list(range(get_adapter(model).num_heads(model.config)))


def model_shape(model: nn.Module) -> tuple[int, int]:
    """(layers, heads) of the original, unpruned model."""
    adapter = get_adapter(model)
    return len(adapter.blocks(model)), adapter.num_heads(model.config)


