"""The shared layout and routing rules (hfplan.layout), pinned on small cases worked by hand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hfplan import layout
from hfplan.layout import (
    MESH_DIMS,
    ON_CONTROLLER,
    ROLLOUT,
    call_set,
    dp_groups,
    generation_groups,
    generation_role,
    layouts_of,
    mesh_shape,
    model_role,
    pp_groups,
    rank_coords,
    rank_of,
    resharding,
    tp_groups,
    unsupported_layout,
)
from hfplan.plan import GenConfig, InferConfig, Layout, RoleParallelism, TrainConfig
from hfplan.profiles.models import CATALOG, ModelArch
from hfplan.spec import load_workload, workload_from_dict

T2P2D2 = Layout(tp=2, pp=2, dp=2)


def test_mesh_order_is_pipeline_then_data_then_tensor():
    assert MESH_DIMS == ("pp", "dp", "tp")
    assert mesh_shape(Layout(tp=4, pp=2, dp=3)) == (2, 3, 4)


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2), (3, 2, 4), (1, 8, 1), (2, 1, 3)])
def test_rank_numbering_is_row_major_over_the_mesh(shape):
    """What torch's init_device_mesh(mesh_shape, mesh_dim_names=MESH_DIMS) does: numpy's C order."""
    pp, dp, tp = shape
    lay = Layout(tp=tp, pp=pp, dp=dp)
    for rank in range(lay.gpus):
        coords = rank_coords(lay, rank)
        assert coords == tuple(int(c) for c in np.unravel_index(rank, mesh_shape(lay)))
        assert rank_of(lay, *coords) == rank


def test_rank_out_of_range_raises():
    with pytest.raises(ValueError, match="outside"):
        rank_coords(T2P2D2, 8)
    with pytest.raises(ValueError, match="tp coordinate 2"):
        rank_of(T2P2D2, 0, 0, 2)


def test_groups_of_a_2x2x2_layout_by_hand():
    # rank = (pp * 2 + dp) * 2 + tp
    assert tp_groups(T2P2D2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp_groups(T2P2D2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pp_groups(T2P2D2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_replicas_of_a_2x2x2_layout_by_hand():
    assert layout.replica_groups(T2P2D2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.replica_groups(Layout(dp=3)) == [[0], [1], [2]]


def test_groups_of_a_flat_data_parallel_layout():
    flat = Layout(dp=4)
    assert tp_groups(flat) == [[0], [1], [2], [3]]
    assert dp_groups(flat) == [[0, 1, 2, 3]]
    assert pp_groups(flat) == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    ("train", "gen", "groups"),
    [
        # Same layout, replicated: nothing to gather.
        (TrainConfig(tp=2, dp=4, shard=False), GenConfig(tp=2, dp=4), [[r] for r in range(8)]),
        # tp 4 -> 2: pairs of adjacent tensor-parallel ranks.
        (TrainConfig(tp=4, dp=2, shard=False), GenConfig(tp=2, dp=4), [[0, 1], [2, 3], [4, 5], [6, 7]]),
        # FSDP over 8, no TP: everyone gathers the whole model.
        (TrainConfig(dp=8, shard=True), GenConfig(dp=8), [list(range(8))]),
        # tp 2 x FSDP 4, same tp for generation: the data-parallel peers of each tensor rank.
        (TrainConfig(tp=2, dp=4, shard=True), GenConfig(tp=2, dp=4), [[0, 2, 4, 6], [1, 3, 5, 7]]),
        # tp 4 x pp 2 -> tp 2, one stage: two adjacent tensor ranks of both stages (stages 4 ranks apart).
        (TrainConfig(tp=4, pp=2, shard=False), GenConfig(tp=2, dp=4), [[0, 1, 4, 5], [2, 3, 6, 7]]),
        # tp 2 x FSDP 2 -> tp 4: only the data-parallel peers.
        (TrainConfig(tp=2, dp=2, shard=True), GenConfig(tp=4), [[0, 2], [1, 3]]),
    ],
)
def test_generation_groups_by_hand(train, gen, groups):
    assert generation_groups(train, gen) == groups
    assert resharding(train, gen).group == len(groups[0])


@pytest.mark.parametrize("shard", [False, True])
def test_generation_groups_partition_the_ranks_and_size_the_resharding_cost(shard):
    for tp, pp, dp in itertools.product((1, 2, 4), (1, 2), (1, 2, 4)):
        train = TrainConfig(tp=tp, pp=pp, dp=dp, shard=shard)
        for tp_g in (1, 2, 4, 8):
            if (tp * pp * dp) % tp_g:
                continue
            gen = GenConfig(tp=tp_g, dp=tp * pp * dp // tp_g)
            groups = generation_groups(train, gen)
            assert sorted(r for g in groups for r in g) == list(range(train.gpus))
            assert {len(g) for g in groups} == {resharding(train, gen).group}


def test_non_nesting_generation_layout_has_no_groups():
    with pytest.raises(ValueError, match="does not nest"):
        generation_groups(TrainConfig(tp=4, dp=3), GenConfig(tp=3, dp=4))


# -- what the executor can run ---------------------------------------------------------------------
GQA12 = ModelArch("gqa12", layers=4, hidden=96, heads=12, kv_heads=4, ffn=144, vocab=120)


@pytest.mark.parametrize(
    ("arch", "kind", "lay", "train", "needle"),
    [
        (CATALOG["llama2-7b"], "train", Layout(tp=3), None, "32 attention heads"),
        (GQA12, "train", Layout(tp=6), None, "4 KV heads"),
        (GQA12, "infer", Layout(tp=6), None, "replicates KV heads"),
        (CATALOG["llama2-7b"], "infer", Layout(pp=3), None, "32 layers"),
        (CATALOG["llama2-7b"], "gen", Layout(pp=2), None, "pp=2"),
        (ModelArch("m", layers=4, hidden=96, heads=12, kv_heads=12, ffn=144, vocab=120), "gen", Layout(tp=3),
         TrainConfig(tp=4), "does not nest"),
        (ModelArch("m", layers=4, hidden=96, heads=4, kv_heads=4, ffn=130, vocab=120), "infer", Layout(tp=4), None,
         "MLP width 130"),
        (ModelArch("m", layers=4, hidden=96, heads=4, kv_heads=4, ffn=144, vocab=258), "train", Layout(tp=4), None,
         "vocabulary of 258"),
    ],
)
def test_unsupported_layouts_say_why(arch, kind, lay, train, needle):
    assert needle in unsupported_layout(arch, kind, lay, train)


@pytest.mark.parametrize(
    ("kind", "lay", "train"),
    [("train", TrainConfig(tp=4, pp=2), None), ("infer", InferConfig(tp=12), None),  # 3 copies of each KV head
     ("gen", GenConfig(tp=2, dp=2), TrainConfig(tp=4)), ("gen", GenConfig(tp=4), TrainConfig(tp=1, pp=2, dp=2)),
     ("gen", GenConfig(tp=2, dp=2, batching="continuous", max_batch=4), TrainConfig(tp=4)),
     *(("train", TrainConfig(tp=2, pp=2, recompute=mode), None) for mode in ("none", "selective", "full"))],
)
def test_supported_layouts(kind, lay, train):
    assert unsupported_layout(GQA12, kind, lay, train) is None


def test_a_paged_kv_cache_runs_on_vllm_which_cuts_whole_weights_over_its_own_tp_groups():
    paged = GenConfig(tp=2, dp=2, batching="continuous", kv_cache="paged")
    assert paged.engine == "vllm"
    assert unsupported_layout(GQA12, "gen", paged, TrainConfig(tp=2, dp=2)) is None  # the training tp: whole weights
    assert unsupported_layout(GQA12, "gen", GenConfig(dp=4, engine="vllm"), TrainConfig(tp=4)) is None  # tp 1: whole
    assert "engine=vllm at tp=2" in unsupported_layout(GQA12, "gen", paged, TrainConfig(tp=4))  # pre-cut shards
    assert "engine=vllm at tp=2" in unsupported_layout(GQA12, "gen", paged)  # a rollout set's synced shards


def test_batches_split_over_data_parallel_ranks():
    assert layout.unsupported_split("train", 4, 8) is None
    assert "6 sequences of a mini-batch do not split evenly over dp=4" in layout.unsupported_split("train", 4, 6)
    assert layout.unsupported_split("gen", 4, 4) is None and layout.unsupported_split("infer", 2, 3) is None
    assert "dp=4 gen replicas but only 2 prompts" in layout.unsupported_split("gen", 4, 2)
    w = workload_from_dict({"algorithm": "ppo", "models": {"actor": "tiny", "critic": "tiny", "reference": "tiny",
                                                          "reward": "rule:vowel-fraction"},
                           "prompt_len": 16, "response_len": 16, "batch_prompts": 2, "mini_batches": 1}, "test")
    assert (layout.split_rows(w, "gen"), layout.split_rows(w, "infer"), layout.split_rows(w, "train")) == (2, 2, 2)
    many = RoleParallelism(train=TrainConfig(dp=4), infer=InferConfig(dp=4), gen=GenConfig(dp=4))
    assert layout.unsupported_role(w, "actor", many).startswith("actor train layout: the 2 sequences")


# -- routing ---------------------------------------------------------------------------------------
def test_routing_of_a_ppo_workload_with_a_rule_reward():
    w = workload_from_dict({"algorithm": "ppo", "models": {"actor": "tiny", "critic": "tiny", "reference": "tiny",
                                                          "reward": "rule:vowel-fraction"},
                           "prompt_len": 16, "response_len": 16}, "test")
    hybrid = [("actor", "reference"), ("critic",)]
    assert generation_role(w, ["actor", "reference", "critic"]) == "actor"
    assert call_set(w, hybrid, "actor", "generate") == 0
    assert call_set(w, hybrid, "critic", "values") == 1
    assert call_set(w, hybrid, "reward", "score") == ON_CONTROLLER
    assert call_set(w, hybrid, layout.CONTROLLER, "gae") == ON_CONTROLLER
    separate = [("actor", "reference"), ("critic",), (ROLLOUT,)]
    assert call_set(w, separate, "actor", "generate") == 2
    assert call_set(w, separate, "actor", "log_prob") == 0
    assert model_role(w, ROLLOUT) == "actor" and model_role(w, "critic") == "critic"


def test_layouts_each_placed_role_runs_in():
    w = load_workload("ppo-llama2-7b")
    assert layouts_of(w, "actor", "actor") == ("train", "infer", "gen")
    assert layouts_of(w, "actor", ROLLOUT) == ("train", "infer")
    assert layouts_of(w, ROLLOUT, ROLLOUT) == ("gen",)
    assert layouts_of(w, "critic", "actor") == ("train", "infer")
    assert layouts_of(w, "reference", "actor") == ("infer",)


def test_data_moves_set_to_set_or_through_the_host_when_the_controller_is_an_end():
    assert layout.transfer_path(1, 1) == "none"
    assert layout.transfer_path(0, 2) == "direct"
    assert layout.transfer_path(ON_CONTROLLER, 0) == layout.transfer_path(3, ON_CONTROLLER) == "host"
    assert layout.transfer_path(ON_CONTROLLER, ON_CONTROLLER) == "none"


def test_plan_pre_flight_names_the_role_and_layout():
    w = load_workload("ppo-llama2-7b")
    fine = RoleParallelism(train=TrainConfig(tp=2, dp=4), infer=InferConfig(tp=2, dp=4), gen=GenConfig(tp=4, dp=2))
    assert layout.unsupported_role(w, "actor", fine) is None
    piped = RoleParallelism(train=TrainConfig(tp=2, pp=2, dp=2), infer=InferConfig(tp=2, pp=2, dp=2),
                            gen=GenConfig(tp=2, pp=2, dp=2))
    assert layout.unsupported_role(w, "actor", piped).startswith("actor gen layout: generation with pp=2")
    assert "rollout gen layout" in layout.unsupported_role(w, ROLLOUT, RoleParallelism(gen=GenConfig(tp=3)))


def test_plan_routing_delegates_to_the_layout_rules():
    from tests.support.plans import build_plan

    w = load_workload("demo")
    plan = build_plan(w, [(["actor", "reference"], 2), (["critic"], 1)])
    assert plan.call_set("critic", "values") == 1 and plan.call_set("reward", "score") == ON_CONTROLLER
    assert plan.call_set("actor", "generate") == 0 and plan.generation_role == "actor"


@pytest.mark.parametrize("rollout", [False, True])
def test_the_search_returns_only_plans_the_executor_can_run(rollout):
    from hfplan.planner.search import search
    from hfplan.planner.strategies import Rules
    from hfplan.spec import make_cluster

    w = workload_from_dict({"algorithm": "grpo", "models": {r: "qwen2.5-0.5b" for r in ("actor", "reference",
                                                                                      "reward")},
                            "prompt_len": 256, "response_len": 256, "batch_prompts": 16, "samples_per_prompt": 4,
                            "mini_batches": 2}, "test")
    roles = (*w.model_roles, ROLLOUT) if rollout else w.model_roles
    rules = Rules("apart", placements=(tuple((r,) for r in roles),), rollout=rollout) if rollout else None
    for plan in search(w, make_cluster(8), top_k=5, rules=rules).top:
        for role, par in plan.parallelism.items():
            assert layout.unsupported_role(w, role, par) is None, (role, par)


@pytest.mark.parametrize(("kv_heads", "tp", "copies", "per_rank"),
                         [(8, 1, 1, 8), (8, 2, 1, 4), (8, 8, 1, 1), (2, 4, 2, 1), (1, 8, 8, 1), (4, 4, 1, 1)])
def test_kv_heads_per_rank_splits_or_copies_whole_heads(kv_heads, tp, copies, per_rank):
    assert layout.kv_head_copies(kv_heads, tp) == copies
    assert layout.kv_heads_per_rank(kv_heads, tp) == per_rank
    assert per_rank * tp == kv_heads * copies  # every (copied) head on exactly one rank


@pytest.mark.parametrize(("kv_heads", "tp"), [(6, 4), (3, 2), (4, 6)])
def test_kv_heads_per_rank_refuses_a_tp_that_neither_divides_nor_multiplies_them(kv_heads, tp):
    with pytest.raises(ValueError, match="KV heads"):
        layout.kv_heads_per_rank(kv_heads, tp)
