"""What the code driving a Pruner hands it and is told: `Loaders` (the examples a round reads) and
`RunObserver` (the driving code's hooks at fixed points of a run: physical removal, loggers)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass
class Loaders:
    """The examples a round reads: `score` (scoring and calibration), `val` (reported metrics),
    `select` (the stopping rule's held-out slice, when the schedule reads one), `train` (the
    training text of a recovery that trains a step budget itself: recovery=lora, distill)."""

    score: Iterable
    val: Iterable | None = None
    select: Iterable | None = None
    train: Iterable | None = None

    @classmethod
    def of(cls, datamodule, rank: int = 0, world: int = 1, select: bool = False, train: bool = False) -> "Loaders":
        score = datamodule.score_dataloader(rank, world) if world > 1 else datamodule.score_dataloader()
        return cls(score, datamodule.val_dataloader(), datamodule.select_dataloader() if select else None,
                   datamodule.train_dataloader() if train else None)


class RunObserver:
    """What the code driving a Pruner adds at fixed points of a run; each method is a no-op here.
    `baseline(record)`: the unpruned model's metrics are in; `before_round(k)`: round k (0-based)
    is about to score (earlier rounds are accepted); `pruned(result)`: right after a round's heads are masked, before the recovery (physical
    removal, optimizer state of the pruned heads); `recorded(record)`: a round's result is in
    (loggers); `finished(data)`: `final` is written."""

    def baseline(self, baseline: dict) -> None:
        pass

    def before_round(self, k: int) -> None:
        pass

    def pruned(self, result) -> None:
        pass

    def recorded(self, record: dict) -> None:
        pass

    def finished(self, data: dict) -> None:
        pass
