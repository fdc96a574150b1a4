"""The config variants of a model type that reach its attention, for the coverage table
(tools/coverage.py): the table checks each type on its tiny default config, and a type whose
attention changes with a config flag is checked again in each such form.

Which fields reach the attention: the fields the attention module's class (and the core's, and their
transformers base classes) reads from its config, found in their source (`config.<field>`,
`getattr(config, "<field>")`), and the fields with which each block builds its attention modules
(`block_fields`: the arguments of the attention class's constructor in the block's `__init__` and
the `if` tests around it; BERT's layer reads `add_cross_attention` and passes `is_cross_attention`).
Of those:

- every boolean is flipped (per-head q/k norms `use_qk_norm` / `qk_layernorm`, attention and output
  biases `attention_bias` / `qkv_bias` / `attention_out_bias` / `use_bias`, `use_sliding_window`,
  `rope_interleave`, GPT-2's scaling flags, ...);
- an enum (string) field takes each other value `ENUMS` lists for it;
- `head_dim` is doubled (a head_dim apart from hidden / heads);
- `attn_logit_softcapping` is switched on (5.0) or off;
- `layer_types` alternates sliding and full attention layers (where the config has `sliding_window`
  and its layers are only those two kinds), and a `sliding_window` without `layer_types` is switched
  off or on (4 tokens: the checks' 9-token inputs reach past it);
- partial rotary (`rope_parameters["partial_rotary_factor"]`) is set to 0.5, or to 1.0 where the
  default is partial, for families whose config or modeling module names it.

A field that reaches the attention and is not varied is returned with the reason (`NOT_VARIED`, or
"a string field without alternatives in ENUMS"): the table records it, so nothing is skipped silently.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap

from torch import nn

REFERENCE = re.compile(r"config\.(\w+)|getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']")
SLIDING, FULL = "sliding_attention", "full_attention"
ENUMS: dict[str, tuple[str, ...]] = {  # string fields that reach an attention module: the values to check
    "position_embedding_type": ("absolute", "relative_key", "relative_key_query"),
}
NOT_VARIED = {  # field -> why a variant of it is not checked
    "add_cross_attention": "adds cross-attention fed by encoder states, which a causal or masked LM's checks "
                           "do not give",
    "deterministic_flash_attn": "read by flash attention only, which the checks do not run",
}
SOFTCAP = 5.0


def attention_source(model: nn.Module, adapter) -> str:
    """The source of every attention class of `model` (the adapter's attention module and its core in
    each block, and their transformers base classes)."""
    classes = set()
    for block in adapter.blocks(model):
        attn = adapter.attention(block)
        classes.update({type(attn), type(attn.get_submodule(adapter.core) if adapter.core else attn)})
    texts = []
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        for base in inspect.getmro(cls):
            if base.__module__.startswith("transformers."):
                try:
                    texts.append(inspect.getsource(base))
                except (OSError, TypeError):
                    continue
    return "\n".join(texts)


def _config_field(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The config field `node` reads: `config.<field>`, or `self.<name>` set from one earlier."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id == "config":
            return node.attr
        if node.value.id == "self":
            return aliases.get(node.attr)
    return None


def _fields_in(node: ast.AST, aliases: dict[str, str]) -> set[str]:
    return {f for n in ast.walk(node) if (f := _config_field(n, aliases))}


def block_fields(model: nn.Module, adapter) -> set[str]:
    """The config fields with which a block builds its attention modules: those passed to an
    attention class's constructor in the block's `__init__`, and those of the `if` tests that decide
    whether one is built (BERT's `add_cross_attention` adds a second attention module; transformers
    5.25's attention classes no longer read it, they are told `is_cross_attention` by the layer)."""
    names = set()
    blocks = list(adapter.blocks(model))
    for block in blocks:
        attn = adapter.attention(block)
        names.update(base.__name__ for base in inspect.getmro(type(attn)) if base.__module__.startswith("transformers."))
    fields: set[str] = set()
    for cls in {type(block) for block in blocks}:
        for base in inspect.getmro(cls):
            init = base.__dict__.get("__init__")
            if init is None or not base.__module__.startswith("transformers."):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
            except (OSError, TypeError, SyntaxError):
                continue
            aliases = {t.attr: f for n in ast.walk(tree) if isinstance(n, ast.Assign)
                       for t in n.targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                       and t.value.id == "self" and (f := _config_field(n.value, {}))}

            def visit(node: ast.AST, tests: tuple[ast.AST, ...]) -> None:
                if isinstance(node, ast.Call):
                    func = node.func
                    callee = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                    if callee in names:
                        fields.update(_fields_in(ast.Tuple([*node.args, *(k.value for k in node.keywords)]),
                                                 aliases))
                        for test in tests:
                            fields.update(_fields_in(test, aliases))
                inner = (*tests, node.test) if isinstance(node, ast.If) else tests
                for child in ast.iter_child_nodes(node):
                    visit(child, inner)

            visit(tree, ())
    return fields


def attention_fields(model: nn.Module, adapter) -> set[str]:
    """The config fields the attention classes of `model` read, and those with which its blocks
    build them (`block_fields`)."""
    return {a or b for a, b in REFERENCE.findall(attention_source(model, adapter))} | block_fields(model, adapter)


def _names_partial_rotary(model: nn.Module, config) -> bool:
    """True when the family's config or modeling module names `partial_rotary_factor` (a family whose
    attention rotates part of each head; elsewhere a partial factor only breaks the rotary shapes)."""
    for obj in (type(config), type(model)):
        module = sys.modules.get(obj.__module__)
        try:
            if module is not None and "partial_rotary_factor" in inspect.getsource(module):
                return True
        except (OSError, TypeError):
            continue
    return False


def config_variants(model: nn.Module, adapter) -> tuple[dict[str, dict], dict[str, str]]:
    """({variant name: the fields it sets on the config the heads read}, {field: why it is not varied})
    for the tiny default `model` and its adapter. The fields are those of `adapter.config_of(config)`
    (a composite's text sub-config)."""
    config = adapter.config_of(model.config)
    fields = {f.name for f in dataclasses.fields(type(config))} if dataclasses.is_dataclass(type(config)) else set()
    read = attention_fields(model, adapter)
    variants: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for name in sorted(read):
        value = getattr(config, name, None)
        if name.startswith("_") or name not in fields:  # private (_attn_implementation: the checks run both)
            continue
        if name in NOT_VARIED:
            skipped[name] = NOT_VARIED[name]
        elif isinstance(value, bool):
            variants[f"{name}={not value}"] = {name: not value}
        elif isinstance(value, str):
            if name in ENUMS:
                variants.update({f"{name}={v}": {name: v} for v in ENUMS[name] if v != value})
            else:
                skipped[name] = f"a string field ({value!r}) without alternatives in ENUMS"
    heads = adapter.num_heads(config)
    hidden = getattr(config, "hidden_size", None)
    if "head_dim" in read and hidden:  # a field, or read with getattr and a default (Cohere): a checkpoint may set it
        now = getattr(config, "head_dim", None) or hidden // heads
        double = 2 * now if 2 * now != hidden // heads else 4 * now
        variants[f"head_dim={double}"] = {"head_dim": double}  # apart from hidden / heads
    if "attn_logit_softcapping" in read and "attn_logit_softcapping" in fields:
        on = config.attn_logit_softcapping is None
        variants[f"attn_logit_softcapping={SOFTCAP if on else None}"] = {"attn_logit_softcapping":
                                                                          SOFTCAP if on else None}
    layer_types = getattr(config, "layer_types", None)
    if "layer_types" in fields and "sliding_window" in fields and layer_types \
            and set(layer_types) <= {SLIDING, FULL}:
        mixed = [SLIDING if i % 2 == 0 else FULL for i in range(len(layer_types))]
        if list(layer_types) == mixed:
            mixed = [FULL] * len(layer_types)
        name = "layer_types=" + ",".join("sliding" if t == SLIDING else "full" for t in mixed)
        fields_set = {"layer_types": mixed, "sliding_window": config.sliding_window or 4}
        if "use_sliding_window" in fields:  # Qwen2 / Qwen3: no window at all unless it is set
            fields_set["use_sliding_window"] = True
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict) and FULL in rope and SLIDING not in rope:  # rotary parameters by layer type
            fields_set["rope_parameters"] = {**rope, SLIDING: rope[FULL]}
        variants[name] = fields_set
    elif "sliding_window" in read and "sliding_window" in fields and "layer_types" not in fields:
        window = None if config.sliding_window else 4
        variants[f"sliding_window={window}"] = {"sliding_window": window}
        if window and "use_sliding_window" in fields:  # Qwen3-MoE: no window at all unless it is set
            variants[f"sliding_window={window}"]["use_sliding_window"] = True
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_type" in rope and _names_partial_rotary(model, config):
        factor = 0.5 if rope.get("partial_rotary_factor", 1.0) == 1.0 else 1.0
        variants[f"partial_rotary_factor={factor}"] = {"rope_parameters": {**rope, "partial_rotary_factor": factor}}
    return variants, skipped


def applied(config, fields: dict) -> str:
    """'' when every field of a variant reads back from the built `config` as set, else which does
    not (a config class that recomputes it: the variant is then not what the table would claim)."""
    for name, want in fields.items():
        got = getattr(config, name, None)
        if name == "rope_parameters" and isinstance(got, dict) and "partial_rotary_factor" in want:
            got, want = got.get("partial_rotary_factor", 1.0), want["partial_rotary_factor"]
        if isinstance(got, tuple):
            got = list(got)
        if got != want:
            return f"the config class turns {name}={want!r} into {got!r}"
    return ""
