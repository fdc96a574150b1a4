"""Interleaved wall-clock timing, synchronised on CUDA.

On a shared machine the speed drifts over seconds (other jobs, frequency scaling), so timing
variant A fully before variant B turns drift into a fake speed-up. `interleaved` runs one call
of every case per round (A B C A B C ...), rotating the starting case each round, and reports
each case's median and spread over the rounds after the warm-up ones.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class Clock:
    """Milliseconds taken by a call: `perf_counter` on CPU, CUDA events (after a sync) on GPU."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def time(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


@dataclass(frozen=True)
class Case:
    """`run(setup())` is timed; `setup` (optional, untimed) prepares its input, e.g. a prefilled cache."""

    run: Callable[[Any], Any]
    setup: Callable[[], Any] | None = None


@dataclass(frozen=True)
class Stats:
    """Median and spread (quartiles, min, max) of one case's samples, in milliseconds."""

    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> "Stats":
        if len(samples) >= 2:
            q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        else:
            q1 = q3 = samples[0]
        return cls(statistics.median(samples), q1, q3, min(samples), max(samples), len(samples))

    def spread(self) -> dict:
        """Quartiles and extremes, for reports."""
        return {"q1": self.q1_ms, "q3": self.q3_ms, "min": self.min_ms, "max": self.max_ms}

    def scaled(self, factor: float) -> "Stats":
        """The same statistics divided by `factor` (e.g. per generated token)."""
        return Stats(self.median_ms / factor, self.q1_ms / factor, self.q3_ms / factor, self.min_ms / factor,
                     self.max_ms / factor, self.n)


def interleaved(cases: dict[str, Case | Callable[[], Any]], clock: Clock, warmup: int = 1,
                repeats: int = 5) -> dict[str, Stats]:
    """Time every case once per round for `warmup + repeats` rounds; statistics of the last `repeats`."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is not allowed; allowed: an integer >= 1")
    names = list(cases)
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    # The objects alive now (models, imported modules, a caller's caches) are frozen out of the
    # collections between rounds, which then only look at what the timed calls made: in a process
    # holding many objects (a test session, a run with a large model) each full collection took
    # ~0.2-0.5 s. Left alone if the caller froze objects itself.
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        with torch.no_grad():
            for round_ in range(warmup + repeats):
                gc.collect()  # between rounds, never inside a timed call
                gc.disable()
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    case = cases[name]
                    if not isinstance(case, Case):
                        case = Case(run=lambda _, fn=case: fn())
                    state = case.setup() if case.setup is not None else None
                    ms = clock.time(lambda: case.run(state))
                    if round_ >= warmup:
                        samples[name].append(ms)
    finally:
        if freeze:
            gc.unfreeze()
        if gc_was_enabled:
            gc.enable()
    return {name: Stats.of(values) for name, values in samples.items()}


class ModuleTimer:
    """Total time spent inside `modules` while the context is open, via forward (pre-)hooks.

    Used for shares (attention time / step time) in a pass of its own: the hooks cost a little
    per call, so they are never on during the interleaved timing. Modules must not nest.
    """

    def __init__(self, modules: Iterable[nn.Module], clock: Clock):
        self.modules = list(modules)
        self.clock = clock
        self._spans: list[tuple[Any, Any]] = []
        self._open: dict[int, Any] = {}
        self._handles: list = []

    def _now(self):
        if self.clock.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __enter__(self) -> "ModuleTimer":
        self._spans, self._open = [], {}
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args: self._open.__setitem__(id(m), self._now())))
            self._handles.append(module.register_forward_hook(
                lambda m, args, out: self._spans.append((self._open.pop(id(m)), self._now()))))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def total_ms(self) -> float:
        if self.clock.cuda:
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in self._spans)
        return sum(end - start for start, end in self._spans) * 1e3
