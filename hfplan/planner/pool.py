"""Spread the costing of role strategies over processes (`--jobs`): each (role, GPU count) is
independent, and most of a large search's time goes there."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable

from hfplan.planner import space
from hfplan.planner.context import Costed, SearchContext

_WORKER_CONTEXT: SearchContext | None = None  # in a worker process only: the search it costs for


def _start_worker(ctx: SearchContext) -> None:
    """Pool initializer. With the fork start method its argument is inherited, not pickled. Ctrl-C reaches
    every process of the terminal's group: the workers leave it to the parent, which stops them, so no
    worker prints a traceback of its own."""
    global _WORKER_CONTEXT
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_CONTEXT = ctx


def _cost(role_size: tuple[str, int]) -> tuple[tuple[str, int], Costed]:
    assert _WORKER_CONTEXT is not None
    return role_size, _WORKER_CONTEXT.costed(*role_size)


def warm_floors(ctx: SearchContext, gpus: int, jobs: int,
                progress: Callable[[str, int, int], None] | None = None) -> None:
    """Fill ctx's caches of strategies and floors for every role at every set size."""
    sizes = space.set_sizes(gpus, ctx.gpus_per_node)
    if ctx.rules.power_of_two_sets:
        sizes = [s for s in sizes if s & (s - 1) == 0]
    todo = [(role, size) for role in ctx.gpu_roles for size in sorted(sizes, reverse=True)
            if not ctx.bounds.has_floor(role, size)]  # a context sharing another's caches costs only what is new
    if not todo:
        return
    if "fork" not in multiprocessing.get_all_start_methods():
        return  # costed lazily in this process instead
    with multiprocessing.get_context("fork").Pool(jobs, initializer=_start_worker, initargs=(ctx,)) as pool:
        for done, ((role, size), costed) in enumerate(pool.imap_unordered(_cost, todo, chunksize=4), 1):
            ctx.adopt(role, size, costed)
            if progress is not None:
                progress("costing strategies", done, len(todo))
