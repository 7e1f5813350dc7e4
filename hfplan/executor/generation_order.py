"""Which set ranks make each generation replica of the generating role (torch-free: the controller reads it).

A hybrid actor whose generation layout differs from its training layout (another tp, or pipelined training:
generation runs pp = 1) generates in hfplan.layout's generation places (the paper's micro-data-parallel
grouping), so that its switch moves only the slices the per-tensor plan names (engines.reshard). Every other
case, a rollout set included, generates in the generation layout's own rank order.
"""

from __future__ import annotations

from hfplan.layout import generation_ranks, rank_of, reshards_by_plan
from hfplan.plan import Layout, TrainConfig


def generation_rank(train: TrainConfig | None, gen: Layout, rank: int) -> int:
    """A set rank's rank in the generation layout's order (rank_coords of it give its replica and tp rank)."""
    return generation_ranks(train, gen)[rank] if reshards_by_plan(train, gen) else rank


def set_ranks(train: TrainConfig | None, gen: Layout) -> list[int]:
    """The set rank at each generation rank (the inverse of generation_rank)."""
    order = generation_ranks(train, gen) if reshards_by_plan(train, gen) else list(range(gen.pp * gen.dp * gen.tp))
    inverse = [0] * len(order)
    for rank, place in enumerate(order):
        inverse[place] = rank
    return inverse


def replica_ranks(train: TrainConfig | None, gen: Layout) -> list[list[int]]:
    """Set ranks of each generation replica (layout.replica_groups through generation_rank)."""
    by_place = set_ranks(train, gen)
    return [[by_place[rank_of(gen, p, d, t)] for p in range(gen.pp) for t in range(gen.tp)] for d in range(gen.dp)]


def collector_ranks(train: TrainConfig | None, gen: Layout) -> list[int]:
    """One set rank per generation replica, in replica order: its tensor rank 0 of its last stage."""
    by_place = set_ranks(train, gen)
    return [by_place[rank_of(gen, gen.pp - 1, d, 0)] for d in range(gen.dp)]
