"""headprune: attention-head pruning for transformers."""
from headprune.deploy.fold import fold
from headprune.deploy.gguf_export import save_gguf
from headprune.deploy.hf import load_pruned, save_pruned
from headprune.heads.adapters import get_adapter, head_layout
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import count_params, heads_of_kv_groups, kv_group_heads, prune_heads, scale_heads
from headprune.runs import RunSpec, run
from headprune.scoring import get_metric, score_heads
from headprune.selection.pruner import Loaders, Pruner
from headprune.selection.retraining_free import prune_to_budget
from headprune.selection.rounds import Round, prune_round

__all__ = ["HeadMask", "Loaders", "Pruner", "Round", "RunSpec", "count_params", "fold", "get_adapter", "get_metric",
           "head_layout", "heads_of_kv_groups", "kv_group_heads", "load_pruned", "prune_heads", "prune_round",
           "prune_to_budget", "run", "save_gguf", "save_pruned", "scale_heads", "score_heads"]
__version__ = "0.1.0"
