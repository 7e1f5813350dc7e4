"""Spread the costing of role strategies over processes (`--jobs`): each (role, GPU count) is
independent, and most of a large search's time goes there."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

from hfplan.planner import space
from hfplan.planner.strategies import Floor, SearchContext

_CONTEXT: SearchContext | None = None  # inherited by forked workers


def _cost(key: tuple[str, int]) -> tuple[tuple[str, int], object, object, Floor | None]:
    assert _CONTEXT is not None
    role, gpus = key
    floor = _CONTEXT.floor(role, gpus)
    return key, _CONTEXT._parts.get(key), _CONTEXT._choices.get(key), floor


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
            for done, (key, parts, choices, floor) in enumerate(pool.imap_unordered(_cost, keys, chunksize=4), 1):
                if parts is not None:
                    ctx._parts[key] = parts
                if choices is not None:
                    ctx._choices[key] = choices
                ctx._floors[key] = floor
                if progress is not None:
                    progress("costing strategies", done, len(keys))
    finally:
        _CONTEXT = None
