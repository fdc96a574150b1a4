"""Which transformers model types headprune prunes exactly: the coverage table, generated from
transformers itself.

For every model type in transformers' auto mappings (causal LM, masked LM, sequence
classification, image classification, seq2seq LM, speech seq2seq), `tiny_config` builds the
config class with small sizes (no download), and `check_model_type` records one of

- ``passes``: head masks equal physical removal (uneven heads, a layer left without heads, a whole
  KV group) under eager attention, and under sdpa where transformers offers it, to 1e-5 of the
  outputs' scale (their largest magnitude, at least 1: float32 rounding grows with it); the
  pruned model saved with `save_pruned` reloads with `load_pruned` to the same outputs; a uniform
  layout of whole KV groups reloads with plain `from_pretrained` where the family's config can say
  it; greedy `generate()` with the KV cache gives the masked model's tokens (causal LMs);
- ``refused``: headprune has no adapter for the model type (the reason says what is missing);
- ``fails``: one of those checks went wrong (the reason says which);
- ``not built``: the tiny model could not be built from its config class here, or the checks'
  inputs do not run it unpruned (not a judgement on headprune).

A type that passes is checked again in each config variant that reaches its attention
(tools/config_variants.py: per-head q/k norms, attention and output biases, partial rotary, logit
soft-capping, sliding-window layers and `layer_types`, a `head_dim` apart from hidden / heads, and
every other boolean its attention classes read from the config): `check_variants`, one entry per
variant in the row's "variants", with the same statuses.

A composite config (vision- or audio-language) is built with its sub-configs (`text_config`,
`vision_config`, `attn_config`, ...) shrunk too; where the causal-LM class is the text model
alone (Qwen3.5, Llama 4), from that text config.

Run it (31 min 51 s with the variants at 6a294fb, nice, on this project's two shared cores at load 6-12) and render the Markdown table from its JSON:

    python -m tools.coverage --out docs/coverage.json --markdown docs/coverage.md

`--only TYPE ...` checks some types (with `--update docs/coverage.json`: their rows replaced in the
committed table, the others kept); `--probe` also tries the Llama layout (`LLAMA_LAYOUT_TYPES`)
on unregistered types whose attention has q_proj / k_proj / v_proj / o_proj, to find the ones
that can join that list.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

MAPPINGS = {  # name in the table -> transformers' mapping
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech_seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}
STATUSES = ("passes", "refused", "fails", "not built")
ATOL = 1e-5
MAX_PARAMS = 20_000_000  # a "tiny" config still this big is not built (its sizes are not the ones we set)
VOCAB, TOKENS, BATCH = 128, 9, 2

# Small sizes, by the config fields' usual names (a field the config class lacks is not passed).
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_hidden_layers": 3, "intermediate_size": 64, "max_position_embeddings": 128,
    "d_model": 64, "d_ff": 64, "d_kv": 16, "num_heads": 4, "num_layers": 3, "num_decoder_layers": 3,
    "encoder_layers": 3, "decoder_layers": 3, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "ffn_dim": 64, "n_inner": 64, "embed_dim": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "image_size": 32, "patch_size": 8, "num_channels": 3, "num_labels": 2,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
    "sliding_window": 4, "num_mel_bins": 16, "max_source_positions": 16, "max_target_positions": 32,
    "rotary_dim": 8, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
}
# What one config class needs besides SIZES to be built with three layers.
_LATENT = {"num_key_value_heads": 4}  # MLA: every head expands its own keys and values from the latent
_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "num_hidden_layers": 4}  # hybrids: small linear-attention mixers
_HYBRID_LAYERS = ["full_attention", "linear_attention", "full_attention", "full_attention"]
OVERRIDES = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1], [["global"], 1]]},
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "minicpm3",
                     "sarvam_mla", "youtu"), _LATENT),
    "axk1": {**_LATENT, "n_group": 1, "topk_group": 1},  # its router groups the (4) routed experts
    "deepseek_v3": {**_LATENT, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},  # MoE from layer 1
    # hybrids: three attention layers (the checks' three cases) around a linear-attention / state-space one
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid"),
                    {**_LINEAR, "layer_types": _HYBRID_LAYERS}),
    "granitemoehybrid": {"num_hidden_layers": 4, "layer_types": ["attention", "mamba", "attention", "attention"],
                         "mamba_n_heads": 4, "mamba_d_state": 16, "mamba_chunk_size": 8},
}

# T5's config class has no decoder_start_token_id field (its checkpoints' config.json say 0, the pad id)
OVERRIDES["t5"] = {"decoder_start_token_id": 0}
# DeBERTa's config classes default to absolute positions only: check the disentangled attention its
# checkpoints use (deberta-v3-base: p2c|c2p through the shared query/key projections, log buckets,
# normed relative embeddings; deberta-base: c2p|p2c through pos_proj / pos_q_proj)
OVERRIDES["deberta-v2"] = {"relative_attention": True, "pos_att_type": ["p2c", "c2p"], "share_att_key": True,
                           "position_buckets": 16, "norm_rel_ebd": "layer_norm", "position_biased_input": False}
OVERRIDES["deberta"] = {"relative_attention": True, "pos_att_type": ["c2p", "p2c"], "position_biased_input": False}
# Defaults of transformers 5.24 that do not build a model as they stand: Cohere Compass's rope_parameters
# empty (its rotary reads them by layer type), LFM2-MoE's layer_types None (its layers index them),
# DBRX's attention reading attn_config.rope_theta, which the config class does not declare; BLT's
# hash embeddings (encoder_hash_byte_group_vocab, 500002 rows per hash) are not a size SIZES names.
OVERRIDES["cohere_compass_text"] = {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 10000.0}}}
OVERRIDES["lfm2_moe"] = {"layer_types": ["full_attention", "conv", "full_attention"]}
OVERRIDES["dbrx"] = {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0}}
OVERRIDES["blt"] = {"encoder_hash_byte_group_vocab": 64}
# Config validators that SIZES alone does not satisfy: ZAYA routes to one expert, Mamba-2's heads x head_dim
# equal hidden_size x expand, Zamba2 lists a layer type per layer, Reformer's LM head is a decoder whose
# axial position embeddings sum to hidden_size.
OVERRIDES["zaya"] = {"num_experts_per_tok": 1}
OVERRIDES["mamba2"] = {"head_dim": 32}
OVERRIDES["zamba2"] = {"layer_types": ["mamba", "hybrid", "mamba"]}
OVERRIDES["reformer"] = {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 16]}
OVERRIDES["beit"] = OVERRIDES["data2vec-vision"] = {"use_relative_position_bias": True}  # a bias table per layer


# -- tiny configs ------------------------------------------------------------------------------------
def tiny_config(model_type: str, config_class=None, variant: dict | None = None):
    """The config class of `model_type` (or `config_class`: the text config a composite's causal-LM
    class is built from) with the small `SIZES` it has fields for, nested sub-configs (`text_config`,
    `vision_config`, `attn_config`, ...) shrunk the same way, `OVERRIDES` by model type, and last
    `variant`'s fields (a config variant, tools/config_variants.py; a dict under a sub-config's name
    sets that sub-config's fields)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = config_class or CONFIG_MAPPING[model_type]
    kwargs = {**_tiny_kwargs(cls), **OVERRIDES.get(cls.model_type or model_type, {}), **OVERRIDES.get(model_type, {})}
    for name, value in (variant or {}).items():
        nested = isinstance(value, dict) and isinstance(kwargs.get(name), dict) and name in (getattr(cls, "sub_configs", None) or {})
        kwargs[name] = {**kwargs[name], **value} if nested else value
    return cls(**kwargs)


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def _tiny_kwargs(cls) -> dict:
    """Keyword arguments that shrink config class `cls`: `SIZES` by field name (or the attribute map's
    alias), and each sub-config as a nested dict of its own. A sub-config declared as `AutoConfig`
    (Fuyu's, Gemma 3's vision tower) is shrunk as the class the composite's defaults build, its
    `model_type` named so the composite builds that class again."""
    fields = _fields(cls)
    names = {**{k: k for k in fields}, **{k: v for k, v in getattr(cls, "attribute_map", {}).items() if v in fields}}
    kwargs = {names[k]: v for k, v in SIZES.items() if k in names}
    default = None
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if name not in fields:
            continue
        if isinstance(sub, type) and _fields(sub):
            kwargs[name] = {**_tiny_kwargs(sub), **OVERRIDES.get(sub.model_type, {})}
            continue
        if default is None:
            default = cls()  # the composite's default sub-configs say which classes an AutoConfig field builds
        built = getattr(default, name, None)
        if built is not None and _fields(type(built)) and getattr(built, "model_type", ""):
            sub = type(built)
            kwargs[name] = {"model_type": sub.model_type, **_tiny_kwargs(sub), **OVERRIDES.get(sub.model_type, {})}
    return kwargs


def model_types() -> dict[str, list[str]]:
    """{model type: the mappings (`MAPPINGS` names) it appears in, in `MAPPINGS` order}."""
    from transformers.models.auto import modeling_auto

    out: dict[str, list[str]] = {}
    for mapping, attr in MAPPINGS.items():
        for model_type in getattr(modeling_auto, attr):
            out.setdefault(model_type, []).append(mapping)
    return dict(sorted(out.items()))


# -- the checks ----------------------------------------------------------------------------------------
class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def stop(signum, frame):
        raise _Timeout(f"took over {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _inputs(model: nn.Module, task: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    config = model.config
    if task == "image_classification" and "spatial_shapes" in inspect.signature(model.forward).parameters:
        # SigLIP 2 (NaFlex): flattened patches (B, 16, C x P x P), a 4 x 4 grid, the first image 3 x 4 (4 padded)
        vision = getattr(config, "vision_config", config)
        features = vision.num_channels * vision.patch_size ** 2
        mask = torch.ones(BATCH, 16, dtype=torch.long)
        mask[0, 12:] = 0
        return {"pixel_values": torch.randn(BATCH, 16, features, generator=g), "pixel_attention_mask": mask,
                "spatial_shapes": torch.tensor([[3, 4]] + [[4, 4]] * (BATCH - 1))}
    if task == "image_classification":
        size, channels = getattr(config, "image_size", 32), getattr(config, "num_channels", 3)
        size = size if isinstance(size, int) else size[0]
        return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=g)}
    if task == "speech_seq2seq" and hasattr(config, "num_mel_bins"):  # Whisper: (B, mel bins, 2 x source positions)
        features = torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions, generator=g)
        decoder = torch.randint(3, min(config.vocab_size, VOCAB), (BATCH, 4), generator=g)
        return {"input_features": features, "decoder_input_ids": decoder}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # composites: sizes there
    vocab = getattr(config, "vocab_size", None) or getattr(text, "vocab_size", None) or VOCAB
    ids = torch.randint(3, min(vocab, VOCAB), (BATCH, TOKENS), generator=g)  # (B, T)
    mask = torch.ones_like(ids)
    if task in ("causal_lm", "sequence_classification"):
        mask[0, :2] = 0  # left padding for one row
    batch = {"input_ids": ids, "attention_mask": mask}
    if task in ("seq2seq_lm", "speech_seq2seq"):
        batch["decoder_input_ids"] = ids[:, :4]
    return batch


@torch.no_grad()
def _outputs(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


def _compare(got: torch.Tensor, want: torch.Tensor, atol: float) -> str:
    """'' when equal to `atol` times the outputs' scale (the largest |want|, at least 1; NaN where
    the other is NaN: fully padded positions of some eager kernels), else what differs. Why the
    scale: the same sums in another order differ by a few float32 ulps of the values' size (mT5's
    logits up to 45 under transformers 5.25's initialisation: 1.1e-5 apart, 3 ulps)."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_got, nan_want):
        return "NaN at different positions"
    if nan_got.all():
        return "every output is NaN"
    diff = (got - want).abs()[~nan_got].max().item()
    allowed = atol * max(1.0, want[~nan_want].abs().max().item())
    return "" if diff <= allowed else f"max |diff| {diff:.2e} > {allowed:.2e} ({atol:g} x the outputs' scale)"


def prune_spec(model: nn.Module) -> dict[int, list[int]]:
    """The request every check removes: layer 0 loses every head, layer 1 one head (under GQA a
    partly kept KV group), the last layer its last KV group whole (three layers at least; with
    fewer, the first of these that fit). A model with several attention stacks (heads.stacks) gets
    that in every stack (encoder, decoder, cross)."""
    from headprune.heads.stacks import stack_rows
    from headprune.heads.surgery import kv_group_heads

    groups = kv_group_heads(model)
    all_heads = [h for g in groups for h in g]
    spec = {}
    for rows in (stack_rows(model).values() or [range(len(_layers(model)))]):
        n_layers = len(rows)
        one = {0: all_heads, 1: [all_heads[1] if len(all_heads) > 1 else all_heads[0]], n_layers - 1: groups[-1]}
        spec.update({rows[layer]: heads for layer, heads in one.items() if layer < n_layers})
    return spec


def _layers(model: nn.Module) -> list:
    from headprune.heads.adapters import get_adapter

    return get_adapter(model).blocks(model)


def _pairs(spec: dict) -> list[tuple[int, int]]:
    return [(layer, h) for layer, heads in spec.items() for h in heads]


def check_model(build, task: str, attn_implementations=("eager", "sdpa"), tmp: Path | None = None) -> dict:
    """Run every check on the models `build(attn_implementation)` returns (same weights each call,
    eval mode). Returns {"status", "reason", "adapter", "checks": {name: result}}: each result is
    "passes", "fails: ...", or why it does not apply. The first failure ends the checks."""
    from headprune.deploy.hf import load_pruned, save_pruned
    from headprune.heads.adapters import get_adapter
    from headprune.heads.mask import HeadMask
    from headprune.heads.surgery import kv_group_heads, prune_heads

    checks: dict[str, str] = {}
    result = {"status": "passes", "reason": "", "adapter": None, "checks": checks}

    def fail(name: str, why: str) -> dict:
        checks[name] = f"fails: {why}"
        result.update(status="fails", reason=f"{name}: {why}")
        return result

    model = build("eager")
    try:
        adapter = get_adapter(model)
    except NotImplementedError as err:
        result.update(status="refused", reason=str(err).split(" Supported model types:")[0])
        return result
    result["adapter"] = adapter.name
    spec = prune_spec(model)
    generates = task in ("causal_lm", "seq2seq_lm", "speech_seq2seq") and hasattr(model, "generate")
    batch = _inputs(model, task)
    try:  # the unpruned model on the checks' inputs (ShieldGemma 2 wants image tokens in input_ids beside its pixels)
        _outputs(model, batch)
    except Exception as err:  # noqa: BLE001 - recorded in the table
        result.update(status="not built", reason="the coverage's inputs do not run the unpruned model: "
                      f"{type(err).__name__}: {err}".splitlines()[0][:200])
        return result
    pruned_eager = None
    for attn in attn_implementations:
        try:
            model = build(attn) if attn != "eager" or pruned_eager is not None else model
        except (ValueError, ImportError) as err:
            checks[attn] = f"not offered by transformers ({str(err).splitlines()[0][:80]})"
            continue
        masked = copy.deepcopy(model)
        HeadMask.for_model(masked).prune(_pairs(spec))
        try:
            prune_heads(model, spec)
            why = _compare(_outputs(model, batch), _outputs(masked, batch), ATOL)
        except Exception as err:  # noqa: BLE001 - recorded in the table
            return fail(attn, f"{type(err).__name__}: {err}".splitlines()[0][:200])
        if why:
            return fail(attn, f"removal != mask ({why})")
        checks[attn] = "passes"
        if generates:
            try:
                kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
                small = {k: v for k, v in batch.items() if k != "decoder_input_ids"}
                same = torch.equal(model.generate(**small, **kwargs), masked.generate(**small, **kwargs))
            except Exception as err:  # noqa: BLE001
                return fail(f"generate ({attn})", f"{type(err).__name__}: {err}".splitlines()[0][:200])
            if not same:
                return fail(f"generate ({attn})", "tokens differ from the masked model's")
            checks[f"generate ({attn})"] = "passes"
        if attn == "eager":
            pruned_eager = model
    if pruned_eager is None:
        return fail("eager", "no attention implementation could be built")

    with tempfile.TemporaryDirectory(dir=tmp) as folder:
        try:
            save_pruned(pruned_eager, Path(folder) / "uneven")
            loaded = load_pruned(Path(folder) / "uneven", attn_implementation="eager").eval()
            why = _compare(_outputs(loaded, batch), _outputs(pruned_eager, batch), 1e-6)
        except Exception as err:  # noqa: BLE001
            return fail("reload", f"{type(err).__name__}: {err}".splitlines()[0][:200])
        if why:
            return fail("reload", why)
        checks["reload"] = "passes"

        uniform = build("eager")
        groups = kv_group_heads(uniform)
        if len(groups) < 2:
            checks["plain"] = "one KV group: no uniform layout keeps heads"
            return result
        prune_heads(uniform, {layer: groups[-1] for layer in range(len(adapter.blocks(uniform)))})
        try:
            saved = save_pruned(uniform, Path(folder) / "uniform")
            if not saved.plain_hf:
                checks["plain"] = f"layout file ({saved.why})"
                return result
            plain = type(uniform).from_pretrained(Path(folder) / "uniform", attn_implementation="eager").eval()
            why = _compare(_outputs(plain, batch), _outputs(uniform, batch), 1e-6)
        except Exception as err:  # noqa: BLE001
            return fail("plain", f"{type(err).__name__}: {err}".splitlines()[0][:200])
        if why:
            return fail("plain", why)
        checks["plain"] = "passes"
    return result


def _builder(model_type: str, task: str, variant: dict | None = None):
    """build(attn) for the tiny `model_type` under `task`'s auto class (its config with `variant`'s
    fields, `tiny_config`), the same weights each call; or raises (not built)."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from transformers.models.auto import modeling_auto

    name = getattr(modeling_auto, MAPPINGS[task])[model_type]
    cls = getattr(transformers, name if isinstance(name, str) else name[0])  # DeiT names two: the first
    # A composite (vision-language, audio) whose causal-LM class is its text model alone (Qwen3.5's,
    # Llama 4's, MusicGen's decoder) is built from that class's own config: the sub-config it runs.
    # (A class shared under another config, exaone's LlamaForCausalLM, is still built from the type's own.)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    own = getattr(cls, "config_class", None)
    subs = (getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {}).values()
    config = tiny_config(model_type, own if own is not None and any(own is sub for sub in subs) else None, variant)
    with torch.device("meta"):
        meta = cls._from_config(config)
    n = sum(p.numel() for p in meta.parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {n / 1e6:.0f}M parameters (sizes not shrunk)")

    def build(attn: str):
        torch.manual_seed(0)
        return cls._from_config(copy.deepcopy(config), attn_implementation=attn).eval()

    build("eager")
    return build


def check_model_type(model_type: str, mappings: list[str], probe: bool = False, timeout: int = 120,
                     variants: bool = True) -> dict:
    """One row of the table: {"model_type", "mappings", "task", "status", "reason", "adapter",
    "checks", "seconds"}, and for a type that passes on its default config (with `variants`) its
    config variants checked the same way (`check_variants`: "variants", "not_varied")."""
    from headprune.heads import adapters

    task = mappings[0]
    adapter = adapters.ADAPTERS.get(model_type)
    if adapter is not None and getattr(adapter, "stacks", ()):  # several stacks: checked whole, as a seq2seq model
        task = next((m for m in mappings if m.endswith("seq2seq") or m.startswith("seq2seq")), task)
    row = {"model_type": model_type, "mappings": mappings, "task": task}
    start = time.perf_counter()
    probed = False
    try:
        try:
            with _time_limit(timeout):
                try:
                    build = _builder(model_type, task)
                except _Timeout:
                    raise
                except Exception as err:  # noqa: BLE001 - recorded in the table
                    row.update(status="not built", reason=f"{type(err).__name__}: {err}".splitlines()[0][:200],
                               adapter=None, checks={})
                    return row
                built_type = build("eager").config.model_type if probe else model_type  # llama4 builds llama4_text
                if probe and built_type not in adapters.ADAPTERS and _looks_like_llama(build("eager")):
                    adapters.ADAPTERS[built_type] = adapters.ADAPTERS["llama"]
                    probed = True
                try:
                    row.update(check_model(build, task))
                except _Timeout:
                    raise
                except Exception as err:  # noqa: BLE001 - a check that crashed: recorded in the table
                    row.update(status="fails", reason=f"{type(err).__name__}: {err}".splitlines()[0][:200],
                               adapter=row.get("adapter"), checks=row.get("checks", {}))
        except _Timeout as err:
            row.update(status="fails", reason=f"timeout: {err}", adapter=row.get("adapter"), checks=row.get("checks", {}))
        if variants and row["status"] == "passes":
            row.update(check_variants(model_type, task, build("eager"), timeout))
    finally:
        if probed:
            del adapters.ADAPTERS[built_type]
        row["seconds"] = round(time.perf_counter() - start, 2)
    if probed:
        row["probed"] = "llama"
    return row


def check_variants(model_type: str, task: str, model: nn.Module, timeout: int = 120) -> dict:
    """{"variants": [one entry per config variant of `model` (the tiny default, which passed) that
    reaches its attention: {"variant", "fields", "status", "reason", "checks"}, checked as the default
    by `check_model`], "not_varied": {field: why}} (tools/config_variants.py). A variant whose config
    cannot be built, or whose unpruned model the inputs do not run, or whose config class does not
    keep the fields set, is "not built"."""
    from headprune.heads.adapters import get_adapter
    from tools.config_variants import applied, config_variants

    adapter = get_adapter(model)
    found, skipped = config_variants(model, adapter)
    out = []
    for name, fields in found.items():
        entry = {"variant": name, "fields": fields, "status": "passes", "reason": "", "checks": {}}
        variant = {adapter.sub_config: fields} if adapter.sub_config else fields
        try:
            with _time_limit(timeout):
                try:
                    build = _builder(model_type, task, variant)
                    why = applied(adapter.config_of(build("eager").config), fields)
                except _Timeout:
                    raise
                except Exception as err:  # noqa: BLE001 - recorded in the table
                    why = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                if why:
                    entry.update(status="not built", reason=why)
                else:
                    result = check_model(build, task)
                    entry.update(status=result["status"], reason=result["reason"], checks=result["checks"])
        except _Timeout as err:
            entry.update(status="fails", reason=f"timeout: {err}")
        except Exception as err:  # noqa: BLE001 - a check that crashed: recorded in the table
            entry.update(status="fails", reason=f"{type(err).__name__}: {err}".splitlines()[0][:200])
        out.append(entry)
    return {"variants": out, "not_varied": skipped}


def _looks_like_llama(model: nn.Module) -> bool:
    layers = getattr(model.base_model, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers is not None and len(layers) else None
    return attn is not None and all(isinstance(getattr(attn, p, None), nn.Linear)
                                    for p in ("q_proj", "k_proj", "v_proj", "o_proj"))


def run(only: list[str] | None = None, probe: bool = False, timeout: int = 120, log=None) -> dict:
    """The coverage document: transformers' version, when, and one row per model type."""
    import transformers

    types = model_types()
    if only:
        unknown = sorted(set(only) - set(types))
        if unknown:
            raise ValueError(f"not in transformers' mappings: {unknown}")
        types = {t: types[t] for t in only}
    rows = []
    for model_type, mappings in types.items():
        row = check_model_type(model_type, mappings, probe=probe, timeout=timeout)
        rows.append(row)
        if log:
            bad = [f"{v['variant']}: {v['status']}" for v in row.get("variants", []) if v["status"] != "passes"]
            log(f"{model_type:32s} {row['status']:10s} {row['seconds']:6.1f}s variants {_variants_cell(row):5s} "
                f"{row['reason'][:100]} {'; '.join(bad)}")
    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__.split("+")[0],
            "mappings": {name: attr for name, attr in MAPPINGS.items()}, "atol": ATOL, "rows": rows}


def updated(old: dict, new: dict) -> dict:
    """`old` with the rows of `new` in place of its rows of the same model types (`--update`); both
    from the same transformers and torch versions, else a ValueError (the table says one version)."""
    for key in ("transformers_version", "torch_version", "atol"):
        if old.get(key) != new.get(key):
            raise ValueError(f"--update: the table's {key} is {old.get(key)!r}, this run's {new.get(key)!r}; "
                             "regenerate the whole table")
    rows = {r["model_type"]: r for r in old["rows"]} | {r["model_type"]: r for r in new["rows"]}
    return {**old, "rows": [rows[t] for t in sorted(rows)]}


# -- the Markdown table ------------------------------------------------------------------------------
CHECK_COLUMNS = ("eager", "sdpa", "generate (eager)", "generate (sdpa)", "reload", "plain")


def _cell(value: str | None) -> str:
    if value is None:
        return ""
    if value == "passes":
        return "yes"
    if value.startswith("fails"):
        return "**no**"
    if value.startswith("not offered"):
        return "n/a"
    if value.startswith("layout file"):
        return "layout file"
    return "–"


def counts(doc: dict, mapping: str | None = None) -> dict[str, int]:
    rows = [r for r in doc["rows"] if mapping is None or r["task"] == mapping]
    return {status: sum(r["status"] == status for r in rows) for status in STATUSES}


def variant_counts(doc: dict) -> dict[str, int]:
    """{status: how many config variants have it} over every row (only passing types are varied)."""
    found = [v["status"] for r in doc["rows"] for v in r.get("variants", [])]
    return {status: found.count(status) for status in STATUSES if status != "refused"}


def _variants_cell(row: dict) -> str:
    found = row.get("variants", [])
    return f"{sum(v['status'] == 'passes' for v in found)}/{len(found)}" if found else "–"


def _escaped(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _variant_lines(doc: dict) -> list[str]:
    """The section of the config variants: one row per type x variant, then the fields that reach an
    attention module and are not varied, with why."""
    rows = [(r, v) for r in doc["rows"] for v in r.get("variants", [])]
    c = variant_counts(doc)
    lines = [f"## Config variants ({len(rows)})", "",
             "Each passing type is checked again in each config variant that reaches its attention "
             "(`tools/config_variants.py`: the fields its attention classes read from the config; each boolean "
             "flipped, each enum's other values, `head_dim` doubled, soft-capping on or off, layers alternating "
             "sliding and full attention or the sliding window on or off, partial rotary on or off), with every "
             f"check of the default: {c['passes']} pass, {c['fails']} fail, {c['not built']} not built. A variant is "
             "`not built` when its config cannot be built, the config class does not keep the value set, or the "
             "checks' inputs do not run its unpruned model (the note says which).", "",
             "| model type | variant | " + " | ".join(CHECK_COLUMNS) + " | note |",
             "|---|---|" + "---|" * len(CHECK_COLUMNS) + "---|"]
    for r, v in rows:
        cells = [_cell(v["checks"].get(name)) for name in CHECK_COLUMNS]
        note = "" if v["status"] == "passes" else f"{v['status']}: {_escaped(v['reason'])}"
        lines.append(f"| {r['model_type']} | `{v['variant']}` | " + " | ".join(cells) + f" | {note} |")
    skipped: dict[tuple[str, str], list[str]] = {}
    for r in doc["rows"]:
        for field, why in r.get("not_varied", {}).items():
            skipped.setdefault((field, why), []).append(r["model_type"])
    if skipped:
        lines += ["", "Fields that reach an attention module and are not varied:", "",
                  "| field | why | model types |", "|---|---|---|"]
        for (field, why), types in sorted(skipped.items()):
            lines.append(f"| `{field}` | {_escaped(why)} | {', '.join(types)} |")
    return lines + [""]


def render_markdown(doc: dict) -> str:
    """The table docs/coverage.md shows, from the JSON `run` writes (a test re-renders it)."""
    lines = [
        "# Coverage: which transformers model types headprune prunes exactly",
        "",
        f"Generated by `python -m tools.coverage` from transformers {doc['transformers_version']} "
        f"(torch {doc['torch_version']}); raw results in `docs/coverage.json`. Each model type of transformers' "
        "auto mappings is built tiny from its config class (no download) and checked: physical removal equals "
        f"head masking to {doc['atol']:g} of the outputs' largest magnitude (at least 1) (a layer left without heads, an uneven KV group, a whole KV group; eager "
        "and sdpa attention), greedy `generate()` with the KV cache equals the masked model's (causal LMs), "
        "`save_pruned` / `load_pruned` reload equal, and a uniform whole-group layout reloads with plain "
        "`from_pretrained` where the config can say it (`layout file`: `load_pruned` is needed); then the same "
        "checks in each config variant that reaches the type's attention (`variants`: passing / checked; "
        "[Config variants](#config-variants-296)). A model type is listed once, under the first of its mappings in "
        "the order below (`task`).",
        "",
        "| task | passes | refused | fails | not built |",
        "|---|---|---|---|---|",
    ]
    for mapping in doc["mappings"]:
        c = counts(doc, mapping)
        lines.append(f"| {mapping} | {c['passes']} | {c['refused']} | {c['fails']} | {c['not built']} |")
    c = counts(doc)
    v = variant_counts(doc)
    lines += [f"| all | {c['passes']} | {c['refused']} | {c['fails']} | {c['not built']} |", "",
              f"Config variants of the passing types: {sum(v.values())} checked, {v['passes']} pass, {v['fails']} "
              f"fail, {v['not built']} not built.", "",
              "`n/a`: transformers offers no such attention for the family; `–`: does not apply.", ""]
    for status in STATUSES:
        rows = [r for r in doc["rows"] if r["status"] == status]
        if not rows:
            continue
        lines += [f"## {status} ({len(rows)})", ""]
        if status == "passes":
            lines += ["| model type | task | adapter | " + " | ".join(CHECK_COLUMNS) + " | variants |",
                      "|---|---|---|" + "---|" * (len(CHECK_COLUMNS) + 1)]
            for r in rows:
                cells = [_cell(r["checks"].get(name)) for name in CHECK_COLUMNS] + [_variants_cell(r)]
                lines.append(f"| {r['model_type']} | {r['task']} | {r['adapter']} | " + " | ".join(cells) + " |")
        else:
            lines += ["| model type | task | reason |", "|---|---|---|"]
            for r in rows:
                lines.append(f"| {r['model_type']} | {r['task']} | {_escaped(r['reason'])} |")
        lines.append("")
    return "\n".join(lines + _variant_lines(doc))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.add_argument("--markdown", type=Path, help="write the Markdown table here")
    parser.add_argument("--only", nargs="+", help="check only these model types")
    parser.add_argument("--probe", action="store_true", help="also try the Llama layout on unregistered look-alikes")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per model type")
    parser.add_argument("--update", type=Path, help="a table's JSON: check only the --only types and replace their "
                        "rows in it (the other rows kept as they were)")
    args = parser.parse_args(argv)
    if args.update is not None and not args.only:
        parser.error("--update needs --only: the model types whose rows are checked again")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    doc = run(args.only, probe=args.probe, timeout=args.timeout, log=lambda line: print(line, flush=True))
    if args.update is not None:
        doc = updated(json.loads(args.update.read_text()), doc)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(render_markdown(doc) + "\n")
    print(json.dumps(counts(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
