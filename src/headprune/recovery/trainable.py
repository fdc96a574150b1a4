"""Which parameters a recovery trains: `trainable(model, pick)` turns requires_grad on for the
parameters `pick` accepts and off for the rest, for one block (a step budget's fit)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn


@contextmanager
def trainable(model: nn.Module, pick: Callable[[str], bool]) -> Iterator[None]:
    """Only the parameters whose names `pick` accepts require grad inside the block; every
    parameter there at its start has its flag back afterwards (ones added inside are not touched)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for name, p in model.named_parameters():
            p.requires_grad_(pick(name))
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
