"""Timing of device work: back-to-back calls between two synchronisations, the median of a few trials.

Kernels of a real layer run back to back, so a kernel's cost is measured the same way: a loop of
calls with one synchronisation at each end, divided by the number of calls. Operands rotate over
enough copies that their working set exceeds the last-level cache, as the weights of a many-layer
model do.

Every measurement of the profiler keeps the median of its trials (hfplan.measure.typical, which says why), not
the best.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from hfplan.measure import typical


class Clock:
    def __init__(self, torch, kind: str) -> None:
        self.torch = torch
        self.kind = kind

    def sync(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.synchronize()

    def per_call(self, fn: Callable[[], Any], min_time: float, trials: int = 5, max_reps: int = 2000) -> float:
        """Seconds per call of fn: warm up, size the loop to about min_time in all, the median trial."""
        fn()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        once = max(time.perf_counter() - start, 1e-7)
        reps = int(min(max_reps, max(1, math.ceil(min_time / trials / once))))
        seconds = []
        for _ in range(trials):
            self.sync()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            self.sync()
            seconds.append((time.perf_counter() - start) / reps)
        return typical(seconds)


def copies_for(set_bytes: float, cache_bytes: int, budget_bytes: float, most: int = 64) -> int:
    """How many copies of a working set of set_bytes to rotate over: enough to exceed twice the
    last-level cache, within a memory budget."""
    wanted = math.ceil(2 * cache_bytes / max(set_bytes, 1.0)) + 1
    affordable = int(budget_bytes // max(set_bytes, 1.0))
    return max(1, min(wanted, affordable, most))


def rotating(items: Sequence[Any]) -> Callable[[], Any]:
    """A function returning the next item, round robin."""
    cycle = itertools.cycle(items)
    return lambda: next(cycle)
