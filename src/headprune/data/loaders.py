"""DataLoaders whose batch order depends only on (seed, epoch), for exact resume."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler


class EpochSeededSampler(Sampler[int]):
    """A shuffling sampler whose order depends only on (seed, epoch), so a run resumed from a
    checkpoint sees the same batches as an uninterrupted one. Lightning calls `set_epoch`."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def seeded_loader(data, batch_size: int, shuffle: bool, seed: int, num_workers: int = 0,
                  collate_fn=None) -> DataLoader:
    """A DataLoader whose batch order depends only on (seed, epoch). Its private generator for the
    worker seeds keeps the global RNG (dropout) untouched by iterating, so a resumed run continues
    the exact random stream of an uninterrupted one."""
    sampler = EpochSeededSampler(len(data), seed) if shuffle else None
    return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, generator=torch.Generator().manual_seed(seed))
