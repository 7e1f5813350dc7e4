"""How hfplan sums up repeated measurements of one quantity: their median (`typical`).

The profiler keeps the median of its trials, not the best: a profile predicts runs, and a run sees the machine as
it usually is, its bursts of other work included (on a shared machine the best trial is its quietest moment, and a
profile of best trials predicted 17 of 18 executed plans faster than they ran, bench/validate.py). `hfplan
validate` compares the simulation with the median of the measured iterations for the same reason: the statistic
the profile's rates were taken with, which one slow iteration (a collection, another process's burst) does not
move.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def typical(values: Sequence[float]) -> float:
    """What a measurement keeps of its repeats: their median."""
    return statistics.median(values)
