"""Cross-rank reductions for data-parallel runs (no-ops in a single process).

Under DDP every rank scores a different shard of the scoring slice; metrics sum their
per-rank accumulators with `all_reduce_sum` before normalising, so every rank ends with the
scores a single process would compute on the union of the shards, and prunes the same heads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of `tensor` over all ranks (a copy; float64 kept as is)."""
    if not is_distributed():
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_equal(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is identical on every rank (a collective: call it on all ranks)."""
    if not is_distributed():
        return True
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def check_ranks(model, mask, when: str) -> None:
    """Every rank holds the same head mask and the same weights (a collective; `when` names the
    point of the run in the error)."""
    params = list(model.parameters())
    device = mask.mask.device  # a streamed model's blocks sit in host memory (engine.offload): sums gathered here
    digest = torch.stack([t.detach().double().sum().to(device) for t in params] +
                         [t.detach().double().pow(2).sum().to(device) for t in params])
    if not all_equal(mask.mask) or not all_equal(digest):
        raise RuntimeError(f"{when}: the head masks or the weights differ between ranks")
