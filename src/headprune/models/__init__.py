"""Model and tokenizer loading (`build.py`) and the built-in byte tokenizer."""
from headprune.models.build import build_model, load_tokenizer, resolve_pretrained

__all__ = ["build_model", "load_tokenizer", "resolve_pretrained"]
