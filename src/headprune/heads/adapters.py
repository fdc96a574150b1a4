"""The adapter type: where the attention heads live in an architecture, and the registry that
finds a model's adapter (`get_adapter`, `head_layout`).

An adapter answers, for one model family: which module is each layer's attention, which
module is its output projection (whose input is the concatenation of the heads' contexts),
how many query / key-value heads of what size the config declares, and which rows and
columns of which weights belong to each head (`head_rows`, in the family's own weight layout:
GPT-2's fused `c_attn` included). Head gating (`mask.py`), scoring, physical removal
(`surgery.py`) and optimizer-state surgery only talk to adapters, so adding a family means
adding one `register_adapter(ArchAdapter(...))` entry to families.py (docs/adding_an_architecture.md);
the reasons a checked type is refused are in refusals.py.

Two facts live here and nowhere else: which KV head a query head reads (`ArchAdapter.kv_head`,
and `kv_groups` built on it), and how a projection stores its weight (Linear (out, in), GPT-2's
Conv1D (in, out): `feature_dim`, `out_in_weight`, `num_features`, `set_num_features`,
`stores_in_out`); surgery, folding, the headless layer, the bench's sparse copies and saving
ask these instead of testing for Conv1D themselves.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from headprune.heads.refusals import REFUSED

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
    of transformer blocks (a tuple: the paths tried in order, the first the model has: a vision
    tower sits at `vision_model.encoder.layers` in CLIP's classifier, at `encoder.layers` in
    its vision model); `attn_path` leads from a block to the module that owns the head
    attributes; `q`, `k`, `v`, `o` name the projections inside that module (`o` may be a
    dotted path, as in BERT where the output projection sits beside the attention).
    When `q`, `k` and `v` name one module, its outputs are the fused [q | k | v] (GPT-2).

    Only Linear and GPT-2's Conv1D projections are supported.

    `qkv_layout` (fused projections only): "concat" when the outputs are [all q | all k | all v]
    (GPT-2's `c_attn`, Phi-3's `qkv_proj`), "per_head" when they are [q_h | k_h | v_h] head after
    head (GPT-NeoX's `query_key_value`, viewed (B, T, H, 3 * D)).

    `config_head_dim`: the family's config carries `head_dim` apart from the hidden size, so a
    model that keeps the same numbers of query and KV heads in every layer is a plain model of
    a config with those numbers (`save_pruned` then writes a folder plain `from_pretrained` loads).

    For physical removal (`surgery.py`): `core` leads from the attention module to the module
    that computes the heads' context (and owns the attributes its forward reads); "" means the
    attention module itself. `size_attrs` lists those attributes as (name, quantity) with
    quantity one of "heads" (query heads the kernel computes: the kept ones, plus zero queries
    padded into a KV group partly kept), "width" (heads * head_dim), "groups" (query heads per KV
    head, i.e. `num_key_value_groups`) or "kv_heads" (KV heads kept). `config_attrs` lists, the
    same way, head counts the forward reads from `self.config` (Phi-3 splits its fused output at
    `config.num_attention_heads * head_dim`): the core then gets its own view of the config
    (`LayerConfig`) answering those for its layer and everything else from the model's config.

    `head_params` names parameters of the core with one entry per query head along dim 0, read by
    the attention kernel (gpt-oss's `sinks`: one extra logit per head): kept with their heads, one
    per query slot (a zero query padded into a partly kept KV group gets a kept head's entry; its
    context is dropped before the output projection).

    `head_norms` names norms of the core, as (path, "q" or "k"), whose weight (and bias) may hold a row
    per query head ("q", one per query slot, padded slots getting a kept head's row as `head_params`)
    or per KV head ("k") along dim 0: Cohere's q_norm / k_norm under `use_qk_norm`, LayerNorms of shape
    (heads, head_dim). A norm whose weight is one vector over head_dim, shared by every head (Qwen3's,
    Gemma 3's), or a path the layer does not have, is left alone.

    `gates` names projections (from the attention module) whose outputs hold head_dim features per
    query head, in the query heads' order, that multiply each head's context before the output
    projection (AFMoE's and Beam's `gate_proj`, a sigmoid output gate): their rows go with the
    heads as Q's do (head_rows part named by the path), zeros padded in where queries are.

    `projection_norms` names the core's (q norm, k norm) when they are RMSNorms over the WHOLE
    query / key projection (OLMo 2's `q_norm` over heads * head_dim), not over each head: the RMS
    a kept head is divided by reads every head's features, so removing heads keeps the Q and K
    projections whole (the statistic still sees every head) and hands only the kept heads'
    features to attention and the KV cache. Exact, at a cost: the Q and K projections' parameters
    and FLOPs do not shrink (V, O, the attention itself and the KV cache do). Per-head norms (over
    head_dim, Qwen3's and Gemma 3's) need nothing: slicing heads leaves them alone; with a weight row
    per head (Cohere's) they are `head_norms`.

    `position_projections` names projections (from the attention module) that map the relative
    position embeddings to head_dim features per query head, in the heads' order, whose products
    with the heads' queries and keys are added to the attention scores (DeBERTa-v2's `pos_key_proj`
    (c2p) and `pos_query_proj` (p2c) when `share_att_key` is False): their rows go with the heads
    (head_rows part named by the path); a path the layer does not have (the config leaves c2p or p2c
    out, or shares Q's and K's projections with the positions) is skipped.

    `head_vectors` names parameters of the core with head_dim entries per head along dim 0, in the
    heads' order, that the forward adds to a head's queries or values (DeBERTa's `q_bias` / `v_bias`
    beside its bias-free fused `in_proj`): kept with their heads. Families without grouped-query
    attention only (refused at registration otherwise).

    `head_columns` names, from the block, per-layer relative position bias tables with one column per
    head along dim 1: a Parameter (BEiT's `relative_position_bias.relative_position_bias_table`,
    (distances, heads)) or a module whose weight is one (UMT5's `relative_attention_bias`, an
    Embedding(num_buckets, heads) in every self-attention layer; its `embedding_dim` follows). A layer
    keeps its kept heads' columns; a layer left without heads keeps them all (BEiT's block still
    computes its bias, which the headless attention ignores); a block without the path (cross-attention)
    is skipped. Families without grouped-query attention only, as `head_vectors`.

    `refused_settings` lists (config attribute, reason): a model whose config sets the attribute
    (truthy) is refused by `get_adapter` with the reason, before any work (DeBERTa's `talking_head`
    mixes the heads' attention logits, so removing a head would change the kept heads).
    """

    name: str
    model_types: tuple[str, ...]
    layers_path: str | tuple[str, ...]
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
    qkv_layout: str = "concat"  # a fused projection's outputs: [all q | all k | all v], or "per_head" [q_h k_h v_h]...
    config_attrs: tuple[tuple[str, str], ...] = ()  # head counts the core's forward reads from self.config
    projection_norms: tuple[str, str] | None = None  # (q norm, k norm) over the whole projection (OLMo 2)
    sub_config: str = ""  # the sub-config holding the head counts (CLIP's vision_config), "" for the config itself
    head_params: tuple[str, ...] = ()  # the core's parameters with one entry per query head (attention sinks)
    head_norms: tuple[tuple[str, str], ...] = ()  # (norm path, "q"|"k"): a weight row per query / KV head (Cohere)
    gates: tuple[str, ...] = ()  # projections with head_dim outputs per query head gating its context (AFMoE)
    position_projections: tuple[str, ...] = ()  # per-head projections of relative positions (DeBERTa-v2)
    head_vectors: tuple[str, ...] = ()  # the core's parameters with head_dim entries per head (DeBERTa's q_bias)
    head_columns: tuple[str, ...] = ()  # per-layer bias tables with one column per head (UMT5, BEiT), from the block
    refused_settings: tuple[tuple[str, str], ...] = ()  # (config attribute, why a model that sets it is refused)

    def present_position_projections(self, attn: nn.Module) -> dict[str, nn.Module]:
        """{path: module} of the `position_projections` this attention module has."""
        out = {}
        for path in self.position_projections:
            try:
                out[path] = attn.get_submodule(path)
            except AttributeError:
                continue
        return out

    def config_of(self, config):
        """The (sub-)config the head counts are read from: `config.<sub_config>` where it has one."""
        return getattr(config, self.sub_config, config) if self.sub_config else config

    def __post_init__(self):
        if self.qkv_layout not in ("concat", "per_head"):
            raise ValueError(f"ArchAdapter {self.name!r}: qkv_layout={self.qkv_layout!r}; allowed: 'concat', 'per_head'")
        quantities = ("heads", "width", "groups", "kv_heads")
        for name, quantity in (*self.size_attrs, *self.config_attrs):
            if quantity not in quantities:
                raise ValueError(f"ArchAdapter {self.name!r}: {name} has quantity {quantity!r}; allowed: {quantities}")
        if any(part not in ("q", "k") for _, part in self.head_norms):
            raise ValueError(f"ArchAdapter {self.name!r}: head_norms={self.head_norms!r}; each part must be 'q' or 'k'")
        if (self.head_vectors or self.head_columns) and self.kv_heads_attr is not None:
            raise ValueError(f"ArchAdapter {self.name!r}: head_vectors / head_columns are per head, without "
                             "grouped-query attention (kv_heads_attr must be None)")

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        paths = (self.layers_path,) if isinstance(self.layers_path, str) else self.layers_path
        for path in paths[:-1]:
            try:
                return list(model.base_model.get_submodule(path))
            except AttributeError:
                continue
        return list(model.base_model.get_submodule(paths[-1]))

    def attention(self, block: nn.Module) -> nn.Module:
        return block.get_submodule(self.attn_path)

    def out_proj(self, block: nn.Module) -> nn.Module:
        return self.attention(block).get_submodule(self.o)

    def num_heads(self, config) -> int:
        return int(getattr(self.config_of(config), self.heads_attr))

    def num_kv_heads(self, config) -> int:
        if self.kv_heads_attr is None:
            return self.num_heads(config)
        value = getattr(self.config_of(config), self.kv_heads_attr, None)
        return int(value) if value is not None else self.num_heads(config)

    def head_dim(self, config) -> int:
        config = self.config_of(config)
        explicit = getattr(config, "head_dim", None)
        if explicit:
            return int(explicit)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "dim")
        return int(hidden) // self.num_heads(config)

    def for_model(self, model: nn.Module) -> "ArchAdapter":
        """The adapter as it applies to `model`: itself, or for a family whose projections depend on
        the config (MLA's q_proj without a query LoRA, heads/latent.py) the variant naming them."""
        return self

    def query_width(self, config) -> int:
        """Output features of the query projection per query head: head_dim, or 2 x head_dim where
        each head's queries are followed by its output gate (Qwen3-Next, heads/hybrid.py)."""
        return self.head_dim(config)

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

    def query_slots(self, config, kept) -> tuple[list[int], int]:
        """(position of each of `kept` among the query heads the attention kernel computes, how many
        it computes). The same unless a KV group is partly kept: every kept group then gets as
        many query slots as the fullest one, zero queries padded in (surgery.py), so the kernel's
        attention maps and contexts have a head per slot."""
        groups = self.kv_groups(config, kept)
        per_group = max((len(heads) for heads in groups.values()), default=0)
        return [i * per_group + t for i, heads in enumerate(groups.values()) for t in range(len(heads))], \
            len(groups) * per_group

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
        positions = self.present_position_projections(attn)
        if self.fused_qkv and self.qkv_layout == "per_head":  # [q_h | k_h | v_h] per head (no GQA)
            return {head: {part: Rows(q, True, (3 * pos + i) * d, (3 * pos + i + 1) * d)
                           for i, part in enumerate(("q", "k", "v"))} | {"o": Rows(o, False, pos * d, (pos + 1) * d)}
                    | {p: Rows(m, True, pos * d, (pos + 1) * d) for p, m in positions.items()}
                    for pos, head in enumerate(kept)}
        k_offset = len(kept) * d if self.fused_qkv else 0
        v_offset = k_offset + len(kv_kept) * d if self.fused_qkv else 0
        rows = {}
        for pos, head in enumerate(kept):
            kv = kv_kept.index(self.kv_head(model.config, head))
            # whole-projection norms (OLMo 2): Q and K keep every head's rows, at the original positions
            q_at, k_at = (head, self.kv_head(model.config, head)) if self.projection_norms else (pos, kv)
            rows[head] = {"q": Rows(q, True, q_at * d, (q_at + 1) * d),
                          "k": Rows(k, True, k_offset + k_at * d, k_offset + (k_at + 1) * d),
                          "v": Rows(v, True, v_offset + kv * d, v_offset + (kv + 1) * d),
                          "o": Rows(o, False, pos * d, (pos + 1) * d),
                          **{g: Rows(attn.get_submodule(g), True, pos * d, (pos + 1) * d) for g in self.gates},
                          **{p: Rows(m, True, pos * d, (pos + 1) * d) for p, m in positions.items()}}
        return rows

    def qk_output_features(self, model: nn.Module, layer: int) -> dict[nn.Module, torch.Tensor]:
        """{projection: bool (features its forward returns,)} True where an output feature is a
        query or key (a separate Q or K projection is all True; a fused one is True on its q and k
        parts). A fused projection of a layer whose partly kept KV groups get zero queries padded in
        (surgery's hook on its output) returns those padded queries too: flagged as queries."""
        attn = self.attention(self.blocks(model)[layer])
        flags: dict[nn.Module, torch.Tensor] = {}
        for path in dict.fromkeys((self.q, self.k, self.v)):
            module = attn.get_submodule(path)
            flags[module] = torch.zeros(num_features(module, outputs=True), dtype=torch.bool)
        for parts in self.head_rows(model, layer).values():
            for part in ("q", "k"):
                r = parts[part]
                flags[r.module][r.start:r.stop] = True
        kept = layer_heads(model, layer)
        padded = self.query_slots(model.config, kept)[1] - len(kept)
        if padded and self.fused_qkv:
            q = attn.get_submodule(self.q)
            flags[q] = torch.cat([torch.ones(padded * self.head_dim(model.config), dtype=torch.bool), flags[q]])
        return flags


ADAPTERS: dict[str, ArchAdapter] = {}


def register_adapter(adapter: ArchAdapter) -> ArchAdapter:
    for model_type in adapter.model_types:
        ADAPTERS[model_type] = adapter
    return adapter


def get_adapter(model: nn.Module) -> ArchAdapter:
    """The adapter for `model`'s family, or an error saying what is missing for this one (what its
    attention looks like) and listing the supported families."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    composite = composite_adapter(model) if model_type not in ADAPTERS else None
    if model_type not in ADAPTERS and composite is None:
        supported = ", ".join(sorted(ADAPTERS))
        raise NotImplementedError(
            f"headprune has no head adapter for model_type={model_type!r}: {missing(model)}. Supported model types: "
            f"{supported}. To add one, register an ArchAdapter naming the block list and the Q/K/V/O "
            "projections (see docs/adding_an_architecture.md)."
        )
    adapter = composite or ADAPTERS[model_type].for_model(model)
    for attr, why in adapter.refused_settings:
        if getattr(adapter.config_of(model.config), attr, None):
            raise NotImplementedError(f"headprune cannot prune model_type={model_type!r} with {attr}="
                                      f"{getattr(adapter.config_of(model.config), attr)!r}: {why}")
    return adapter


def composite_adapter(model: nn.Module) -> ArchAdapter | None:
    """One rule for composites without an entry of their own (a vision- or audio-language model such
    as Gemma 3, Fuyu, GOT-OCR2): when the text model (`config.get_text_config()`, a sub-config) is
    a registered family, its adapter applies, reading the head counts from that sub-config
    (`sub_config`) and the blocks under the text model. Only the text model's heads are pruned (a
    vision or audio tower is left whole). Saved with the layout file (`config_head_dim=False`): a
    plain config would need the pruned counts written into the sub-config. None when the rule does
    not apply (then `get_adapter` refuses as for any unknown type)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config or getattr(text, "model_type", None) not in ADAPTERS or getattr(config, "is_encoder_decoder", False):
        return None  # an encoder-decoder composite has several stacks: not the text model alone
    sub = next((name for name in (getattr(config, "sub_configs", None) or {}) if getattr(config, name, None) is text),
               None)
    found = next(((name, module) for name, module in model.base_model.named_modules()
                  if name and getattr(module, "config", None) is text), None)
    if sub is None or found is None:
        return None
    path, text_model = found
    inner = getattr(text_model, "base_model", text_model)  # a text model with a head: its paths start at its base
    path = next(f"{path}.{name}" if name else path for name, module in text_model.named_modules() if module is inner)
    base = ADAPTERS[text.model_type]
    if base.sub_config or getattr(base, "stacks", ()):  # already nested, or several stacks: not this rule
        return None
    paths = (base.layers_path,) if isinstance(base.layers_path, str) else base.layers_path
    return dataclasses.replace(base, name=f"{base.name} ({sub})", model_types=(config.model_type,), sub_config=sub,
                               layers_path=tuple(f"{path}.{p}" for p in paths), config_head_dim=False).for_model(model)


def missing(model: nn.Module) -> str:
    """What stands between `model` and an adapter, in a phrase: the known reason for a refused type,
    else what its first attention module holds."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in REFUSED:
        return REFUSED[model_type]
    found = next(((name, module) for name, module in model.named_modules()
                  if name and type(module).__name__.lower().endswith(("attention", "attn"))), None)
    if found is None:
        return "no module of it is an attention (its class name ending in Attention): no heads to prune"
    name, attn = found
    linears = [n for n, m in attn.named_children() if isinstance(m, PROJECTION_TYPES)]
    where = f"its attention `{name}` ({type(attn).__name__})"
    if {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(linears):
        return (f"{where} has Llama's q_proj / k_proj / v_proj / o_proj, but this type has not been checked with "
                f"that layout: `python -m tools.coverage --only {model_type} --probe` (in a headprune checkout) checks it, and "
                "LLAMA_LAYOUT_TYPES in headprune/heads/families.py lists the types that pass")
    return (f"{where} has projections {linears or 'none'}: no adapter says which of their rows and columns belong "
            "to each head")


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


# The families register themselves from their own modules: the single-stack ones (families.py), the
# encoder-decoder ones with several attention stacks (stacks.py).
from headprune.heads import families as _families, stacks as _stacks  # noqa: E402,F401
