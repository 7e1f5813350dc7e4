"""Timing helpers shared by the benchmarks: alternating rounds of CPU time per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median over `rounds` alternating rounds of the CPU ms per call of each function."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.process_time()
            for _ in range(calls):
                fn()
            times[name].append((time.process_time() - start) / calls * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}
