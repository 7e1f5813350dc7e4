"""The hybrid engine's per-tensor resharding plan (hfplan.layout): which slice of each parameter every rank
holds in training and needs in generation, and who sends whom which slice at the switch."""

from __future__ import annotations

import itertools

import pytest

from hfplan.layout import (
    GenerationPlace,
    SwitchLayout,
    TensorSpec,
    arch_specs,
    box_meet,
    box_numel,
    generation_groups,
    generation_numel,
    generation_places,
    generation_ranks,
    most_generation_numel,
    most_received_numel,
    nests,
    rank_coords,
    received_numel,
    reshard_transfers,
    stage_of,
    sync_transfers,
    training_box,
)
from hfplan.plan import GenConfig, TrainConfig
from hfplan.profiles.models import ModelArch

ODD = ModelArch(name="odd", layers=4, hidden=64, heads=8, kv_heads=2, ffn=128, vocab=260)  # 260: uneven FSDP chunks


def _gen(train: TrainConfig, tp: int, pp: int = 1) -> GenConfig:
    return GenConfig(tp=tp, pp=pp, dp=train.gpus // (tp * pp))


def _split_only(layers: int) -> list[TensorSpec]:
    """Layer tensors only, every one split by tensor parallelism and evenly (the paper's M)."""
    return [TensorSpec("q", (64, 32), 0, 0, layers), TensorSpec("o", (32, 64), 1, 0, layers),
            TensorSpec("up", (128, 32), 0, 0, layers)]


def test_the_papers_example_groups():
    # Training tp 4, dp 2 on 8 GPUs, generation tp 2: micro-data-parallel groups of adjacent ranks gather,
    # and the generation tensor-parallel groups are their members at one position.
    train = TrainConfig(tp=4, dp=2, shard="replicated")
    gen = _gen(train, 2)
    assert generation_groups(train, gen) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    places = generation_places(train, gen)
    tp_groups: dict[tuple[int, int], list[int]] = {}
    for rank, place in enumerate(places):
        tp_groups.setdefault((place.pp, place.dp), []).append(rank)
    assert sorted(tp_groups.values()) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # Rank 1 already holds a quarter of every tensor and gets the other quarter of its half from rank 0.
    q = TensorSpec("q", (64, 32), 0, 0)
    assert [(t.src, t.dst, t.box) for t in reshard_transfers(train, gen, [q], 1, receiver=1)] == \
        [(0, 1, ((0, 16), (0, 32)))]


@pytest.mark.parametrize(("tp", "pp", "tp_g", "pp_g"),
                         [(4, 1, 2, 1), (4, 1, 1, 1), (2, 2, 1, 1), (4, 2, 2, 1), (4, 2, 2, 2), (2, 2, 2, 1),
                          (2, 1, 2, 1)])
def test_received_bytes_and_peak_follow_the_papers_formula(tp, pp, tp_g, pp_g):
    layers = 4
    specs = _split_only(layers)
    model = sum(s.numel * s.count for s in specs)
    train = TrainConfig(tp=tp, pp=pp, dp=2, shard="replicated")
    gen = _gen(train, tp_g, pp_g)
    expected = (tp * pp - tp_g * pp_g) * model // (tp_g * pp_g * tp * pp)
    assert received_numel(train, gen, specs, layers) == [expected] * train.gpus
    for place in generation_places(train, gen):
        assert generation_numel(gen, specs, layers, place) == model // (tp_g * pp_g)
    sent = sum(t.numel for t in reshard_transfers(train, gen, specs, layers))
    assert sent == expected * train.gpus


def test_a_finer_generation_layout_is_a_slice_of_the_training_shard():
    train = TrainConfig(tp=2, dp=4, shard="replicated")
    gen = _gen(train, 4)
    assert reshard_transfers(train, gen, arch_specs(ODD), ODD.layers) == []
    assert received_numel(train, gen, arch_specs(ODD), ODD.layers) == [0] * 8


def _valid_pairs():
    for tp, pp, dp, shard in itertools.product((1, 2), (1, 2), (1, 2, 4), ("replicated", "full", "hybrid")):
        if tp * pp * dp > 8 or (shard == "hybrid" and dp < 4):
            continue
        train = TrainConfig(tp=tp, pp=pp, dp=dp, shard=shard, shard_group=2 if shard == "hybrid" else None)
        for tp_g, pp_g in itertools.product((1, 2, 4), (1, 2)):
            if train.gpus % (tp_g * pp_g) == 0 and nests(tp_g, tp) and nests(pp_g, pp) and ODD.kv_heads % tp == 0:
                yield train, _gen(train, tp_g, pp_g)


def test_every_needed_slice_arrives_exactly_once_from_the_generation_group():
    specs, layers = arch_specs(ODD), ODD.layers
    pairs = list(_valid_pairs())
    assert len(pairs) > 40
    for train, gen in pairs:
        places = generation_places(train, gen)
        # The places form the generation layout: every (pp, dp, tp) coordinate once.
        assert sorted((p.pp, p.dp, p.tp) for p in places) == sorted(
            itertools.product(range(gen.pp), range(gen.dp), range(gen.tp)))
        group_of = {r: g for g in generation_groups(train, gen) for r in g}
        transfers = reshard_transfers(train, gen, specs, layers)
        received = [0] * train.gpus
        for t in transfers:
            assert t.src in group_of[t.dst]
            spec = next(s for s in specs if s.name == t.name)
            assert box_meet(t.box, training_box(train, spec, t.src)) == t.box  # the sender holds it
            received[t.dst] += t.numel
        assert received == received_numel(train, gen, specs, layers)
        for dst, place in enumerate(places):
            for spec in specs:
                on_stage = [layer for layer in range(spec.layer, spec.layer + spec.count)
                            if stage_of(layer, layers, gen.pp) == place.pp]
                if not on_stage:
                    continue
                pieces = [t.box for t in transfers if t.dst == dst and t.name == spec.name]
                if stage_of(on_stage[0], layers, train.pp) == rank_coords(train, dst)[0]:
                    pieces.append(training_box(train, spec, dst))
                need = generation_needs(gen, spec, place)
                inside = [box_meet(b, need) for b in pieces]
                inside = list(dict.fromkeys(b for b in inside if b is not None))
                for a, b in itertools.combinations(inside, 2):
                    assert box_meet(a, b) is None, (train, gen, spec.name, dst)
                assert sum(box_numel(b) for b in inside) == box_numel(need), (train, gen, spec.name, dst)


def generation_needs(gen, spec, place):
    from hfplan.layout import generation_box

    return generation_box(gen, spec, place)


def test_coarser_generation_groups_share_one_shard():
    # tp_g <= tp: every member of a generation group ends up with the same generation shard (containment:
    # the group's training shards, tp / tp_g adjacent tensor ranks of pp / pp_g stages, make exactly it).
    for train, gen in _valid_pairs():
        if gen.tp <= train.tp and gen.pp <= train.pp:
            places = generation_places(train, gen)
            for group in generation_groups(train, gen):
                assert len({(places[r].pp, places[r].tp) for r in group}) == 1


def test_kv_projections_copied_past_their_heads():
    # Generation tp 4 over 2 KV heads: ranks of generation tp 0 and 1 both need KV head 0.
    train = TrainConfig(tp=2, dp=2, shard="replicated")
    gen = _gen(train, 4)
    k = next(s for s in arch_specs(ODD) if s.name == "layers.k_proj")
    places = generation_places(train, gen)
    boxes = {places[r].tp: generation_needs(gen, k, places[r]) for r in range(4)}
    assert boxes[0] == boxes[1] == ((0, 8), (0, 64)) and boxes[2] == boxes[3] == ((8, 16), (0, 64))


def test_arch_specs_count_every_parameter():
    for arch in (ODD, ModelArch(name="tied", layers=2, hidden=32, heads=4, kv_heads=4, ffn=64, vocab=100,
                                tied_embeddings=True, attention_bias=True),
                 ModelArch(name="gelu", layers=2, hidden=32, heads=4, kv_heads=4, ffn=128, vocab=100, mlp="gelu")):
        assert sum(s.numel * s.count for s in arch_specs(arch)) == arch.params("lm")


def test_generation_ranks_are_a_permutation_and_the_identity_at_the_training_tp():
    for train, gen in _valid_pairs():
        ranks = generation_ranks(train, gen)
        assert sorted(ranks) == list(range(train.gpus))
        if gen.tp == train.tp and gen.pp == train.pp:
            assert ranks == list(range(train.gpus))
    assert generation_ranks(TrainConfig(tp=4, dp=2, shard="replicated"), GenConfig(tp=2, dp=4)) == \
        [0, 2, 1, 3, 4, 6, 5, 7]


def test_a_rollout_sets_sync_sends_each_rollout_rank_exactly_its_shard():
    specs, layers = arch_specs(ODD), ODD.layers
    for train, rollout in [(TrainConfig(tp=2, dp=2), GenConfig(tp=2, dp=2)), (TrainConfig(tp=2, dp=2), GenConfig(tp=4)),
                           (TrainConfig(tp=1, dp=4), GenConfig(tp=2)), (TrainConfig(tp=2, pp=2), GenConfig(dp=2))]:
        transfers = sync_transfers(train, rollout, specs, layers)
        for dst in range(rollout.gpus):
            place = GenerationPlace(*rank_coords(rollout, dst))
            mine = [t for t in transfers if t.dst == dst]
            assert sum(t.numel for t in mine) == generation_numel(rollout, specs, layers, place)
            for a, b in itertools.combinations(mine, 2):
                assert (a.name, a.layer) != (b.name, b.layer) or box_meet(a.box, b.box) is None
        # Data-parallel replicas share the sending.
        assert len({t.src for t in transfers}) == train.gpus


def test_most_received_is_shared_by_configs_the_switch_cannot_tell_apart():
    """most_received_numel is cached by what the per-tensor plan reads (SwitchLayout): configs differing only in
    micro-batch, recomputation or the sharding of states other than the weights share one count, and it is the
    largest of received_numel's."""
    arch = ModelArch(name="t", layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
    specs = arch_specs(arch)
    base = TrainConfig(tp=2, pp=2, dp=2, shard="zero1", micro_batch=1)
    gen = GenConfig(tp=4, pp=1, dp=2)
    expected = max(received_numel(base, gen, specs, arch.layers))
    assert expected > 0
    for other in (base.model_copy(update={"micro_batch": 4}), base.model_copy(update={"recompute": "full"}),
                  base.model_copy(update={"shard": "replicated"})):
        assert SwitchLayout.of(other) == SwitchLayout.of(base)
        assert most_received_numel(arch, other, gen) == expected
    full = base.model_copy(update={"shard": "full"})  # weights in dp pieces: another plan
    assert SwitchLayout.of(full) != SwitchLayout.of(base)
    assert most_received_numel(arch, full, gen) == max(received_numel(full, gen, specs, arch.layers))


def test_most_generation_numel_is_the_largest_shard_of_any_rank():
    """most_generation_numel reads one replica's ranks: every rank of the layout holds no more."""
    arch = ModelArch(name="t", layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
    specs = arch_specs(arch)
    for gen in (GenConfig(tp=2, pp=2, dp=3), GenConfig(tp=4, pp=1, dp=2), GenConfig(tp=1, pp=4, dp=1)):
        every = [generation_numel(gen, specs, arch.layers, GenerationPlace(*rank_coords(gen, r)))
                 for r in range(gen.tp * gen.pp * gen.dp)]
        assert most_generation_numel(arch, gen) == max(every)


HEAVY_EMBEDDING = ModelArch(name="heavy", layers=4, hidden=64, heads=8, kv_heads=2, ffn=128, vocab=4000)


@pytest.mark.parametrize("arch", [ODD, HEAVY_EMBEDDING], ids=["odd", "heavy-embedding"])
@pytest.mark.parametrize(("train", "tp_g"), [(TrainConfig(pp=4), 1), (TrainConfig(pp=2, tp=2), 1),
                                             (TrainConfig(tp=4), 1), (TrainConfig(tp=2, dp=2), 4),
                                             (TrainConfig(pp=2, dp=2, shard="full"), 1),
                                             (TrainConfig(tp=2, dp=4, shard="full"), 1)],
                         ids=["p4", "p2t2", "t4", "t2d2-t4", "p2d2-fsdp", "t2d4-fsdp"])
def test_the_switch_buffers_bound_covers_what_every_rank_sends_and_receives(arch, train, tp_g):
    """switch_round_bytes' total, with a bucket too large to bind, is at least every rank's sent plus received
    elements in the plan (a pipelined model's first stage sends its layers and the embedding to every other stage:
    more than any rank receives)."""
    from hfplan.layout import _switch_traffic

    gen = _gen(train, tp_g)
    moved, slices = [0] * train.gpus, []
    for t in reshard_transfers(train, gen, arch_specs(arch), arch.layers):
        moved[t.src] += t.numel
        moved[t.dst] += t.numel
        slices.append(box_numel(t.box))  # one tensor's slice (t.numel counts the layers it stands for)
    total, largest = _switch_traffic(arch, SwitchLayout.of(train), (gen.tp, gen.pp, gen.dp))
    assert 0 < max(moved) <= total
    assert max(slices) <= largest
