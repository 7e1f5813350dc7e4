"""Which set ranks make each generation replica of the generating role (hfplan.executor.generation_order)."""

from hfplan.executor.generation_order import collector_ranks, generation_rank, replica_ranks, reshards_by_plan
from hfplan.layout import generation_places, rank_coords
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


def test_other_generators_keep_the_generation_layouts_own_order():
    gen = GenConfig(tp=2, dp=2)
    for train in (None, TrainConfig(tp=2, dp=2), TrainConfig(tp=1, pp=2, dp=2)):
        assert not reshards_by_plan(train, gen)
        assert replica_ranks(train, gen) == [[0, 1], [2, 3]]
        assert collector_ranks(train, gen) == [0, 2]
        assert [generation_rank(train, gen, r) for r in range(4)] == [0, 1, 2, 3]
