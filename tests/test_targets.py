"""Targets (hfplan/planner/targets.py): the verl search equals a brute force written here from verl 0.9.1's
trainer and configs (verl/trainer/ppo/v1/trainer_base.py's resource pools, the FSDP engine, the reward loop's
vLLM reward servers and the two generated trainer configs in verl-0.9.1-py3-none-any.whl); plans a target cannot
run are refused with the reason; workloads outside a framework are refused up front."""

from __future__ import annotations

import itertools
import math

import pytest
from test_baselines import _small_workload, check_openrlhf, model_paths  # noqa: F401 - model_paths is a fixture

from hfplan.errors import HfplanError
from hfplan.layout import ROLLOUT, unsupported_role
from hfplan.plan import GenConfig, InferConfig, RoleParallelism, TrainConfig
from hfplan.planner import space
from hfplan.planner.targets import get_target, search_target
from hfplan.simulator import engine
from hfplan.simulator.mapping import PlanCosts
from hfplan.simulator.trace import trace
from hfplan.spec import TRAINED_ROLES, load_workload, make_cluster
from tests.support.plans import build_plan, small_workload


# -- verl, as its launcher describes it -----------------------------------------------------------------
def verl_placements(roles) -> list[tuple[tuple[str, ...], ...]]:
    """One global pool for actor (with rollout and reference) and critic; the reward model in it, or in its
    own reward pool (reward.reward_model.enable_resource_pool)."""
    out = [(tuple(roles),)]
    if "reward" in roles:
        out.append((tuple(r for r in roles if r != "reward"), ("reward",)))
    return out


def verl_backends(role: str, par) -> set[str]:
    """FSDP: tp = pp = 1, weights sharded (fsdp_size -1 or a group; reshard_after_forward off = ZeRO-2), whole
    layers recomputed (enable_gradient_checkpointing) or none. Megatron: any tp, pp, virtual stages, weights
    replicated, optimizer states sharded or not (use_distributed_optimizer), recompute_granularity selective
    or full. Megatron's critic computes values with its training micro-batch."""
    if par.train is None:
        flat = (par.infer.tp, par.infer.pp) == (1, 1)
        return {"fsdp", "megatron"} if flat else {"megatron"}
    t, out = par.train, set()
    if (t.tp, t.pp) == (1, 1) and (t.dp == 1 or t.shard in ("full", "zero2", "hybrid")) and \
            t.recompute != "selective" and t.virtual_stages == 1:
        out.add("fsdp")
    if (t.dp == 1 or t.shard in ("replicated", "zero1")) and \
            (role != "critic" or par.infer.micro_batch == t.micro_batch):
        out.add("megatron")
    return out


def verl_plan_ok(workload, pars) -> bool:
    """One backend for the trained roles and the reference; the reward model is the reward loop's vLLM servers
    (reward.reward_model.rollout), outside the backend, one pipeline stage (its rollout config refuses more)."""
    per_step = workload.sequences // workload.mini_batches
    if not set.intersection(*(verl_backends(r, p) for r, p in pars.items() if r != "reward")):
        return False
    if "reward" in pars and pars["reward"].infer.pp > 1:
        return False
    return all(per_step % p.train.dp == 0 and (per_step // p.train.dp) % p.train.micro_batch == 0
               for p in pars.values() if p.train is not None)


def verl_strategies(workload, role, gpus, per_node) -> list[RoleParallelism]:
    arch = workload.arch(role)
    if role not in TRAINED_ROLES:
        return [RoleParallelism(infer=i) for i in space.infer_configs(arch, gpus, per_node, workload.sequences)]
    out = []
    for train in space.train_configs(arch, gpus, per_node, workload.sequences // workload.mini_batches,
                                     executable=False):
        # vLLM (or SGLang) generates: continuous batching only
        gens = [g for g in space.gen_configs(arch, gpus, per_node, train, executable=False)
                if g.batching == "continuous"] if role == "actor" else [None]
        for infer in space.infer_configs(arch, gpus, per_node, workload.sequences, train):
            out.extend(RoleParallelism(train=train, infer=infer, gen=g) for g in gens)
    return out


def exhaustive_verl(workload, cluster) -> tuple[float, int]:
    per_node, dag = cluster.gpus_per_node, trace(workload)
    best, tried = math.inf, 0
    for placement in verl_placements(workload.model_roles):
        for allocation in space.allocations(len(placement), cluster.gpus, per_node):
            sets = list(zip(placement, allocation, strict=True))
            names = [r for group, _ in sets for r in group]
            options = [verl_strategies(workload, r, gpus, per_node) for group, gpus in sets for r in group]
            for combo in itertools.product(*options):
                pars = dict(zip(names, combo, strict=True))
                if not verl_plan_ok(workload, pars):
                    continue
                tried += 1
                plan_costs = PlanCosts(workload, sets, pars, cluster.profile, per_node)
                if not plan_costs.infeasible_reason:
                    best = min(best, engine.run(dag, plan_costs).iteration_s)
    return best, tried


def check_verl(plan) -> None:
    roles = plan.workload.model_roles
    assert sorted(tuple(g.models) for g in plan.placement) in \
        [sorted(p) for p in verl_placements(roles)]
    assert ROLLOUT not in plan.placed_roles
    assert verl_plan_ok(plan.workload, plan.parallelism)


SMALL = {
    "ppo-2gpu": ("ppo", {"actor": "flat", "critic": "flat", "reference": "flat", "reward": "flat"}, 2, 2, 1),
    "grpo-2gpu": ("grpo", {"actor": "flat", "reference": "flat", "reward": "flat"}, 2, 2, 2),
    "remax-4gpu": ("remax", {"actor": "kv1", "reference": "kv1", "reward": "rule:vowel-fraction"}, 4, 4, 1),
}


@pytest.mark.parametrize("case", list(SMALL))
def test_verl_search_equals_exhaustive_within_its_rules(model_paths, case):  # noqa: F811
    algorithm, models, gpus, per_node, samples = SMALL[case]
    workload = _small_workload(model_paths, algorithm, models, samples)
    cluster = make_cluster(gpus, "a100-80g", per_node)
    expected, tried = exhaustive_verl(workload, cluster)
    assert 0 < tried <= 20000
    best = search_target(get_target("verl", workload), workload, cluster, top_k=1).best
    assert best.estimate.iteration_s == pytest.approx(expected, rel=1e-9)
    check_verl(best)


# -- real workloads: what --target finds obeys the framework and its own check --------------------------
REAL = [("ppo-llama2-7b", 16), ("grpo-qwen2.5-7b", 16), ("ppo-llama2-13b", 32)]


@pytest.mark.parametrize(("name", "gpus"), REAL, ids=[f"{n}-{g}" for n, g in REAL])
def test_target_plans_obey_their_framework(name, gpus):
    workload, cluster = load_workload(name), make_cluster(gpus, "a100-80g")
    for target, check in (("verl", check_verl), ("openrlhf", check_openrlhf)):
        chosen = get_target(target, workload)
        result = search_target(chosen, workload, cluster, top_k=2)
        assert [p.estimate.iteration_s for p in result.top] == sorted(p.estimate.iteration_s for p in result.top)
        for plan in result.top:
            check(plan)
            assert chosen.plan_problem(plan) is None
            gen = plan.parallelism[plan.generation_role].gen
            assert (gen.batching, gen.kv_cache) == ("continuous", "paged")  # vLLM
            assert plan.estimate.iteration_s == pytest.approx(engine.simulate_plan(plan).estimate.iteration_s)


def test_zero1_and_zero2_plans_are_for_the_targets_not_the_executor():
    """A plan with OpenRLHF's ZeRO-2 (or verl's Megatron ZeRO-1) exports; hfplan's executor refuses it, and
    hfplan's own search never returns it."""
    workload = load_workload("ppo-llama2-7b")
    zero = {shard: RoleParallelism(train=TrainConfig(dp=16, micro_batch=2, shard=shard),
                                   infer=InferConfig(dp=16, micro_batch=4)) for shard in ("zero1", "zero2")}
    for shard in zero:
        plan = build_plan(workload, [(["actor", "reference"], 16), (["critic", "reward"], 16), ([ROLLOUT], 32)],
                          tp=1, micro_batch=2, batching="continuous", kv_cache="paged",
                          overrides={"actor": zero[shard], "critic": zero[shard]})
        assert get_target("openrlhf", workload).plan_problem(plan) is None
        assert "FSDP2" in unsupported_role(workload, "actor", plan.parallelism["actor"])
    assert all(not rules.executable for target in ("verl", "openrlhf")
               for rules in get_target(target, workload).variants)
    assert get_target("hfplan", workload).variants[0].executable


# -- refusals ---------------------------------------------------------------------------------------------
def _refusal(target: str, plan) -> str:
    problem = get_target(target, plan.workload).plan_problem(plan)
    assert problem is not None
    return problem


def test_verl_refuses_a_critic_outside_the_actors_pool():
    plan = build_plan(load_workload("ppo-llama2-7b"), [(["actor", "reference", "reward"], 32), (["critic"], 32)])
    assert _refusal("verl", plan) == ("verl runs the critic in the actor's pool (trainer.nnodes x "
                                      "trainer.n_gpus_per_node; only the reward model may have a pool of its own); "
                                      "this plan puts it on its own 32 GPUs")
    plan = build_plan(load_workload("ppo-llama2-7b"), [(["actor", "reference"], 32), (["critic", "reward"], 32)])
    assert "puts it with reward on 32 GPUs" in _refusal("verl", plan)


def test_verl_refuses_a_separate_rollout_engine_and_sharded_megatron():
    workload = load_workload("ppo-llama2-7b")
    plan = build_plan(workload, [(["actor", "critic", "reference", "reward"], 32), ([ROLLOUT], 16)])
    assert "hybrid engine" in _refusal("verl", plan) and "on 16 GPUs" in _refusal("verl", plan)
    plan = build_plan(workload, [(["actor", "critic", "reference", "reward"], 32)], tp=4, gen_tp=4, shard=True)
    assert "tp=4 pp=1, shard=full" in _refusal("verl", plan)


def test_verl_recomputes_selectively_and_interleaves_only_under_megatron_and_generates_with_vllm():
    workload = small_workload()  # 16 sequences a mini-batch step; qwen2.5-0.5b has 24 layers
    sets = [(["actor", "critic", "reference", "reward"], 8)]

    def plan_of(train: TrainConfig, batching: str = "continuous", kv_cache: str = "paged"):
        actor = RoleParallelism(train=train, infer=InferConfig(tp=train.tp, pp=train.pp, dp=train.dp),
                                gen=GenConfig(tp=2, dp=4, batching=batching, kv_cache=kv_cache))
        critic = RoleParallelism(train=train, infer=InferConfig(tp=train.tp, pp=train.pp, dp=train.dp,
                                                                micro_batch=train.micro_batch))
        return build_plan(workload, sets, overrides={"actor": actor, "critic": critic, "reference": critic.model_copy(
            update={"train": None}), "reward": RoleParallelism(infer=InferConfig(dp=8))})  # vLLM: one stage

    megatron = TrainConfig(pp=2, dp=4, micro_batch=2, shard="zero1", recompute="selective", virtual_stages=3)
    assert get_target("verl", workload).plan_problem(plan_of(megatron)) is None
    fsdp_selective = TrainConfig(dp=8, micro_batch=2, shard="full", recompute="selective")
    assert "recompute=selective" in _refusal("verl", plan_of(fsdp_selective))
    assert get_target("verl", workload).plan_problem(plan_of(fsdp_selective.model_copy(
        update={"recompute": "full"}))) is None
    assert "batching=static" in _refusal("verl", plan_of(megatron, batching="static", kv_cache="reserved"))
    assert "kv_cache=reserved" in _refusal("verl", plan_of(megatron, kv_cache="reserved"))


def test_openrlhf_checkpoints_whole_layers_and_generates_with_vllm():
    workload = load_workload("ppo-llama2-7b")
    sets = [(["actor", "reference"], 16), (["critic", "reward"], 16), ([ROLLOUT], 32)]
    full = RoleParallelism(train=TrainConfig(dp=16, micro_batch=2, shard="full", recompute="full"),
                           infer=InferConfig(dp=16, micro_batch=4))
    plan = build_plan(workload, sets, tp=1, micro_batch=2, batching="continuous", kv_cache="paged",
                      overrides={"actor": full, "critic": full})
    assert get_target("openrlhf", workload).plan_problem(plan) is None
    selective = full.model_copy(update={"train": full.train.model_copy(update={"recompute": "selective"})})
    plan = build_plan(workload, sets, tp=1, micro_batch=2, batching="continuous", kv_cache="paged",
                      overrides={"actor": selective, "critic": selective})
    assert "recompute=selective" in _refusal("openrlhf", plan)
    plan = build_plan(workload, sets, tp=1, micro_batch=2, overrides={"actor": full, "critic": full})
    assert "batching=static" in _refusal("openrlhf", plan)


def test_verl_refuses_mixed_backends_and_uneven_micro_batches():
    workload = small_workload()  # 64 prompts, 4 mini-batches: 16 sequences a step
    sets = [(["actor", "critic", "reference", "reward"], 8)]
    fsdp = RoleParallelism(train=TrainConfig(dp=8, micro_batch=2, shard="full"), infer=InferConfig(dp=8),
                           gen=GenConfig(tp=2, dp=4, batching="continuous", kv_cache="paged"))
    megatron = RoleParallelism(train=TrainConfig(tp=2, dp=4, micro_batch=2, shard="zero1"),
                               infer=InferConfig(tp=2, dp=4, micro_batch=2))
    plan = build_plan(workload, sets, overrides={"actor": fsdp, "critic": megatron})
    assert "has one training backend" in _refusal("verl", plan)
    odd = RoleParallelism(train=TrainConfig(dp=8, micro_batch=2, shard="full"), infer=InferConfig(dp=8))
    plan = build_plan(small_workload(batch_prompts=48), sets, overrides={"actor": fsdp, "critic": odd})
    assert "12 sequences of a mini-batch do not split evenly over dp=8" in _refusal("verl", plan)


def test_openrlhf_refuses_what_its_flags_cannot_say():
    workload = load_workload("ppo-llama2-7b")
    plan = build_plan(workload, [(["actor", "critic"], 16), (["reference"], 8), (["reward"], 8), ([ROLLOUT], 32)],
                      tp=1)
    assert "colocates only actor with reference" in _refusal("openrlhf", plan)
    plan = build_plan(workload, [(["actor", "reference"], 16), (["critic", "reward"], 16)], tp=1)
    assert "--train.colocate_all" in _refusal("openrlhf", plan)
    plan = build_plan(workload, [(["actor", "reference"], 32), (["critic", "reward"], 16), ([ROLLOUT], 16)], tp=2)
    assert "data parallel only" in _refusal("openrlhf", plan)
    stage3 = RoleParallelism(train=TrainConfig(dp=16, micro_batch=2, shard="full"), infer=InferConfig(dp=16,
                                                                                                      micro_batch=4))
    stage2 = RoleParallelism(train=TrainConfig(dp=16, micro_batch=2, shard="zero2"), infer=InferConfig(dp=16,
                                                                                                       micro_batch=4))
    plan = build_plan(workload, [(["actor", "reference"], 16), (["critic", "reward"], 16), ([ROLLOUT], 32)], tp=1,
                      micro_batch=2, batching="continuous", kv_cache="paged",
                      overrides={"actor": stage3, "critic": stage2})
    assert _refusal("openrlhf", plan) == ("OpenRLHF has one ZeRO stage (--ds.zero_stage); this plan gives actor full "
                                          "and critic zero2")


def test_verl_serves_the_reward_model_outside_the_training_backend():
    """verl 0.9.1's reward loop serves the reward model with vLLM: a tensor-parallel reward beside FSDP roles is
    a verl plan (before, it forced Megatron on every role); a pipelined one is refused."""
    workload = small_workload()
    sets = [(["actor", "critic", "reference", "reward"], 8)]
    fsdp = RoleParallelism(train=TrainConfig(dp=8, micro_batch=2, shard="full"), infer=InferConfig(dp=8),
                           gen=GenConfig(tp=2, dp=4, batching="continuous", kv_cache="paged"))
    critic = fsdp.model_copy(update={"gen": None})
    for infer, problem in ((InferConfig(tp=2, dp=4), None), (InferConfig(pp=2, dp=4), "reward infers with pp=2")):
        plan = build_plan(workload, sets, overrides={"actor": fsdp, "critic": critic,
                                                     "reference": RoleParallelism(infer=InferConfig(dp=8)),
                                                     "reward": RoleParallelism(infer=infer)})
        found = get_target("verl", workload).plan_problem(plan)
        assert found is None if problem is None else problem in found


@pytest.mark.parametrize(("target", "workload", "needle"), [
    ("verl", "safe-rlhf-llama2-7b", "verl's main_ppo has no safe-rlhf trainer"),
    ("openrlhf", "remax-llama2-7b", "OpenRLHF's train_ppo_ray has no remax estimator"),
    ("nemo", "ppo-llama2-7b", "unknown target 'nemo'"),
])
def test_workloads_and_names_outside_a_target_are_refused(target, workload, needle):
    with pytest.raises(HfplanError, match=needle):
        get_target(target, load_workload(workload))


def test_frameworks_load_the_reference_from_the_actor():
    workload = small_workload(models={"actor": "qwen2.5-0.5b", "critic": "qwen2.5-0.5b", "reference": "qwen2.5-1.5b",
                                      "reward": "qwen2.5-0.5b"})
    for target in ("verl", "openrlhf"):
        with pytest.raises(HfplanError, match="loads the reference from the actor's model path"):
            get_target(target, workload)
