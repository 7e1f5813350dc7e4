"""Spread the costing of role strategies over processes (`--jobs`): each (role, GPU count) is
independent, and most of a large search's time goes there."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

from hfplan.planner import space
from hfplan.planner.strategies import SearchContext

_CONTEXT: SearchContext | None = None  # set only while a pool runs: forked workers inherit the parent's


def _cost(key: tuple[str, int]) -> tuple[tuple[str, int], tuple]:
    assert _CONTEXT is not None
    return key, _CONTEXT.costed(*key)


def warm_floors(ctx: SearchContext, gpus: int, jobs: int,
                progress: Callable[[str, int, int], None] | None = None) -> None:
    """Fill ctx's caches of strategies and floors for every role at every set size."""
    sizes = space.set_sizes(gpus, ctx.gpus_per_node)
    if ctx.rules.power_of_two_sets:
        sizes = [s for s in sizes if s & (s - 1) == 0]
    keys = [(role, size) for role in ctx.gpu_roles for size in sorted(sizes, reverse=True)]
    if "fork" not in multiprocessing.get_all_start_methods():
        return  # costed lazily in this process instead
    global _CONTEXT
    _CONTEXT = ctx
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for done, (key, costed) in enumerate(pool.imap_unordered(_cost, keys, chunksize=4), 1):
                ctx.adopt(*key, *costed)
                if progress is not None:
                    progress("costing strategies", done, len(keys))
    finally:
        _CONTEXT = None
