"""Other systems' fixed mappings (hfplan/planner/baselines.py): each plan obeys its system's rules, the
search within those rules finds the same optimum as a brute-force enumeration written here from the
systems' descriptions, and hfplan's own search (a superset of the colocated mappings) is never slower
than the colocated ones."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from support import deadline as _deadline

from hfplan.plan import ROLLOUT, RoleParallelism, plan_from_dict
from hfplan.planner import space
from hfplan.planner.baselines import baselines, compare
from hfplan.planner.search import search
from hfplan.simulator import engine
from hfplan.simulator.mapping import PlanCosts
from hfplan.simulator.trace import trace
from hfplan.spec import ALGORITHM_ROLES, TRAINED_ROLES, load_workload, make_cluster, workload_from_dict

NEMO, DEEPSPEED, OPENRLHF = "NeMo-Aligner-like", "DeepSpeed-Chat-like", "OpenRLHF-like"
RULE = "rule:vowel-fraction"


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _layout(x) -> tuple[int, int, int]:
    return (x.tp, x.pp, x.dp)


def _zero3(train) -> bool:
    """ZeRO-3: no tensor or pipeline parallelism; states sharded over the data ranks (one rank: nothing to
    shard)."""
    return train.tp == 1 and train.pp == 1 and (train.shard or train.dp == 1)


# -- rules, as the systems are described ----------------------------------------------------------
def check_nemo(plan) -> None:
    """All roles colocated on all GPUs; Megatron 3D parallelism (weights replicated over data ranks);
    the actor generates in its training layout."""
    assert len(plan.placement) == 1
    assert sorted(plan.placement[0].models) == sorted(plan.workload.model_roles)
    assert plan.placement[0].gpus == plan.cluster.gpus
    for role, par in plan.parallelism.items():
        if role in TRAINED_ROLES:
            assert par.train.shard is False, role
    actor = plan.parallelism["actor"]
    assert _layout(actor.gen) == _layout(actor.train)


def check_deepspeed(plan) -> None:
    """All roles colocated; ZeRO-3 training (tp = pp = 1, sharded over the data ranks); the whole actor on
    every GPU for generation (gen tp = pp = 1)."""
    assert len(plan.placement) == 1
    assert sorted(plan.placement[0].models) == sorted(plan.workload.model_roles)
    assert plan.placement[0].gpus == plan.cluster.gpus
    for role, par in plan.parallelism.items():
        if role in TRAINED_ROLES:
            assert _zero3(par.train), role
    gen = plan.parallelism["actor"].gen
    assert (gen.tp, gen.pp, gen.dp) == (1, 1, plan.cluster.gpus)


def check_openrlhf(plan) -> None:
    """Every role alone on a power-of-two group, plus a separate rollout engine that generates."""
    groups = sorted(tuple(g.models) for g in plan.placement)
    assert groups == sorted([(r,) for r in plan.workload.model_roles] + [(ROLLOUT,)])
    assert all(_is_power_of_two(g.gpus) for g in plan.placement)
    assert sum(g.gpus for g in plan.placement) == plan.cluster.gpus
    rollout = plan.parallelism[ROLLOUT]
    assert rollout.gen is not None and rollout.train is None and rollout.infer is None
    assert plan.parallelism["actor"].gen is None
    assert plan.generation_role == ROLLOUT
    for role, par in plan.parallelism.items():
        if role in TRAINED_ROLES:
            assert _zero3(par.train), role


CHECKS = {NEMO: check_nemo, DEEPSPEED: check_deepspeed, OPENRLHF: check_openrlhf}


# -- real workloads -------------------------------------------------------------------------------
REAL = [("ppo-llama2-7b", 16), ("ppo-llama2-7b", 64), ("grpo-qwen2.5-1.5b", 8), ("remax-llama2-7b", 32),
        ("ppo-qwen2.5-0.5b", 8), ("grpo-llama2-7b", 32)]
_REAL_CACHE: dict = {}


def real(name: str, gpus: int):
    if (name, gpus) not in _REAL_CACHE:
        workload, cluster = load_workload(name), make_cluster(gpus, "a100-80g")
        best = search(workload, cluster, top_k=1).best
        _REAL_CACHE[(name, gpus)] = (workload, cluster, best, {r.baseline.name: r for r in compare(workload, cluster)})
    return _REAL_CACHE[(name, gpus)]


def test_three_systems_in_order():
    names = [b.name for b in baselines(load_workload("ppo-llama2-7b"))]
    assert names == [NEMO, DEEPSPEED, OPENRLHF]
    assert all(b.description for b in baselines(load_workload("ppo-llama2-7b")))


@pytest.mark.parametrize(("name", "gpus"), REAL, ids=[f"{n}-{g}" for n, g in REAL])
def test_baseline_plans_obey_their_rules(name, gpus):
    workload, cluster, _, results = real(name, gpus)
    assert set(results) == set(CHECKS)
    for system, result in results.items():
        assert result.plan is not None, (system, result.reason)
        plan = result.plan
        CHECKS[system](plan)
        assert plan_from_dict(json.loads(plan.to_json()), system) == plan  # a valid plan
        assert plan.workload == workload and plan.cluster == cluster
        simulated = engine.simulate_plan(plan).estimate
        assert result.iteration_s == pytest.approx(simulated.iteration_s, rel=1e-12)


@pytest.mark.parametrize(("name", "gpus"), REAL, ids=[f"{n}-{g}" for n, g in REAL])
def test_hfplan_never_slower_than_the_colocated_systems(name, gpus):
    """hfplan's space contains both colocated mappings (one set, any layout), so its optimum is no worse."""
    _, _, best, results = real(name, gpus)
    for system in (NEMO, DEEPSPEED):
        assert best.estimate.iteration_s <= results[system].iteration_s * (1 + 1e-9), system


def test_openrlhf_needs_a_group_per_role():
    """PPO's four models and a rollout engine need five groups: on 4 GPUs only hfplan's mappings fit."""
    workload, cluster = load_workload("ppo-qwen2.5-0.5b"), make_cluster(4, "a100-80g")
    results = {r.baseline.name: r for r in compare(workload, cluster)}
    assert results[OPENRLHF].plan is None and results[OPENRLHF].iteration_s is None
    assert results[OPENRLHF].reason
    assert results[NEMO].plan is not None and results[DEEPSPEED].plan is not None
    best = search(workload, cluster, top_k=1).best
    assert best.estimate.iteration_s <= min(results[NEMO].iteration_s, results[DEEPSPEED].iteration_s) * (1 + 1e-9)


# -- exhaustive search within each system's rules -------------------------------------------------
MODEL_CONFIGS = {
    "kv1": {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 4096, "vocab_size": 32000},
    "wide": {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 4,
             "intermediate_size": 4096, "vocab_size": 32000},
    "flat": {"num_hidden_layers": 1, "hidden_size": 1024, "num_attention_heads": 1, "num_key_value_heads": 1,
             "intermediate_size": 4096, "vocab_size": 32000},
}


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("baseline-models")
    paths = {}
    for name, fields in MODEL_CONFIGS.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **fields}))
        paths[name] = str(path)
    return paths


def _train_ok(system: str, train) -> bool:
    if system == NEMO:
        return not train.shard
    return _zero3(train)  # DeepSpeed-Chat, OpenRLHF


def _gen_ok(system: str, train, gen) -> bool:
    if system == NEMO:
        return _layout(gen) == _layout(train)
    if system == DEEPSPEED:
        return gen.tp == 1 and gen.pp == 1
    return True


def system_strategies(workload, role: str, gpus: int, per_node: int, system: str) -> list[RoleParallelism]:
    if role == ROLLOUT:
        return [RoleParallelism(gen=gen) for gen in space.gen_configs(workload.arch("actor"), gpus, per_node)]
    arch = workload.arch(role)
    if role not in TRAINED_ROLES:
        return [RoleParallelism(infer=i) for i in space.infer_configs(arch, gpus, per_node, workload.sequences)]
    out = []
    for train in space.train_configs(arch, gpus, per_node, workload.sequences // workload.mini_batches):
        if not _train_ok(system, train):
            continue
        generates = role == "actor" and system != OPENRLHF
        gens = [g for g in space.gen_configs(arch, gpus, per_node, train) if _gen_ok(system, train, g)] \
            if generates else [None]
        for infer in space.infer_configs(arch, gpus, per_node, workload.sequences, train):
            out.extend(RoleParallelism(train=train, infer=infer, gen=gen) for gen in gens)
    return out


def exhaustive_system(workload, cluster, system: str) -> tuple[float, int]:
    """(best iteration time, strategy choices tried) of one system's mappings, by brute force."""
    per_node, dag = cluster.gpus_per_node, trace(workload)
    roles = tuple(workload.model_roles)
    if system == OPENRLHF:
        placement = tuple((r,) for r in roles) + ((ROLLOUT,),)
        allocations = list(space.allocations(len(placement), cluster.gpus, per_node, powers_only=True))
    else:
        placement, allocations = (roles,), [(cluster.gpus,)]
    best, tried = math.inf, 0
    for allocation in allocations:
        sets = list(zip(placement, allocation, strict=True))
        names = [r for group, _ in sets for r in group]
        options = [system_strategies(workload, r, gpus, per_node, system) for group, gpus in sets for r in group]
        for combo in itertools.product(*options):
            tried += 1
            plan_costs = PlanCosts(workload, sets, dict(zip(names, combo, strict=True)), cluster.profile, per_node)
            if plan_costs.infeasible_reason:
                continue
            best = min(best, engine.run(dag, plan_costs).iteration_s)
    return best, tried


SMALL = {
    "ppo-4gpu": ("ppo", {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": "flat"}, 4, 4, 1),
    "ppo-8gpu-2nodes": ("ppo", {"actor": "wide", "critic": "flat", "reference": "flat", "reward": RULE}, 8, 4, 1),
    "grpo-4gpu": ("grpo", {"actor": "wide", "reference": "flat", "reward": "flat"}, 4, 2, 2),
    "remax-4gpu": ("remax", {"actor": "kv1", "reference": "kv1", "reward": RULE}, 4, 4, 1),
    "safe-rlhf-4gpu": ("safe-rlhf", {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": RULE,
                                     "cost": RULE, "cost_critic": "flat"}, 4, 4, 1),
}


def _small_workload(model_paths, algorithm, models, samples):
    spec = {"algorithm": algorithm, "models": {r: m if m.startswith("rule:") else model_paths[m]
                                               for r, m in models.items()},
            "prompt_len": 512, "response_len": 512, "batch_prompts": 4, "samples_per_prompt": samples,
            "mini_batches": 2}
    assert set(spec["models"]) == set(ALGORITHM_ROLES[algorithm])
    return workload_from_dict(spec, "test")


@pytest.mark.parametrize("case", list(SMALL))
def test_each_system_search_equals_exhaustive_within_its_rules(model_paths, case):
    algorithm, models, gpus, per_node, samples = SMALL[case]
    workload = _small_workload(model_paths, algorithm, models, samples)
    cluster = make_cluster(gpus, "a100-80g", per_node)
    results = {r.baseline.name: r for r in compare(workload, cluster)}
    own = search(workload, cluster, top_k=1).best.estimate.iteration_s
    for system in CHECKS:
        expected, tried = exhaustive_system(workload, cluster, system)
        assert tried <= 20000
        got = results[system].iteration_s
        if expected == math.inf:
            assert got is None and results[system].reason, system
            continue
        assert got == pytest.approx(expected, rel=1e-9), system
        CHECKS[system](results[system].plan)
        if system != OPENRLHF:
            assert own <= got * (1 + 1e-9), system


@pytest.mark.slow
def test_comparison_of_a_six_role_workload_is_prompt():
    """`hfplan search` compares by default: the colocated six-role mappings once took minutes (millions of
    complete strategy choices in one set), far longer than hfplan's own search."""
    workload, cluster = load_workload("safe-rlhf-llama2-7b"), make_cluster(8, "a100-80g")
    with _deadline(30):
        results = compare(workload, cluster)
    assert {r.baseline.name for r in results} == set(CHECKS)
