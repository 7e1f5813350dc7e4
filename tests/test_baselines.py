"""Other systems' mappings (hfplan/planner/baselines.py): each plan obeys its system's rules, the
search within those rules finds the same optimum as a brute-force enumeration written here from the
systems' descriptions (OpenRLHF's from openrlhf/cli/train_ppo_ray.py in openrlhf 0.11.2), and hfplan's own
search (a superset of the colocated mappings) is never slower than the colocated ones."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from hfplan.layout import unsupported_role
from hfplan.plan import ROLLOUT, RoleParallelism, plan_from_dict
from hfplan.planner import space
from hfplan.planner.baselines import baselines, compare
from hfplan.planner.search import search
from hfplan.planner.strategies import Rules
from hfplan.simulator import engine
from hfplan.simulator.mapping import PlanCosts
from hfplan.simulator.trace import trace
from hfplan.spec import ALGORITHM_ROLES, TRAINED_ROLES, load_workload, make_cluster, workload_from_dict
from tests.support.cli import deadline as _deadline

NEMO, DEEPSPEED, OPENRLHF = "NeMo-Aligner-like", "DeepSpeed-Chat-like", "OpenRLHF"
ZERO = ("replicated", "zero1", "zero2", "full")  # --ds.zero_stage 0..3
RULE = "rule:vowel-fraction"


def _layout(x) -> tuple[int, int, int]:
    return (x.tp, x.pp, x.dp)


def _zero3(train) -> bool:
    """ZeRO-3: no tensor or pipeline parallelism; states sharded over the data ranks (one rank: nothing to
    shard)."""
    return train.tp == 1 and train.pp == 1 and (train.shard == "full" or train.dp == 1)


# -- rules, as the systems are described ----------------------------------------------------------
def check_nemo(plan) -> None:
    """All roles colocated on all GPUs; Megatron 3D parallelism (weights replicated over data ranks);
    the actor generates in its training layout."""
    assert len(plan.placement) == 1
    assert sorted(plan.placement[0].models) == sorted(plan.workload.model_roles)
    assert plan.placement[0].gpus == plan.cluster.gpus
    for role, par in plan.parallelism.items():
        if role in TRAINED_ROLES:
            assert par.train.shard in ("replicated", "zero1"), role
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


def openrlhf_placements(roles) -> list[tuple[tuple[str, ...], ...]]:
    """Everything on the actor's GPUs (--train.colocate_all, vLLM inside), or vLLM engines apart with actor
    and reference together or not (--train.colocate_actor_ref), critic and reward together or not
    (--train.colocate_critic_reward)."""
    out = [(tuple(roles),)]
    pairs = [p for p in (("actor", "reference"), ("critic", "reward")) if all(r in roles for r in p)]
    for joined in itertools.product((False, True), repeat=len(pairs)):
        together = [p for p, j in zip(pairs, joined, strict=True) if j]
        alone = [(r,) for r in roles if not any(r in p for p in together)]
        out.append(tuple(together) + tuple(alone) + ((ROLLOUT,),))
    return out


def openrlhf_settings_agree(workload, pars: dict) -> bool:
    """One ZeRO stage (ranks > 1), one training micro-batch and gradient-checkpointing flag for the trained
    roles, one forward micro-batch for every model; whole micro-batches, equal shares; at least one
    forward micro-batch per actor GPU."""
    trained = [p.train for p in pars.values() if p.train is not None]
    infers = [p.infer for p in pars.values() if p.infer is not None]
    per_step = workload.sequences // workload.mini_batches
    actor = pars["actor"].infer
    return (len({t.shard for t in trained if t.dp > 1}) <= 1 and len({t.micro_batch for t in trained}) <= 1
            and len({t.recompute for t in trained}) <= 1 and len({i.micro_batch for i in infers}) <= 1
            and all(per_step % (t.dp * t.micro_batch) == 0 for t in trained)
            and workload.sequences // actor.micro_batch >= actor.dp)


def check_openrlhf(plan) -> None:
    groups = sorted(tuple(sorted(g.models)) for g in plan.placement)
    allowed = [sorted(tuple(sorted(s)) for s in p) for p in openrlhf_placements(plan.workload.model_roles)]
    assert groups in allowed
    if len(plan.placement) > 1:
        rollout = plan.parallelism[ROLLOUT]
        assert rollout.gen is not None and rollout.train is None and rollout.infer is None
        assert plan.parallelism["actor"].gen is None
        assert plan.generation_role == ROLLOUT
    for role, par in plan.parallelism.items():
        for layout in (par.train, par.infer):
            assert layout is None or (layout.tp, layout.pp) == (1, 1), role
        if par.train is not None:
            assert par.train.shard in ZERO, role
    assert openrlhf_settings_agree(plan.workload, plan.parallelism)


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
        if system == OPENRLHF and workload.algorithm == "remax":
            assert result.plan is None and "no remax estimator" in result.reason
            continue
        assert result.plan is not None, (system, result.reason)
        plan = result.plan
        CHECKS[system](plan)
        assert plan_from_dict(json.loads(plan.to_json()), system) == plan  # a valid plan
        assert plan.workload == workload and plan.cluster == cluster
        simulated = engine.simulate_plan(plan).estimate
        assert result.iteration_s == pytest.approx(simulated.iteration_s, rel=1e-12)


@pytest.mark.parametrize(("name", "gpus"), REAL, ids=[f"{n}-{g}" for n, g in REAL])
def test_hfplan_never_slower_than_the_colocated_systems(name, gpus):
    """hfplan's space contains both colocated mappings (one set, any layout) where hfplan's executor runs their
    layouts, so there its optimum is no worse; a mapping it cannot run (NeMo's distributed optimizer is ZeRO-1,
    outside the executor: hfplan.layout.unsupported_layout) lies in its space without the executor's limits
    (Rules.executable), whose optimum is no worse."""
    workload, cluster, best, results = real(name, gpus)
    unlimited = None
    for system in (NEMO, DEEPSPEED):
        plan = results[system].plan
        runs = all(unsupported_role(workload, role, par) is None for role, par in plan.parallelism.items())
        if not runs and unlimited is None:
            unlimited = search(workload, cluster, top_k=1, rules=Rules(idle_gpus=True, executable=False)).best
        ours = best if runs else unlimited
        assert ours.estimate.iteration_s <= results[system].iteration_s * (1 + 1e-9), system


def test_openrlhf_runs_ppo_and_grpo_only():
    """train_ppo_ray's estimators: gae (PPO) and group_norm (GRPO) among those hfplan models; ReMax's and
    Safe-RLHF's workloads get the reason instead of a plan."""
    for name in ("remax-qwen2.5-0.5b", "safe-rlhf-qwen2.5-0.5b"):
        workload = load_workload(name)
        result = next(r for r in compare(workload, make_cluster(8, "a100-80g")) if r.baseline.name == OPENRLHF)
        assert result.plan is None and f"no {workload.algorithm} estimator" in result.reason


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
        return train.shard in ("replicated", "zero1")
    if system == OPENRLHF:
        return train.tp == 1 and train.pp == 1 and train.shard in ZERO
    return _zero3(train)


def _gen_ok(system: str, train, gen) -> bool:
    if system == NEMO:
        return _layout(gen) == _layout(train)
    if system == DEEPSPEED:
        return gen.tp == 1 and gen.pp == 1
    return True


def system_strategies(workload, role: str, gpus: int, per_node: int, system: str,
                      generates: bool) -> list[RoleParallelism]:
    if role == ROLLOUT:
        return [RoleParallelism(gen=gen) for gen in space.gen_configs(workload.arch("actor"), gpus, per_node)]
    arch = workload.arch(role)
    if role not in TRAINED_ROLES:
        return [RoleParallelism(infer=i) for i in space.infer_configs(arch, gpus, per_node, workload.sequences)
                if system != OPENRLHF or (i.tp, i.pp) == (1, 1)]
    out = []
    steps = workload.sequences // workload.mini_batches
    for train in space.train_configs(arch, gpus, per_node, steps, executable=False):
        if not _train_ok(system, train):
            continue
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
        placements = openrlhf_placements(roles)
    else:
        placements = [(roles,)]
    best, tried = math.inf, 0
    for placement, allocation in ((p, a) for p in placements
                                  for a in space.allocations(len(p), cluster.gpus, per_node)):
        sets = list(zip(placement, allocation, strict=True))
        names = [r for group, _ in sets for r in group]
        hybrid = ROLLOUT not in names
        options = [system_strategies(workload, r, gpus, per_node, system, generates=r == "actor" and hybrid)
                   for group, gpus in sets for r in group]
        for combo in itertools.product(*options):
            pars = dict(zip(names, combo, strict=True))
            if system == OPENRLHF and not openrlhf_settings_agree(workload, pars):
                continue
            tried += 1
            plan_costs = PlanCosts(workload, sets, pars, cluster.profile, per_node)
            if plan_costs.infeasible_reason:
                continue
            best = min(best, engine.run(dag, plan_costs).iteration_s)
    return best, tried


SMALL = {
    "ppo-4gpu": ("ppo", {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": "flat"}, 4, 4, 1),
    "ppo-8gpu-2nodes": ("ppo", {"actor": "wide", "critic": "flat", "reference": "flat", "reward": RULE}, 8, 4, 1),
    "grpo-4gpu": ("grpo", {"actor": "wide", "reference": "flat", "reward": "flat"}, 4, 2, 2),
    # OpenRLHF loads the reference from the actor's path: these share one model
    "ppo-4gpu-one-reference": ("ppo", {"actor": "kv1", "critic": "flat", "reference": "kv1", "reward": "flat"}, 4, 4,
                               1),
    "grpo-4gpu-one-reference": ("grpo", {"actor": "wide", "reference": "wide", "reward": "flat"}, 4, 2, 2),
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
        if system == OPENRLHF and algorithm not in ("ppo", "grpo"):
            assert results[system].plan is None and f"no {algorithm} estimator" in results[system].reason
            continue
        if system == OPENRLHF and models["reference"] != models["actor"]:
            assert results[system].plan is None and "reference from the actor's model" in results[system].reason
            continue
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
