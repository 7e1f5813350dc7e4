"""Lower bounds of the iteration time over GPU allocations, for a best-first walk of the allocations.

An allocation is built set by set (a prefix of sizes), using at most the cluster's GPUs. Its bound is
the schedule rule's longest path (hfplan.simulator.schedule) with every call at its floor (the fastest
any strategy that fits alone makes it; a rollout set's weight sync at its cheaper case) and free
transfers. Idle GPUs (Rules.idle_gpus) change nothing here: the floor of a set not yet sized is over
every size it can still get, at most what is left.
For a set not yet sized, the floor is taken over every size it could still get, so the bound of a
prefix is below the bound of every allocation that extends it: a prefix whose bound cannot beat the
K-th best plan found so far can be dropped with everything below it.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from hfplan.layout import ON_CONTROLLER, set_index
from hfplan.planner import space
from hfplan.planner.strategies import SearchContext
from hfplan.simulator.schedule import Precedence


class PlacementBounds:
    def __init__(self, ctx: SearchContext, placement: tuple[tuple[str, ...], ...], gpus: int) -> None:
        self.ctx, self.placement, self.gpus = ctx, placement, gpus
        sizes = space.set_sizes(gpus, ctx.gpus_per_node)
        if ctx.rules.power_of_two_sets:
            sizes = [s for s in sizes if s & (s - 1) == 0]
        self.sizes = sizes
        self.k = len(placement)
        n_nodes = len(ctx.dag.nodes)
        where = set_index(placement)
        self.precedence = Precedence.of(ctx.dag, [ON_CONTROLLER if r is None else where[r] for r in ctx.runners])
        self.switch_ids = ctx.switch_ids
        # rows[i, j]: floor seconds of set i's calls on sizes[j]; feasible[i, j]; switch[i, j]
        self.rows = np.zeros((self.k, len(sizes), n_nodes))
        self.switch = np.zeros((self.k, len(sizes)))
        self.feasible = np.ones((self.k, len(sizes)), dtype=bool)
        self.why: dict[tuple[int, int], str] = {}
        for i, roles in enumerate(placement):
            for j, size in enumerate(sizes):
                self._fill(i, j, roles, size)
        # best[i, j]: the set's floors over every feasible size up to sizes[j] (elementwise minimum)
        masked = np.where(self.feasible[..., None], self.rows, np.inf)
        self.best_rows = np.minimum.accumulate(masked, axis=1)
        self.best_switch = np.minimum.accumulate(np.where(self.feasible, self.switch, np.inf), axis=1)

    def _fill(self, i: int, j: int, roles: tuple[str, ...], size: int) -> None:
        row, switch, why = self.ctx.set_bound(roles, size)
        if why:
            self.feasible[i, j] = False
            self.why[(i, j)] = why
            return
        self.rows[i, j] = row
        self.switch[i, j] = switch

    def _largest_index(self, limit: int) -> int:
        """Index of the largest allowed size <= limit (-1 if none)."""
        return int(np.searchsorted(self.sizes, limit, side="right")) - 1

    def bound(self, prefix: tuple[int, ...]) -> float:
        """Lower bound of every allocation that starts with `prefix` (sizes of the first sets)."""
        left = self.gpus - sum(prefix)
        unsized = self.k - len(prefix)
        seconds = np.zeros(self.rows.shape[2])
        switch = 0.0
        for i, size in enumerate(prefix):
            j = self.sizes.index(size)
            seconds += self.rows[i, j]
            switch += self.switch[i, j]
        if unsized:
            j = self._largest_index(left - (unsized - 1))  # the others need at least one GPU each
            if j < 0:
                return np.inf
            for i in range(len(prefix), self.k):
                seconds += self.best_rows[i, j]
                switch += self.best_switch[i, j]
        return self._makespan(seconds, switch)

    def _makespan(self, seconds: np.ndarray, switch: float) -> float:
        if not np.all(np.isfinite(seconds)) or not np.isfinite(switch):
            return np.inf
        durations = [float(x) for x in seconds]
        for i in self.switch_ids:
            durations[i] += switch
        return self.precedence.makespan(durations)

    def children(self, prefix: tuple[int, ...]) -> list[tuple[tuple[int, ...], float, str]]:
        """Sizes the next set can take: (child prefix, its bound, '' or why that size is infeasible), the
        bounds of all children in one schedule (bound() of each, at once)."""
        index = len(prefix)
        left = self.gpus - sum(prefix)
        unsized_after = self.k - index - 1
        js = [j for j, size in enumerate(self.sizes) if size <= left - unsized_after]
        if not unsized_after and not self.ctx.rules.idle_gpus:
            js = [j for j in js if self.sizes[j] == left]  # the last set takes every GPU left
        if not js:
            return []
        base = np.zeros(self.rows.shape[2])
        switch = 0.0
        for i, size in enumerate(prefix):
            j = self.sizes.index(size)
            base = base + self.rows[i, j]
            switch += self.switch[i, j]
        rows = base + self.rows[index, js]
        switches = switch + self.switch[index, js]
        if unsized_after:
            for n, j in enumerate(js):
                limit = self._largest_index(left - self.sizes[j] - (unsized_after - 1))  # >= 0: size 1 exists
                for i in range(index + 1, self.k):
                    rows[n] += self.best_rows[i, limit]
                    switches[n] += self.best_switch[i, limit]
        rows[~self.feasible[index, js]] = np.inf
        if self.switch_ids:
            rows[:, self.switch_ids] += switches[:, None]
        bounds = self.precedence.makespan_many(rows)  # an infinite floor anywhere makes its bound infinite
        return [(prefix + (self.sizes[j],), float(b), "" if self.feasible[index, j] else self.why[(index, j)])
                for j, b in zip(js, bounds, strict=True)]

    def completions(self, prefix: tuple[int, ...]) -> int:
        """How many complete allocations start with `prefix`."""
        return _count(tuple(self.sizes), self.k - len(prefix), self.gpus - sum(prefix), self.ctx.rules.idle_gpus)


@cache
def _count(sizes: tuple[int, ...], sets: int, gpus: int, idle: bool) -> int:
    """Ways to give `sets` sets sizes from `sizes` using all `gpus` GPUs (with `idle`, at most `gpus`)."""
    if sets == 0:
        return 1 if idle or gpus == 0 else 0
    return sum(_count(sizes, sets - 1, gpus - s, idle) for s in sizes if s <= gpus - (sets - 1))
