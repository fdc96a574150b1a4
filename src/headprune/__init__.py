"""headprune: attention-head pruning for transformers."""
from headprune.heads.adapters import get_adapter, head_layout
from headprune.heads.mask import HeadMask
from headprune.scoring import score_heads

__all__ = ["HeadMask", "get_adapter", "head_layout", "score_heads"]
__version__ = "0.1.0"
