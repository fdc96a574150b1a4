"""Attention heads: where they live per family (adapters.py; MLA in latent.py, hybrid decoders in
hybrid.py, registered on import here), masks, surgery and KV modes."""
from headprune.heads import hybrid, latent  # noqa: F401 - register the MLA and hybrid adapters
