"""The planner's search space (hfplan/planner/space.py), each part checked against a brute-force
enumeration written here from the rules in DESIGN.md and the issue: placements are set partitions
(Bell-number many), set sizes are powers of two inside a node or whole nodes, layouts keep tp a power
of two within a node that divides the heads, pp divides the layers, and tp*pp*dp uses every GPU."""

from __future__ import annotations

import itertools
import math

import pytest

from hfplan.layout import nests, unsupported_layout
from hfplan.plan import GenConfig, RoleParallelism, TrainConfig
from hfplan.planner import space
from hfplan.profiles.models import CATALOG, ModelArch
from hfplan.simulator.mapping import set_offsets

BELL = {0: 1, 1: 1, 2: 2, 3: 5, 4: 15, 5: 52, 6: 203}

# Heads 8 / kv heads 2: training tp must divide the KV heads (1, 2); inference may replicate KV heads
# (tp 4 and 8 too). 6 layers: pp in 1, 2, 3, 6.
GQA = ModelArch("gqa-test", layers=6, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=1000)
ARCHS = [GQA, CATALOG["qwen2.5-0.5b"], CATALOG["llama2-7b"], CATALOG["llama2-70b"], CATALOG["tiny"]]


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# -- placements -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 7))
def test_set_partition_counts_are_bell_numbers(n):
    items = [f"r{i}" for i in range(n)]
    assert len(space.set_partitions(items)) == BELL[n]


def test_ppo_roles_have_fifteen_placements():
    assert len(space.set_partitions(("actor", "critic", "reference", "reward"))) == 15


@pytest.mark.parametrize("n", range(0, 7))
def test_set_partitions_are_true_partitions_without_duplicates(n):
    items = [f"r{i}" for i in range(n)]
    partitions = space.set_partitions(items)
    seen = set()
    for partition in partitions:
        members = [item for group in partition for item in group]
        assert all(len(group) >= 1 for group in partition), partition
        assert len(members) == len(set(members)), f"sets overlap: {partition}"
        assert sorted(members) == sorted(items), f"does not cover the items: {partition}"
        for group in partition:  # each set lists its items in the order of `items`
            assert list(group) == sorted(group, key=items.index), partition
        key = frozenset(frozenset(group) for group in partition)
        assert key not in seen, f"duplicate partition {partition}"
        seen.add(key)
    assert len(seen) == BELL[n]


def test_set_partitions_include_all_together_and_all_apart():
    items = ("a", "b", "c", "d")
    partitions = space.set_partitions(items)
    assert (items,) in partitions
    assert tuple((i,) for i in items) in partitions


def test_sets_of_a_partition_are_in_the_order_of_their_first_items():
    items = ["a", "b", "c", "d"]
    for partition in space.set_partitions(items):
        firsts = [items.index(group[0]) for group in partition]
        assert firsts == sorted(firsts), partition


# -- set sizes and allocations --------------------------------------------------------------------
def _allowed_size(size: int, gpus: int, per_node: int) -> bool:
    """A colocated set gets a power of two smaller than a node, or a whole number of nodes."""
    if size < 1 or size > gpus:
        return False
    return (size < per_node and _is_power_of_two(size)) or size % per_node == 0


def _brute_allocations(sets: int, gpus: int, per_node: int, powers_only: bool = False, idle: bool = False
                       ) -> set[tuple[int, ...]]:
    sizes = [s for s in range(1, gpus + 1) if _allowed_size(s, gpus, per_node)]
    if powers_only:
        sizes = [s for s in sizes if _is_power_of_two(s)]
    return {combo for combo in itertools.product(sizes, repeat=sets)
            if sum(combo) == gpus or idle and sum(combo) < gpus}


@pytest.mark.parametrize(("gpus", "per_node"), [(1, 1), (1, 8), (2, 2), (3, 2), (4, 4), (6, 4), (8, 8), (12, 8),
                                                 (16, 8), (20, 8), (24, 8), (5, 1)])
def test_set_sizes_are_sub_node_powers_of_two_or_whole_nodes(gpus, per_node):
    expected = [s for s in range(1, gpus + 1) if _allowed_size(s, gpus, per_node)]
    assert sorted(space.set_sizes(gpus, per_node)) == expected


@pytest.mark.parametrize(("gpus", "per_node"), [(1, 1), (2, 2), (3, 2), (4, 2), (4, 4), (6, 4), (8, 8), (12, 8),
                                                 (16, 8), (20, 8), (24, 8), (32, 8), (7, 4)])
@pytest.mark.parametrize("sets", [1, 2, 3, 4])
@pytest.mark.parametrize("idle", [False, True])
def test_allocations_match_brute_force(sets, gpus, per_node, idle):
    got = list(space.allocations(sets, gpus, per_node, idle=idle))
    assert len(got) == len(set(got)), "duplicate allocations"
    assert set(got) == _brute_allocations(sets, gpus, per_node, idle=idle)
    for allocation in got:
        assert sum(allocation) == gpus or idle and sum(allocation) < gpus  # with idle, the rest unused
        assert len(allocation) == sets


@pytest.mark.parametrize(("gpus", "per_node"), [(4, 4), (16, 8), (24, 8), (32, 8), (12, 8), (6, 2)])
@pytest.mark.parametrize("sets", [1, 2, 3])
def test_allocations_powers_only(sets, gpus, per_node):
    got = list(space.allocations(sets, gpus, per_node, powers_only=True))
    assert set(got) == _brute_allocations(sets, gpus, per_node, powers_only=True)
    assert all(_is_power_of_two(s) for allocation in got for s in allocation)


def test_allocations_powers_only_drop_three_node_sets():
    assert (24,) in space.allocations(1, 24, 8)
    assert list(space.allocations(1, 24, 8, powers_only=True)) == []
    assert set(space.allocations(2, 24, 8, powers_only=True)) == {(8, 16), (16, 8)}
    assert (16,) in space.allocations(1, 24, 8, powers_only=True, idle=True)  # 8 GPUs idle


def test_partial_node_remainder():
    """12 GPUs, 8 per node: one whole node and a partial node of 4."""
    assert set(space.allocations(2, 12, 8)) == {(8, 4), (4, 8)}
    assert (4, 4, 4) in set(space.allocations(3, 12, 8))
    assert (2, 2, 8) in set(space.allocations(3, 12, 8))
    assert (12,) not in set(space.allocations(1, 12, 8))  # a set is never 1.5 nodes
    # 20 GPUs: two whole nodes and a partial node of 4.
    assert {(16, 4), (4, 16), (8, 8, 4)} <= set(space.allocations(2, 20, 8)) | set(space.allocations(3, 20, 8))


@pytest.mark.parametrize(("gpus", "per_node"), [(12, 8), (20, 8), (6, 4), (7, 4), (16, 8), (3, 2)])
def test_sub_node_sets_never_straddle_a_node_when_laid_out_largest_first(gpus, per_node):
    for sets in (1, 2, 3, 4):
        for allocation in space.allocations(sets, gpus, per_node):
            for start, size in zip(set_offsets(list(allocation), per_node), allocation, strict=True):
                assert start + size <= gpus
                if size < per_node:
                    assert start // per_node == (start + size - 1) // per_node, (allocation, start, size)
                else:
                    assert start % per_node == 0, (allocation, start, size)


def test_allocations_empty_when_too_many_sets():
    assert list(space.allocations(3, 2, 2)) == []
    assert list(space.allocations(5, 4, 4)) == []


# -- layouts --------------------------------------------------------------------------------------
def _brute_layouts(arch: ModelArch, gpus: int, per_node: int, kind: str) -> set[tuple[int, int, int]]:
    training = kind == "train"
    out = set()
    for tp in range(1, gpus + 1):
        if not _is_power_of_two(tp) or tp > per_node or arch.heads % tp or arch.ffn % tp or arch.vocab % tp:
            continue
        if training and arch.kv_heads % tp:
            continue
        if not training and arch.kv_heads % tp and tp % arch.kv_heads:
            continue
        for pp in range(1, gpus + 1):
            if arch.layers % pp == 0 and gpus % (tp * pp) == 0 and (kind != "gen" or pp == 1):
                out.add((tp, pp, gpus // (tp * pp)))
    return out


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: a.name)
@pytest.mark.parametrize(("gpus", "per_node"), [(1, 8), (2, 8), (4, 4), (6, 8), (8, 8), (16, 8), (12, 4), (3, 2)])
@pytest.mark.parametrize("kind", ["train", "infer", "gen"])
def test_model_layouts_match_brute_force(arch, gpus, per_node, kind):
    got = space.model_layouts(arch, gpus, per_node, kind)
    assert len(got) == len(set(got))
    assert set(got) == _brute_layouts(arch, gpus, per_node, kind)
    for tp, pp, dp in got:
        assert tp * pp * dp == gpus
        assert tp <= per_node
        assert arch.layers % pp == 0
        assert arch.heads % tp == 0


def test_training_tp_divides_kv_heads_but_inference_may_replicate_them():
    train_tps = {tp for tp, _, _ in space.model_layouts(GQA, 8, 8, "train")}
    infer_tps = {tp for tp, _, _ in space.model_layouts(GQA, 8, 8, "infer")}
    assert train_tps == {1, 2}
    assert infer_tps == {1, 2, 4, 8}


def test_tp_stays_within_a_node():
    layouts = space.model_layouts(CATALOG["llama2-70b"], 32, 4, "train")
    assert max(tp for tp, _, _ in layouts) == 4
    assert {pp for _, pp, _ in layouts} == {1, 2, 4, 8, 16}  # pp divides 80 layers and 32 / tp: not 32
    assert all(80 % pp == 0 for _, pp, _ in layouts)


def test_qwen_tp_limited_by_fourteen_heads():
    layouts = space.model_layouts(CATALOG["qwen2.5-0.5b"], 8, 8, "train")
    assert {tp for tp, _, _ in layouts} == {1, 2}


# -- train / infer / gen configurations -----------------------------------------------------------
def _powers_up_to(n: int) -> set[int]:
    return {p for p in (2**i for i in range(12)) if p <= max(1, n)}


def _brute_modes(tp: int, dp: int, per_node: int, executable: bool) -> list[tuple[str, int | None]]:
    if dp == 1:
        return [("replicated", None)]
    modes = [("replicated", None), ("full", None)] + ([] if executable else [("zero1", None), ("zero2", None)])
    # hybrid: shard groups of one node's GPUs (per_node / tp data-parallel ranks), when that splits dp
    group = per_node // tp
    return modes + ([("hybrid", group)] if 1 < group < dp and dp % group == 0 else [])


@pytest.mark.parametrize("executable", [True, False])
@pytest.mark.parametrize("arch", [GQA, CATALOG["qwen2.5-0.5b"]], ids=lambda a: a.name)
@pytest.mark.parametrize(("gpus", "per_node", "per_step"), [(1, 8, 4), (2, 8, 8), (4, 4, 3), (8, 8, 16), (6, 8, 5),
                                                           (16, 4, 32)])
def test_train_configs(arch, gpus, per_node, per_step, executable):
    configs = space.train_configs(arch, gpus, per_node, per_step, executable)
    keys = [(c.tp, c.pp, c.dp, c.micro_batch, c.shard, c.shard_group, c.recompute, c.virtual_stages) for c in configs]
    assert len(keys) == len(set(keys)), "duplicate training configs"
    expected = set()
    for tp, pp, dp in _brute_layouts(arch, gpus, per_node, "train"):
        if per_step % dp:  # every data-parallel rank gets an equal share of a mini-batch
            continue
        for micro in _powers_up_to(math.ceil(per_step / dp)):
            # interleaved 1F1B: v equal chunks of each stage's layers, micro-batches a multiple of pp; a rank's
            # share runs as the fewest equal micro-batches of at most `micro` (the contract's split)
            share = math.ceil(per_step / dp)
            n_micro = min(n for n in range(1, share + 1) if share % n == 0 and share // n <= micro)
            chunks = [v for v in range(1, arch.layers + 1)
                      if pp > 1 and arch.layers % (pp * v) == 0 and n_micro % pp == 0] or [1]
            for shard, group in _brute_modes(tp, dp, per_node, executable):
                for recompute in ("none", "selective", "full"):
                    for v in chunks:
                        config = TrainConfig(tp=tp, pp=pp, dp=dp, micro_batch=micro, shard=shard, shard_group=group,
                                             recompute=recompute, virtual_stages=v)
                        # the executor's rule decides what hfplan's own space offers, whatever it says today
                        if not executable or unsupported_layout(arch, "train", config) is None:
                            expected.add((tp, pp, dp, micro, shard, group, recompute, v))
    assert set(keys) == expected
    for c in configs:
        assert c.tp * c.pp * c.dp == gpus


@pytest.mark.parametrize(("gpus", "sequences"), [(1, 8), (2, 5), (4, 16), (8, 3)])
def test_infer_configs_without_training_layout(gpus, sequences):
    configs = space.infer_configs(GQA, gpus, 8, sequences)
    keys = [(c.tp, c.pp, c.dp, c.micro_batch) for c in configs]
    assert len(keys) == len(set(keys))
    expected = {(tp, pp, dp, micro) for tp, pp, dp in _brute_layouts(GQA, gpus, 8, "infer") if dp <= sequences
                for micro in _powers_up_to(math.ceil(sequences / dp))}
    assert set(keys) == expected


@pytest.mark.parametrize(("gpus", "sequences"), [(2, 8), (4, 5), (8, 32)])
def test_infer_configs_of_a_trained_role_keep_the_training_layout(gpus, sequences):
    for train in space.train_configs(GQA, gpus, 8, 4):
        configs = space.infer_configs(GQA, gpus, 8, sequences, train)
        assert {(c.tp, c.pp, c.dp) for c in configs} == {(train.tp, train.pp, train.dp)}
        assert sorted(c.micro_batch for c in configs) == sorted(_powers_up_to(math.ceil(sequences / train.dp)))


@pytest.mark.parametrize("arch", [GQA, CATALOG["llama2-7b"]], ids=lambda a: a.name)
@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_gen_configs_nest_with_the_training_layout(arch, gpus):
    free = space.gen_configs(arch, gpus, 8)
    assert {(g.tp, g.pp, g.dp) for g in free} == _brute_layouts(arch, gpus, 8, "gen")
    for train in space.train_configs(arch, gpus, 8, 2):
        nested = space.gen_configs(arch, gpus, 8, train)
        expected = {(tp, pp, dp) for tp, pp, dp in _brute_layouts(arch, gpus, 8, "gen")
                    if nests(tp, train.tp) and nests(pp, train.pp)}
        assert {(g.tp, g.pp, g.dp) for g in nested} == expected
        assert (train.tp, 1, gpus // train.tp) in expected  # generating at the training tp is always possible
        for g in nested:
            assert g.tp * g.pp * g.dp == gpus


def test_gen_configs_of_a_pipelined_training_layout_run_one_stage():
    """6 layers on 6 GPUs, training pp=2: generation layouts never pipeline (pp=3 would not even nest)."""
    arch = ModelArch("six", layers=6, hidden=64, heads=1, kv_heads=1, ffn=128, vocab=100)
    train = next(t for t in space.train_configs(arch, 6, 8, 6) if (t.tp, t.pp) == (1, 2))
    layouts = {(g.tp, g.pp, g.dp) for g in space.gen_configs(arch, 6, 8, train)}
    assert layouts == {(1, 1, 6)}


@pytest.mark.parametrize(("arch", "pp", "n_micro", "counts"), [
    (GQA, 1, None, [1]),  # no pipeline, nothing to interleave
    (GQA, 2, None, [1, 3]),  # 3 layers a stage: 1 chunk of 3 or 3 of 1
    (GQA, 3, None, [1, 2]),
    (GQA, 2, 4, [1, 3]),
    (GQA, 2, 3, [1]),  # 3 micro-batches are no multiple of 2 stages: plain 1F1B only
    (CATALOG["llama2-70b"], 8, None, [1, 2, 5, 10]),  # 10 layers a stage
    (CATALOG["llama2-70b"], 8, 4, [1]),
])
def test_virtual_stage_counts_split_each_stage_into_equal_chunks(arch, pp, n_micro, counts):
    assert space.virtual_stage_counts(arch, pp, n_micro) == counts


@pytest.mark.parametrize("executable", [True, False])
def test_gen_configs_offer_each_batching_the_rule_allows(executable):
    got = {(g.tp, g.pp, g.dp, g.batching) for g in space.gen_configs(GQA, 4, 8, executable=executable)}
    expected = {(tp, pp, dp, batching) for tp, pp, dp in _brute_layouts(GQA, 4, 8, "gen")
                for batching in ("static", "continuous")
                if not executable or unsupported_layout(GQA, "gen", GenConfig(tp=tp, dp=dp, batching=batching)) is None}
    assert got == expected
    assert {b for *_, b in got} == ({"static", "continuous"} if not executable else
                                    {b for b in ("static", "continuous")
                                     if unsupported_layout(GQA, "gen", GenConfig(batching=b)) is None})


def test_train_configs_offer_every_recompute_mode_and_chunk_count_outside_the_executor():
    configs = space.train_configs(GQA, 2, 8, 2, executable=False)
    pipelined = {(c.recompute.value, c.virtual_stages) for c in configs if c.pp == 2}
    assert pipelined == {(r, v) for r in ("none", "selective", "full") for v in (1, 3)}
    flat = {(c.recompute.value, c.virtual_stages) for c in configs if c.pp == 1}
    assert flat == {(r, 1) for r in ("none", "selective", "full")}


def test_micro_batches():
    assert space.micro_batches(0) == [1]
    assert space.micro_batches(1) == [1]
    assert space.micro_batches(6) == [1, 2, 4]
    assert space.micro_batches(8) == [1, 2, 4, 8]


# -- the search's local choices of recompute, virtual stages and batching (planner/options.py) -------------------
def _context(attention: str, **workload):
    from hfplan.planner.context import SearchContext
    from hfplan.planner.strategies import Rules
    from hfplan.profiles.hardware import load_hardware
    from hfplan.simulator.trace import trace
    from tests.support.plans import small_workload

    w = small_workload(**workload)
    hw = load_hardware("a100-80g")
    hw = hw.model_copy(update={"compute": hw.compute.model_copy(update={"attention": attention})})
    return SearchContext(w, hw, 8, trace(w), Rules(executable=False))


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_training_variants_costed_are_every_non_dominated_one(attention):
    """The parts kept for each (tp, pp, dp, shard) layout are the Pareto front (seconds of each update, activation
    bytes) of every recompute mode and virtual-stage count that fits, costed one by one here."""
    from hfplan.planner.options import _pareto_parts
    from hfplan.planner.strategies import TrainPart
    from hfplan.simulator.mapping import train_memory

    ctx = _context(attention, prompt_len=1024, response_len=1024)
    w, role, gpus = ctx.workload, "actor", 8
    updates = [n for n in ctx.own_nodes(role) if n.kind == "update"]
    got = {}
    for family in ctx.options.families(role, gpus):
        t = family.trains[0].config
        got[(t.tp, t.pp, t.dp, t.shard)] = sorted((*p.seconds, p.transient) for p in family.trains)
    expected: dict[tuple, list] = {}
    for train in space.train_configs(w.arch(role), gpus, 8, w.sequences // w.mini_batches, executable=False):
        resident, transient = train_memory(w, role, train, ctx.value_bytes, attention)
        if resident + transient <= ctx.usable:
            seconds = tuple(ctx.seconds(n, role, RoleParallelism(train=train), gpus) for n in updates)
            expected.setdefault((train.tp, train.pp, train.dp, train.shard), []).append((train, seconds, transient))
    assert set(expected) >= set(got)
    pipelined = False
    for key, rows in expected.items():
        parts = [TrainPart(c, s, m) for c, s, m in rows]
        front = sorted((*p.seconds, p.transient) for p in _pareto_parts(parts, [()] * len(parts)))
        if key in got:
            assert got[key] == front  # the same cost tables: equal to the last bit
            pipelined |= key[1] > 1
    assert pipelined  # the case has interleaving to choose


def test_generation_keeps_one_batching_where_it_is_never_slower():
    """Responses of very different lengths: continuous batching is never slower than static at any KV room, so
    the generating role's options have continuous generation layouts only."""
    ctx = _context("flash", response_len=512, response_len_mean=64.0)
    options = ctx.options.choices("actor", 8).options
    assert options and {o.par.gen.batching for o in options} == {"continuous"}
