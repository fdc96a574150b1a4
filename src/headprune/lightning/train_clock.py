"""The wall time and throughput of the training between two records of a run (a round's
fine-tuning, or the baseline epochs): started at each epoch's start, stopped when validation or
the epoch ends, so evaluation and pruning are not counted."""
from __future__ import annotations

import time


class TrainClock:
    def __init__(self) -> None:
        self.seconds, self.samples = 0.0, 0
        self._start: float | None = None

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def take(self, extra: dict) -> dict:
        """`train_seconds` and `train_samples_per_s` since the last take, with `extra` (what the
        recovery adds, e.g. the teacher's share); {} when nothing trained. Resets."""
        seconds, samples = self.seconds, self.samples
        self.seconds, self.samples = 0.0, 0
        if not samples:
            return {}
        return {"train_seconds": round(seconds, 3), "train_samples_per_s": round(samples / max(seconds, 1e-9), 2),
                **extra}

    def state_dict(self) -> dict:
        return {"seconds": self.seconds, "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.seconds, self.samples = float(state["seconds"]), int(state["samples"])
