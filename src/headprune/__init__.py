"""headprune: attention-head pruning for transformers."""
from headprune.heads.adapters import get_adapter, head_layout
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import count_params, heads_of_kv_groups, kv_group_heads, prune_heads, scale_heads
from headprune.deploy.hf import load_pruned, save_pruned
from headprune.scoring import score_heads
from headprune.selection.rounds import Round, prune_round
from headprune.retraining_free import export_scaled, prune_to_budget

__all__ = ["HeadMask", "Round", "count_params", "get_adapter", "head_layout", "heads_of_kv_groups", "kv_group_heads",
           "export_scaled", "load_pruned", "prune_heads", "prune_round", "prune_to_budget", "save_pruned",
           "scale_heads", "score_heads"]
__version__ = "0.1.0"
