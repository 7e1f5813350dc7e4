"""Which set ranks make each generation replica of the generating role (hfplan.executor.generation_order)."""

from hfplan.executor.generation_order import collector_ranks, generation_rank, replica_ranks
from hfplan.layout import generation_places, rank_coords, reshards_by_plan
from hfplan.plan import GenConfig, TrainConfig


def test_a_hybrid_actor_at_another_tp_generates_in_the_plans_places():
    train, gen = TrainConfig(tp=4, dp=2, shard="replicated"), GenConfig(tp=2, dp=4)
    assert reshards_by_plan(train, gen)
    places = generation_places(train, gen)
    for rank, place in enumerate(places):
        assert rank_coords(gen, generation_rank(train, gen, rank)) == (place.pp, place.dp, place.tp)
    # The paper's example: micro-data-parallel groups [0,1] [2,3] ... hold one shard; replica d's tp group
    # is their members at position d.
    assert replica_ranks(train, gen) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert collector_ranks(train, gen) == [0, 1, 4, 5]


def test_a_pipelined_actor_generates_in_the_plans_places():
    gen = GenConfig(tp=2, dp=2)
    for train in (TrainConfig(pp=2, dp=2, shard="full"), TrainConfig(pp=2, tp=2),
                  TrainConfig(pp=2, dp=2, shard="replicated")):
        assert reshards_by_plan(train, gen)
        for rank, place in enumerate(generation_places(train, gen)):
            assert rank_coords(gen, generation_rank(train, gen, rank)) == (place.pp, place.dp, place.tp)
        assert sorted(r for ranks in replica_ranks(train, gen) for r in ranks) == [0, 1, 2, 3]
    # Training tp 2 on each of 2 stages, generation tp 2: the tensor-parallel pairs of the two stages are the
    # generation replicas (each gathers the other stage's layers from its peer at the same tp rank).
    assert replica_ranks(TrainConfig(pp=2, tp=2), gen) == [[0, 1], [2, 3]]


def test_other_generators_keep_the_generation_layouts_own_order():
    gen = GenConfig(tp=2, dp=2)
    for train in (None, TrainConfig(tp=2, dp=2)):
        assert not reshards_by_plan(train, gen)
        assert replica_ranks(train, gen) == [[0, 1], [2, 3]]
        assert collector_ranks(train, gen) == [0, 2]
        assert [generation_rank(train, gen, r) for r in range(4)] == [0, 1, 2, 3]
