"""Programs of other shapes than the built-in algorithms: the search's best and top-K equal exhaustive
enumeration and the simpy engine, for generation after preparation (two generations), a reward scored
before the log-probs, and an update followed by another generation, with the hybrid engine and with a
separate rollout engine (whose weight sync is paid again after the update)."""

from __future__ import annotations

import itertools
import math

import pytest

from hfplan.dataflow.ops import GENERATED as SEQ
from hfplan.dataflow.registry import Algorithm, get_algorithm, register_algorithm, unregister_algorithm
from hfplan.layout import ROLLOUT
from hfplan.plan import Plan, RoleParallelism
from hfplan.planner import space
from hfplan.planner.search import search
from hfplan.planner.strategies import Rules
from hfplan.simulator import engine
from hfplan.simulator.mapping import PlanCosts
from hfplan.simulator.trace import trace
from tests.support.search_references import Case, Lab, exhaustive


def late_greedy(roles, prompts, ctl):
    """The issue's example: a greedy generation after the preparation calls."""
    actor, critic, reference, reward = (roles[r] for r in ("actor", "critic", "reference", "reward"))
    batch = actor.generate(prompts)
    seqs = batch.select(*SEQ)
    batch = batch | actor.log_prob(seqs) | reference.log_prob(seqs) | critic.values(seqs) | reward.score(seqs)
    greedy = actor.generate(prompts, greedy=True)
    batch = batch | reward.score(greedy.select(*SEQ)).rename(rewards="baseline_rewards")
    batch = batch | ctl.step("gae", batch)
    return (critic.update(batch.select(*SEQ, "values", "returns"))
            | actor.update(batch.select(*SEQ, "old_log_probs", "advantages")))


def score_first(roles, prompts, ctl):
    actor, critic, reference, reward = (roles[r] for r in ("actor", "critic", "reference", "reward"))
    batch = actor.generate(prompts)
    seqs = batch.select(*SEQ)
    batch = batch | reward.score(seqs)
    batch = batch | actor.log_prob(seqs) | reference.log_prob(seqs) | critic.values(seqs)
    batch = batch | ctl.step("gae", batch)
    return (actor.update(batch.select(*SEQ, "old_log_probs", "advantages"))
            | critic.update(batch.select(*SEQ, "values", "returns")))


def regenerate(roles, prompts, ctl):
    """PPO, then a fresh generation with the updated actor, scored (an evaluation pass)."""
    metrics = get_algorithm("ppo").program(roles, prompts, ctl)
    fresh = roles["actor"].generate(prompts)
    return metrics | roles["reward"].score(fresh.select(*SEQ)).rename(rewards="eval_rewards")


PPO_ROLES = get_algorithm("ppo").roles
SHAPES = {"late-greedy": late_greedy, "score-first": score_first, "regenerate": regenerate}
MODELS = {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": "flat"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    for name, program in SHAPES.items():
        register_algorithm(Algorithm(name, program, PPO_ROLES))
    yield Lab(tmp_path_factory.mktemp("shapes"))
    for name in SHAPES:
        unregister_algorithm(name)


def _case(shape: str, gpus: int = 2) -> Case:
    return Case(shape, MODELS, gpus, 2, top_k=4)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_hybrid_search_equals_exhaustive(lab, shape):
    case = _case(shape)
    workload, cluster = lab.workload(case), lab.cluster(case)
    reference = exhaustive(workload, cluster)
    result = search(workload, cluster, top_k=case.top_k)  # raises if its fast schedule disagrees with simpy
    expected = sorted(r.best_s for r in reference.values() if r.best_s < math.inf)[:case.top_k]
    assert [p.estimate.iteration_s for p in result.top] == pytest.approx(expected, rel=1e-9)
    for plan in result.top:
        assert engine.simulate_plan(plan).timeline.iteration_s == pytest.approx(plan.estimate.iteration_s, rel=1e-12)


def _rollout_strategies(workload, role, gpus, per_node):
    actor_arch = workload.arch("actor")
    if role == ROLLOUT:
        return [RoleParallelism(gen=g) for g in space.gen_configs(actor_arch, gpus, per_node)]
    arch = workload.arch(role)
    if not PPO_ROLES[role].trains:
        return [RoleParallelism(infer=i) for i in space.infer_configs(arch, gpus, per_node, workload.sequences)]
    return [RoleParallelism(train=t, infer=i)
            for t in space.train_configs(arch, gpus, per_node, workload.sequences // workload.mini_batches)
            for i in space.infer_configs(arch, gpus, per_node, workload.sequences, t)]


ROLLOUT_PLACEMENT = (("actor", "critic", "reference", "reward"), (ROLLOUT,))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rollout_search_equals_exhaustive(lab, shape):
    case = _case(shape, gpus=3)
    workload, cluster = lab.workload(case), lab.cluster(case)
    per_node, dag = cluster.gpus_per_node, trace(workload)
    best = {}
    for allocation in space.allocations(2, cluster.gpus, per_node):
        sets = list(zip(ROLLOUT_PLACEMENT, allocation, strict=True))
        roles = [r for group, _ in sets for r in group]
        options = [_rollout_strategies(workload, r, g, per_node) for group, g in sets for r in group]
        times = []
        for combo in itertools.product(*options):
            costs = PlanCosts(workload, sets, dict(zip(roles, combo, strict=True)), cluster.profile, per_node)
            if not costs.infeasible_reason:
                times.append(engine.run(dag, costs).iteration_s)
        if times:
            best[allocation] = min(times)
    rules = Rules("rollout-test", placements=(ROLLOUT_PLACEMENT,), rollout=True)
    result = search(workload, cluster, top_k=2, rules=rules)
    assert [p.estimate.iteration_s for p in result.top] == pytest.approx(sorted(best.values())[:2], rel=1e-9)


def _switches(plan: Plan) -> list[str]:
    return [s.role for s in engine.simulate_plan(plan).timeline.spans if s.kind == "transition"]


def test_a_generation_after_an_update_pays_the_switch_again(lab):
    """Hybrid engine: the actor reshards before each generation that follows a training-layout call.
    Rollout engine: the weights are synced before the first generation and again after the update."""
    workload = lab.workload(_case("regenerate"))
    cluster = lab.cluster(_case("regenerate"))
    rules = Rules("rollout-test", placements=(ROLLOUT_PLACEMENT,), rollout=True)
    separate = search(workload, cluster, top_k=1, rules=rules).best
    assert _switches(separate) == [ROLLOUT, ROLLOUT]
    calls = engine.schedule(trace(workload), PlanCosts.of_plan(separate))
    # the first generation, and the one after the actor's update (node 7)
    assert [(c.node.id, c.node.label, c.switch_role) for c in calls if c.switch_role] == [
        (0, "actor.generate", ROLLOUT), (8, "actor.generate", ROLLOUT)]
    together = Rules("together", placements=((tuple(MODELS),),))
    hybrid = search(workload, cluster, top_k=1, rules=together).best
    calls = engine.schedule(trace(workload), PlanCosts.of_plan(hybrid))
    assert [(c.node.id, c.switch_role) for c in calls if c.switch_role] == [(0, "actor"), (8, "actor")]
