"""Models with several attention stacks (encoder-decoders: Whisper, T5): how their heads are named.

One naming for every such model. An adapter with `stacks` (`StackedAdapter`) lays its attention
stacks end to end, in its own order (Whisper, the BART family and T5: `encoder` self-attention,
`decoder` self-attention, `cross` attention), one *site* per layer of each stack: "encoder.0", ...,
"decoder.0", ..., "cross.0", .... Everything that is indexed by layer (the HeadMask's rows,
scores, head layouts, `prune_heads`' layer ids, the layout file) is indexed by site in that order,
so the (sites, heads) tensors and every code path written for one stack work unchanged. What a
user writes and reads is the named form:

    {"encoder": {0: [1, 2]}, "decoder": {3: [0]}, "cross": {3: [0, 1]}}   # stack -> layer -> heads

(`prune_heads`, `HeadMask.prune` accept it; site keys {"cross.3": [0, 1]} and (stack, layer, head)
triples too), and `named_heads` / `by_stack` turn rows back into it for results.json, layout files
and heatmap labels (`site_names`). A model with one stack is untouched: its sites are its layers,
requests stay {layer: heads}, and a stack name is refused naming the model's stacks (none).

Every stack must have the same number of heads per layer (one (sites, heads) mask): a model whose
encoder and decoder head counts differ is refused with both counts.

T5's relative position bias (`position_bias`): the first self-attention layer of a stack owns an
Embedding(num_buckets, heads) and the stack passes the bias it computes, one map per head, to every
later layer, whose head h adds map h. So the Embedding's column h is removed with head h only when
every layer of that stack has lost head h (it holds the union of the stack's kept heads), and each
layer picks its own heads' maps from it (`_StackBias`). Exact, at the cost of those few columns
(num_buckets per head). Cross-attention has no bias (zeros, one map per head, made per layer).
UMT5 instead gives every self-attention layer an Embedding of its own, which that layer computes:
a plain per-layer slice (`ArchAdapter.head_columns`), nothing passed along the stack.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from headprune.heads.adapters import ArchAdapter, get_adapter, head_layout, register_adapter
from headprune.heads.headless import HeadlessAttention


@dataclass(frozen=True)
class Stack:
    """One attention stack: `layers_path` from the base model to its blocks, `attn_path` from a block
    to the attention module, `heads_attr` the config field with its head count."""

    name: str
    layers_path: str
    attn_path: str
    heads_attr: str
    cross: bool = False  # attends to another stack's states (no KV cache of its own to advance when headless)
    position_bias: bool = False  # its first layer owns the per-head relative position bias (T5)


@dataclass(frozen=True)
class StackedAdapter(ArchAdapter):
    """An ArchAdapter over several attention stacks: `blocks(model)` lists every stack's attention
    modules end to end (one per site), so `attn_path` is "" and `q`..`o` name projections of the
    attention module itself. `position_bias` names the per-head relative position bias Embedding
    a stack's first attention owns (T5's `relative_attention_bias`), "" for none."""

    stacks: tuple[Stack, ...] = ()
    position_bias: str = ""

    def spans(self, model: nn.Module) -> list[tuple[Stack, list[nn.Module]]]:
        """(stack, its attention modules) in site order; a stack the model does not hold (T5's encoder
        model has no decoder) is left out."""
        base, out = model.base_model, []
        for s in self.stacks:
            try:
                layers = base.get_submodule(s.layers_path)
            except AttributeError:
                continue
            out.append((s, [layer.get_submodule(s.attn_path) for layer in layers]))
        if not out:
            raise ValueError(f"{type(model).__name__} holds none of the {self.name} stacks "
                             f"{[s.layers_path for s in self.stacks]}")
        return out

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [attn for _, attns in self.spans(model) for attn in attns]

    def num_heads(self, config) -> int:
        counts = {f"{s.name}: {getattr(self.config_of(config), s.heads_attr)} ({s.heads_attr})":
                  int(getattr(self.config_of(config), s.heads_attr)) for s in self.stacks}
        if len(set(counts.values())) != 1:
            raise NotImplementedError(
                f"headprune prunes {self.name} models whose stacks have the same number of heads; this one has "
                f"{', '.join(counts)} (one (sites, heads) mask per model)")
        return next(iter(counts.values()))

    def site_stack(self, model: nn.Module, row: int) -> tuple[Stack, int]:
        """(stack, layer within it) of site `row`."""
        for stack, attns in self.spans(model):
            if row < len(attns):
                return stack, row
            row -= len(attns)
        raise IndexError(row)

    def make_headless(self, model: nn.Module, row: int, core: nn.Module, head_dim: int) -> None:
        """Put a `StackHeadless` where site `row`'s attention was (surgery, a layer with no heads)."""
        stack, layer = self.site_stack(model, row)
        block = model.base_model.get_submodule(stack.layers_path)[layer]
        parent_path, _, name = stack.attn_path.rpartition(".")
        parent = block.get_submodule(parent_path) if parent_path else block
        setattr(parent, name, StackHeadless(core, self.o, head_dim, getattr(core, "layer_idx", layer), stack.cross,
                                            bool(self.position_bias)))

    def settle(self, model: nn.Module, sliced: list | None = None) -> None:
        """After `prune_heads` changed the layout: each position-bias stack's Embedding keeps the
        columns of the heads some layer of the stack keeps, and each attention picks its own."""
        if not self.position_bias:
            return
        from headprune.heads.surgery import Sliced

        layout, row = head_layout(model), 0
        for stack, attns in self.spans(model):
            rows = layout[row:row + len(attns)]
            row += len(attns)
            union = sorted(set().union(*map(set, rows)))
            if stack.position_bias:
                emb = getattr(attns[0], self.position_bias)
                held = list(getattr(emb, "headprune_heads", range(emb.embedding_dim)))
                if held != union:
                    index = torch.tensor([held.index(h) for h in union], dtype=torch.long, device=emb.weight.device)
                    old = emb.weight
                    new = nn.Parameter(old.detach().index_select(1, index), requires_grad=old.requires_grad)
                    emb.weight, emb.embedding_dim = new, len(union)
                    if sliced is not None:
                        sliced.append(Sliced(old, new, 1, index))
                emb.headprune_heads = union
            for attn, kept in zip(attns, rows):
                if isinstance(attn, StackHeadless):
                    continue
                _with_stack_bias(attn)
                attn.headprune_bias_heads = [union.index(h) for h in kept] if stack.position_bias else None


# -- T5's per-head relative position bias -------------------------------------------------------------
class _StackBias:
    """Mixed in before a T5-style attention class (`_with_stack_bias`): the position bias passed
    along the stack holds one map per head of `relative_attention_bias` (the stack's kept heads);
    this layer adds only its own heads' maps (`headprune_bias_heads`, positions among them) and hands
    the whole bias on. `headprune_bias_heads` None (cross-attention): the zero bias is made per layer."""

    headprune_bias_heads: list[int] | None = None

    def compute_bias(self, *args, **kwargs):
        full = super().compute_bias(*args, **kwargs)  # (1, stack heads, q, k)
        self._headprune_full_bias = full
        return full[:, self.headprune_bias_heads]  # (1, h, q, k)

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
        heads = self.headprune_bias_heads
        self._headprune_full_bias = position_bias if heads is not None else None
        if position_bias is not None:
            position_bias = position_bias[:, heads] if heads is not None else None  # (1, h, q, k)
        try:
            out, bias, weights = super().forward(hidden_states, mask=mask, key_value_states=key_value_states,
                                                 position_bias=position_bias, cache=cache, **kwargs)
            full = self._headprune_full_bias
        finally:
            self._headprune_full_bias = None
        return out, (full if full is not None else bias), weights


_BIAS_CLASSES: dict[type, type] = {}


def _with_stack_bias(attn: nn.Module) -> None:
    """Make `attn` an instance of its class with `_StackBias` mixed in (the class made once, module-level
    so that pickling and deepcopy find it)."""
    cls = type(attn)
    if issubclass(cls, _StackBias):
        return
    if cls not in _BIAS_CLASSES:
        name = f"StackBias{cls.__name__}"
        made = type(name, (_StackBias, cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = _BIAS_CLASSES[cls] = made
    attn.__class__ = _BIAS_CLASSES[cls]


def _bias_base(cls: type) -> type:
    """The attention class under `_StackBias` (whose compute_bias gives every held column)."""
    return next(c for c in cls.__mro__ if not issubclass(c, _StackBias))


class StackHeadless(HeadlessAttention):
    """A site of a stacked model with no heads left. A cross-attention site advances no cache (the
    decoder's self-attention at the same layer does). Where the model passes a position bias along
    the stack (T5: `returns_bias`), it returns that bias as the third output, computing it from the
    Embedding it holds when it is the stack's first layer, so the later layers still get theirs."""

    def __init__(self, core: nn.Module, out: str, head_dim: int, layer_idx: int | None, cross: bool,
                 returns_bias: bool):
        super().__init__(core, out, head_dim, layer_idx)
        self.cross, self.returns_bias = cross, returns_bias
        if returns_bias:
            base = _bias_base(type(core))
            self.compute_full_bias = base.compute_bias  # a plain function: called with self (below)
            self._relative_position_bucket = base._relative_position_bucket
            for name in ("is_decoder", "has_relative_attention_bias", "relative_attention_num_buckets",
                         "relative_attention_max_distance"):
                setattr(self, name, getattr(core, name))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if self.cross:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
        bias = kwargs.get("position_bias")
        if self.returns_bias and bias is None and not self.cross and self.has_relative_attention_bias:
            past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            tokens = hidden_states.shape[1]
            bias = self.compute_full_bias(self, tokens, past + tokens, device=hidden_states.device,
                                          past_seen_tokens=past)  # (1, stack heads, q, k)
        out, _ = super().forward(hidden_states, *args, **kwargs)
        return (out, bias, None) if self.returns_bias else (out, None)


# -- the named form ------------------------------------------------------------------------------------
def stacked(model: nn.Module) -> StackedAdapter | None:
    """The model's StackedAdapter, or None for a model with one attention stack."""
    adapter = get_adapter(model)
    return adapter if isinstance(adapter, StackedAdapter) else None


def stack_rows(model: nn.Module) -> dict[str, range]:
    """{stack name: its sites' rows}, in site order ({} for a model with one stack)."""
    adapter = stacked(model)
    if adapter is None:
        return {}
    out, row = {}, 0
    for stack, attns in adapter.spans(model):
        out[stack.name] = range(row, row + len(attns))
        row += len(attns)
    return out


def site_names(model: nn.Module) -> list[str]:
    """A name per row of the model's masks and scores: "encoder.0", ..., "cross.5" for several stacks,
    the layer ids "0", "1", ... for one."""
    spans = stack_rows(model)
    if not spans:
        return [str(i) for i in range(len(get_adapter(model).blocks(model)))]
    return [f"{name}.{layer}" for name, rows in spans.items() for layer in range(len(rows))]


def is_named(heads) -> bool:
    """True for a request naming stacks: a mapping with string keys, or (stack, layer, head) triples."""
    if isinstance(heads, Mapping):
        return any(isinstance(k, str) for k in heads)
    return False


def to_rows(model: nn.Module, heads):
    """A head request in rows: {stack: {layer: heads}}, {"stack.layer": heads} or (stack, layer, head)
    triples become {row: heads}; a request in rows ({layer: heads}, (layer, head) pairs) is returned
    as it is. Unknown stacks and layers out of a stack's range are errors naming the allowed ones."""
    return rows_request(stack_rows(model), heads)


def rows_request(spans: dict[str, range], heads):
    """`to_rows` given the model's `stack_rows` (what a HeadMask keeps of its model)."""
    if not isinstance(heads, Mapping):
        heads = list(heads)
        if not any(isinstance(item, (tuple, list)) and len(item) == 3 for item in heads):
            return heads
        nested: dict = {}
        for item in heads:
            if not isinstance(item, (tuple, list)) or len(item) != 3:
                raise ValueError(f"heads: {item!r} mixed with (stack, layer, head) triples; give every head as one")
            nested.setdefault(item[0], {}).setdefault(item[1], []).append(item[2])
        heads = nested
    if not is_named(heads):
        return heads
    if not spans:
        raise ValueError(f"heads names stacks {sorted(k for k in heads if isinstance(k, str))}, but this model has "
                         "one attention stack: name heads by layer ({layer: [heads]})")
    out: dict[int, list] = {}
    for key, value in heads.items():
        if not isinstance(key, str):
            raise ValueError(f"heads mixes stack names with the layer id {key!r}; allowed stacks: {list(spans)}")
        name, dot, layer = key.partition(".")
        if name not in spans:
            raise ValueError(f"heads names stack {name!r}; this model's stacks are {list(spans)}")
        if dot:
            per_layer = {layer: value}
        elif isinstance(value, Mapping):
            per_layer = value
        else:
            raise ValueError(f"heads[{key!r}]={value!r}: give {{layer: [heads]}} for a stack, or a site key "
                             f"such as '{key}.0'")
        for layer, ids in per_layer.items():
            try:
                index = int(layer)
            except (TypeError, ValueError):
                raise ValueError(f"heads[{key!r}]: layer {layer!r} is not an integer") from None
            rows = spans[name]
            if not 0 <= index < len(rows):
                raise ValueError(f"heads[{key!r}]: layer {index} is out of range: stack {name!r} has layers "
                                 f"0..{len(rows) - 1}")
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise ValueError(f"heads[{key!r}][{layer!r}]={ids!r} is not a list of head ids")
            out.setdefault(rows[index], []).extend(ids)
    return out


def by_stack(model: nn.Module, per_row: list) -> dict[str, list] | list:
    """Per-row values ([layer 0's, ...], a layout, heads per layer) split by stack:
    {stack: [its layers' values]}; unchanged for a model with one stack."""
    spans = stack_rows(model)
    if not spans:
        return per_row
    return {name: [per_row[r] for r in rows] for name, rows in spans.items()}


def named_heads(model: nn.Module, pairs: Iterable) -> dict[str, dict[int, list[int]]]:
    """(row, head) pairs (`HeadMask.pruned()`) as {stack: {layer: [heads]}} (stacks with none left out)."""
    spans = stack_rows(model)
    out: dict[str, dict[int, list[int]]] = {}
    for row, head in pairs:
        name, rows = next((n, r) for n, r in spans.items() if row in r)
        out.setdefault(name, {}).setdefault(row - rows.start, []).append(int(head))
    return out


def mask_sites(mask) -> list[str] | None:
    """The site names of a HeadMask's rows for a model with several stacks (heatmap labels), else None."""
    stacks = getattr(mask, "stacks", None) or {}
    return [f"{name}.{layer}" for name, rows in stacks.items() for layer in range(len(rows))] or None


def site_record(model: nn.Module, mask) -> dict:
    """What results.json adds for a model with several stacks: the site of each row of its
    (sites, heads) lists, and the pruned heads and kept counts by stack; {} for one stack."""
    if stacked(model) is None:
        return {}
    return {"sites": site_names(model), "pruned_by_stack": named_heads(model, mask.pruned()),
            "heads_per_stack": by_stack(model, mask.heads_per_layer())}


def refuse_several_stacks(model: nn.Module, metric: str, why: str, allowed: list[str]) -> None:
    """A metric that reads one sequence's tokens per layer (attention maps, contexts weighted by one
    attention mask) refuses a model with several stacks, whose sites see different sequences;
    `allowed`: the metrics that score every site (scoring.stacked_metrics(), from the registry)."""
    adapter = stacked(model)
    if adapter is not None:
        raise ValueError(f"metric.name={metric!r} {why}, which is not done for a model with several attention "
                         f"stacks ({adapter.name}: {', '.join(stack_rows(model))}); allowed for it: "
                         f"{', '.join(allowed)}")


def check_sites(model: nn.Module, saved: list[str] | None, where: str) -> None:
    """A layout file's `sites` (if it has them) must be the model's: else the rows mean other layers."""
    if saved is not None and list(saved) != site_names(model):
        raise ValueError(f"{where}: its sites {saved} are not this model's {site_names(model)}; the layout belongs "
                         "to another model")


# -- the encoder-decoder families ------------------------------------------------------------------------
# BART's layout: encoder self_attn, decoder self_attn, decoder encoder_attn; q/k/v/out_proj; the forward views
# K/V with the module's num_heads and reshapes the context with -1. Whisper's k_proj has no bias (nothing to
# slice there); the BART family checked by the coverage table shares it.
_BART_STACKS = (Stack("encoder", "encoder.layers", "self_attn", "encoder_attention_heads"),
                Stack("decoder", "decoder.layers", "self_attn", "decoder_attention_heads"),
                Stack("cross", "decoder.layers", "encoder_attn", "decoder_attention_heads", cross=True))
register_adapter(StackedAdapter(
    name="whisper", model_types=("whisper",), layers_path="", attn_path="", q="q_proj", k="k_proj", v="v_proj",
    o="out_proj", heads_attr="encoder_attention_heads", size_attrs=(("num_heads", "heads"),), stacks=_BART_STACKS,
))
register_adapter(StackedAdapter(
    name="bart", model_types=("bart", "mbart", "marian", "pegasus", "blenderbot", "blenderbot-small", "plbart"),
    layers_path="", attn_path="", q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    heads_attr="encoder_attention_heads", size_attrs=(("num_heads", "heads"),), stacks=_BART_STACKS,
))
# T5: every stack's layers hold [self-attention, (cross-attention,) feed-forward]; q/k/v/o without bias;
# the first self-attention layer of each stack owns the relative position bias of every layer. Switch
# Transformers is T5 with mixture-of-experts feed-forwards (outside the heads).
register_adapter(StackedAdapter(
    name="t5", model_types=("t5", "mt5", "switch_transformers"), layers_path="", attn_path="",
    q="q", k="k", v="v", o="o",
    heads_attr="num_heads", size_attrs=(("n_heads", "heads"), ("inner_dim", "width")),
    position_bias="relative_attention_bias",
    stacks=(Stack("encoder", "encoder.block", "layer.0.SelfAttention", "num_heads", position_bias=True),
            Stack("decoder", "decoder.block", "layer.0.SelfAttention", "num_heads", position_bias=True),
            Stack("cross", "decoder.block", "layer.1.EncDecAttention", "num_heads", cross=True)),
))
# UMT5: T5's layout, but every self-attention layer owns its relative position bias (an Embedding(num_buckets,
# heads) of its own, column h for head h) and computes it itself: each layer keeps its kept heads' columns.
register_adapter(StackedAdapter(
    name="umt5", model_types=("umt5",), layers_path="", attn_path="", q="q", k="k", v="v", o="o",
    heads_attr="num_heads", size_attrs=(("n_heads", "heads"), ("inner_dim", "width")),
    head_columns=("relative_attention_bias",),
    stacks=(Stack("encoder", "encoder.block", "layer.0.SelfAttention", "num_heads"),
            Stack("decoder", "decoder.block", "layer.0.SelfAttention", "num_heads"),
            Stack("cross", "decoder.block", "layer.1.EncDecAttention", "num_heads", cross=True)),
))
