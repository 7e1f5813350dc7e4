"""The search (hfplan/planner/search.py) against an exhaustive reference (tests/support/search_references.py).

The reference does not use the planner's strategies or search modules: it costs every role's raw strategies
in every placement and allocation of at most the cluster's GPUs, and runs the simpy engine on every choice
that could be the best of its pair. brute_force() multiplies everything out on the pairs small enough, to
check that. The search claims to be exact within that space, so its best iteration time, its top-K and its
verdict on every (placement, allocation) must agree with the reference.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hfplan.errors import HfplanError
from hfplan.plan import ROLLOUT, Plan, plan_from_dict
from hfplan.planner import space
from hfplan.planner.search import Candidate, search, twin_key
from hfplan.simulator import engine
from hfplan.simulator.costs import CostMemo
from hfplan.simulator.mapping import PlanCosts
from hfplan.simulator.trace import trace
from hfplan.spec import ALGORITHM_ROLES, Workload, make_cluster, workload_from_dict
from tests.support.cli import deadline as _deadline
from tests.support.search_references import CPU, RULE, TIGHT, Case, Lab, PairResult, brute_force

BELL = {1: 1, 2: 2, 3: 5, 4: 15, 5: 52, 6: 203, 7: 877}

CASES = {
    "ppo-1gpu": Case("ppo", {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": "flat"}, 1, 1),
    "ppo-2gpu": Case("ppo", {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": "flat"}, 2, 2),
    "ppo-4gpu-2nodes": Case("ppo", {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": RULE}, 4, 2,
                            top_k=5),
    "ppo-12gpu-partial-node": Case("ppo", {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": RULE},
                                   12, 8, batch_prompts=4, mini_batches=1, top_k=4),
    # one sequence: no data parallelism, so more nodes are no faster for the reference (the walk, keeping the top 1,
    # leaves such sizes out: padded_sizes)
    "ppo-8gpu-4nodes-one-prompt": Case("ppo", {"actor": "kv1", "critic": "flat", "reference": "wide", "reward": RULE},
                                       8, 2, batch_prompts=1, top_k=1),
    "grpo-4gpu": Case("grpo", {"actor": "wide", "reference": "flat", "reward": "flat"}, 4, 4, samples_per_prompt=2),
    "grpo-4gpu-2nodes": Case("grpo", {"actor": "wide", "reference": "flat", "reward": "flat"}, 4, 2,
                             samples_per_prompt=2, prompt_len=1024, response_len=512, top_k=2),
    "remax-4gpu": Case("remax", {"actor": "wide", "reference": "wide", "reward": "flat"}, 4, 4, top_k=5),
    "safe-rlhf-2gpu": Case("safe-rlhf", {"actor": "kv1", "critic": "flat", "reference": "flat", "reward": RULE,
                                         "cost": RULE, "cost_critic": "flat"}, 2, 2),
    # memory is tight: most candidates do not fit, some only with sharding or tensor parallelism
    "ppo-tight-2gpu": Case("ppo", {"actor": "mha", "critic": "flatbig", "reference": "flatbig", "reward": "flatbig"},
                           2, 2, hardware=TIGHT, prompt_len=1024, response_len=1024, batch_prompts=2,
                           mini_batches=1, top_k=2),
    # two nodes of the tight profile: some pairs are best with the actor sharded within each node (hybrid)
    "ppo-tight-4gpu-2nodes": Case("ppo", {"actor": "mha", "critic": "flatbig", "reference": "flatbig", "reward": RULE},
                                  4, 2, hardware=TIGHT, prompt_len=1024, response_len=512, batch_prompts=4,
                                  mini_batches=1, top_k=3),
    # does not fit on 2 GPUs; fits on 3 (one node and a partial one)
    "ppo-tight-3gpu-partial-node": Case("ppo", {"actor": "mha", "critic": "flatbig", "reference": "flatbig",
                                                "reward": "flatbig"}, 3, 2, hardware=TIGHT, prompt_len=2048,
                                        response_len=2048, batch_prompts=2, mini_batches=1, top_k=3),
}
# One colocated set of these holds thousands of strategy combinations: their references took 4 and 8 s each (2026-12-06,
# under load; 41 and 73 s before set_choices costed each strategy once).
SLOW_CASES = {
    "ppo-all-kv1-2gpu": Case("ppo", {"actor": "kv1", "critic": "kv1", "reference": "kv1", "reward": "kv1"}, 2, 2),
    "safe-rlhf-cost-model-2gpu": Case("safe-rlhf", {"actor": "kv1", "critic": "flat", "reference": "flat",
                                                    "reward": RULE, "cost": "flat", "cost_critic": "flat"}, 2, 2),
}
# Generation runs in waves of as many sequences as the KV cache holds, so the memory left by colocated roles
# decides its time. This case once caught the search missing the optimum: with uneven waves (150 responses on
# 2 replicas as 73 + 2 instead of 68 + 7) more free memory made generation slower, and the search, which
# assumes more memory never slows anything, chose the sharded actor (6995.61 s) over the unsharded one
# (6993.23 s).
KV_WAVES = {
    "remax-kv-waves-4gpu": Case("remax", {"actor": "kv8", "reference": "flat1k", "reward": RULE}, 4, 2, hardware=CPU,
                                prompt_len=8192, response_len=2048, batch_prompts=150, mini_batches=150, top_k=1),
}
CASES |= KV_WAVES
ALL_CASES = {**CASES, **SLOW_CASES}
CASE_PARAMS = [pytest.param(name, id=name) for name in CASES] + [
    pytest.param(name, id=name, marks=[pytest.mark.slow, pytest.mark.exhaustive]) for name in SLOW_CASES]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    return Lab(tmp_path_factory.mktemp("models"), ALL_CASES)


def _reference_best(reference: dict[tuple, PairResult]) -> float:
    return min((r.best_s for r in reference.values()), default=math.inf)


def test_cases_are_nontrivial(lab):
    """The cases exercise what they claim: several placements and allocations, and (tight cases)
    candidates that do not fit next to ones that do."""
    for name in CASES:
        reference = lab.reference(name)
        assert len(reference) >= 1
        assert any(r.feasible for r in reference.values()), name
        runs = sum(r.runs for r in reference.values())
        assert runs <= 5000, (name, runs)  # stays tractable
    with_rollout = [name for name in CASES if any(r.feasible and any(ROLLOUT in group for group in placement)
                                                  for (placement, _), r in lab.reference(name).items())]
    assert len(with_rollout) >= 3, with_rollout  # rollout sets that fit, so the cases check them too
    shards = {par.train.shard for name in CASES for r in lab.reference(name).values() if r.pars
              for par in r.pars.values() if par.train}
    assert {"replicated", "full", "hybrid"} <= shards, shards  # the executor's shard modes each win some pair
    tight = lab.reference("ppo-tight-2gpu")
    assert sum(r.infeasible for r in tight.values()) > sum(r.feasible for r in tight.values()) > 0
    assert any(r.best_s == math.inf for r in tight.values())  # whole pairs that cannot fit
    allocations = {allocation for _, allocation in lab.reference("ppo-4gpu-2nodes")}
    assert (4,) in allocations and (2, 2) in allocations and (1, 1, 2) in allocations  # two nodes, and within one
    assert (1,) in allocations and (2, 1) in allocations  # GPUs left idle


@pytest.mark.parametrize(("name", "budget"), [("ppo-2gpu", 3200), ("ppo-tight-3gpu-partial-node", 1000),
                                              ("remax-kv-waves-4gpu", 1000), ("grpo-4gpu-2nodes", 1000)])
def test_reference_equals_brute_force(lab, name, budget):
    """exhaustive() leaves out the combinations of a set that are no faster on any call than another: on
    pairs whose full product is small (up to `budget` choices in all; pairs where something fits first,
    smallest first), multiplying everything out gives the same best time and the same counts. The pairs
    checked include some of several sets, and some where the reference left choices out."""
    case = ALL_CASES[name]
    workload, cluster = lab.workload(case), lab.cluster(case)
    reference, memo = lab.reference(name), CostMemo()
    checked, several_sets, reduced = 0, 0, 0
    pairs = sorted(reference.items(), key=lambda item: (not item[1].feasible, item[1].feasible + item[1].infeasible))
    for (placement, allocation), truth in pairs:
        size = truth.feasible + truth.infeasible
        if checked + size > budget:
            continue
        checked += size
        full = brute_force(workload, cluster, placement, allocation, memo)
        assert (full.feasible, full.infeasible) == (truth.feasible, truth.infeasible), (placement, allocation)
        assert full.best_s == pytest.approx(truth.best_s, rel=1e-12), (placement, allocation)
        several_sets += len(placement) > 1 and truth.feasible > 0
        reduced += truth.runs < truth.feasible
    assert several_sets and reduced


# -- the key comparison ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASE_PARAMS)
def test_search_best_equals_exhaustive(lab, name):
    reference = lab.reference(name)
    expected = _reference_best(reference)
    assert expected < math.inf, "every case has a feasible plan"
    best = lab.search(name).best
    assert best.estimate.iteration_s == pytest.approx(expected, rel=1e-9), _describe_best(reference)


def _distinct_best(workload: Workload, reference: dict[tuple, PairResult], k: int) -> list[float]:
    """The k best pair times, twins (the same pair up to swapping roles of one model, the same time) once."""
    seen: dict[tuple, list[float]] = {}
    out = []
    for (placement, allocation), r in sorted(reference.items(), key=lambda item: item[1].best_s):
        if r.best_s == math.inf or len(out) == k:
            break
        key = twin_key(workload, Candidate(placement, allocation, "evaluated"))
        if any(math.isclose(t, r.best_s, rel_tol=1e-9) for t in seen.get(key, ())):
            continue
        seen.setdefault(key, []).append(r.best_s)
        out.append(r.best_s)
    return out


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_top_k_equals_the_k_best_pairs(lab, name):
    """The top-K plans are the K best (placement, allocation) pairs, each at its own optimum, twins once."""
    reference = lab.reference(name)
    result = lab.search(name)
    expected = _distinct_best(lab.workload(ALL_CASES[name]), reference, ALL_CASES[name].top_k)
    got = [plan.estimate.iteration_s for plan in result.top]
    assert got == pytest.approx(expected, rel=1e-9)
    for plan in result.top:
        key = (tuple(tuple(s.models) for s in plan.placement), tuple(s.gpus for s in plan.placement))
        assert key in reference, key
        assert plan.estimate.iteration_s == pytest.approx(reference[key].best_s, rel=1e-9), key


def _covered(candidate, reference: dict[tuple, PairResult]) -> list[tuple]:
    """The (placement, allocation) pairs a candidate row stands for: itself, or every allocation of its
    placement that starts with its (shorter) allocation."""
    n = len(candidate.allocation)
    return [key for key in reference
            if key[0] == candidate.placement and key[1][:n] == candidate.allocation]


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_every_candidate_agrees_with_exhaustive(lab, name):
    """Evaluated rows sit at their pair's exact optimum, infeasible rows stand only for pairs where nothing
    fits, pruned rows only for pairs no better than the K-th best plan."""
    reference = lab.reference(name)
    result = lab.search(name)
    kth = result.top[-1].estimate.iteration_s
    evaluated = [(c.placement, c.allocation) for c in result.candidates if c.status == "evaluated"]
    assert len(evaluated) == len(set(evaluated))
    for c in result.candidates:
        assert c.status in ("evaluated", "infeasible", "pruned")
        assert len(c.allocation) <= len(c.placement)
        covered = _covered(c, reference)
        if c.status == "evaluated":
            assert len(c.allocation) == len(c.placement) and covered == [(c.placement, c.allocation)]
            truth = reference[(c.placement, c.allocation)]
            assert c.iteration_s == pytest.approx(truth.best_s, rel=1e-9), (c.placement, c.allocation)
            assert c.pars is not None and set(c.pars) == {r for group in c.placement for r in group}
            continue
        assert c.reason
        for key in covered:
            truth = reference[key]
            if c.status == "infeasible":
                assert truth.feasible == 0, (c.placement, c.allocation, key, c.reason, truth.best_s)
            else:
                assert truth.best_s >= kth * (1 - 1e-9), (c.placement, c.allocation, key, truth.best_s, kth)


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_stats_count_every_allocation_once(lab, name):
    reference = lab.reference(name)
    result = lab.search(name)
    stats = result.stats
    roles = len(lab.workload(ALL_CASES[name]).model_roles)
    assert stats.placements == BELL[roles] + BELL[roles + 1]  # hybrid engine, and a rollout set
    assert stats.allocations == len(reference)
    assert stats.evaluated == sum(c.status == "evaluated" for c in result.candidates)
    assert stats.evaluated + stats.pruned + stats.infeasible == stats.allocations


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_candidate_rows_cover_every_allocation(lab, name):
    """Every (placement, allocation) is accounted for by some row of the candidates (the CSV)."""
    reference = lab.reference(name)
    covered = {key for c in lab.search(name).candidates for key in _covered(c, reference)}
    assert set(reference) - covered == set()


@pytest.mark.parametrize("name", ["ppo-2gpu", "ppo-tight-2gpu", "grpo-4gpu-2nodes"])
def test_evaluated_strategies_reproduce_their_time(lab, name):
    """The strategies the search reports for a pair give, costed independently, the time it reports."""
    case = ALL_CASES[name]
    workload, cluster = lab.workload(case), lab.cluster(case)
    dag = trace(workload)
    for c in lab.search(name).candidates:
        if c.status != "evaluated":
            continue
        plan_costs = PlanCosts(workload, list(zip(c.placement, c.allocation, strict=True)), c.pars, cluster.profile,
                               cluster.gpus_per_node)
        assert plan_costs.infeasible_reason == ""
        assert engine.run(dag, plan_costs).iteration_s == pytest.approx(c.iteration_s, rel=1e-9)


def _describe_best(reference: dict[tuple, PairResult]) -> str:
    key, result = min(reference.items(), key=lambda item: item[1].best_s)
    pars = {r: p.model_dump() for r, p in (result.pars or {}).items()}
    return f"exhaustive best {result.best_s} at {key}: {pars}"


# -- plans, errors, options -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_result():
    workload = workload_from_dict({"algorithm": "ppo", "models": {r: "qwen2.5-0.5b" for r in ALGORITHM_ROLES["ppo"]},
                                   "prompt_len": 512, "response_len": 512, "batch_prompts": 64, "mini_batches": 4},
                                  "test")
    cluster = make_cluster(8, "a100-80g")
    return workload, cluster, search(workload, cluster, top_k=6)


def test_top_plans_sorted_distinct_and_valid(qwen_result):
    workload, cluster, result = qwen_result
    assert 1 < len(result.top) <= 6
    times = [p.estimate.iteration_s for p in result.top]
    assert times == sorted(times)
    keys = [(tuple(tuple(s.models) for s in p.placement), tuple(s.gpus for s in p.placement)) for p in result.top]
    assert len(set(keys)) == len(keys)
    assert result.best is result.top[0]
    for plan in result.top:
        assert isinstance(plan, Plan)
        again = plan_from_dict(json.loads(plan.to_json()), "round trip")  # validates
        assert again == plan
        assert plan.workload == workload and plan.cluster == cluster
        assert sum(s.gpus for s in plan.placement) + plan.estimate.idle_gpus == cluster.gpus
        assert set(workload.model_roles) <= {r for s in plan.placement for r in s.models}
        simulated = engine.simulate_plan(plan).estimate
        assert plan.estimate.iteration_s == pytest.approx(simulated.iteration_s, rel=1e-12)
        assert plan.estimate.timeline == simulated.timeline
        assert plan.estimate.timeline, "the estimate carries its timeline"
        assert plan.estimate.tokens_per_s == pytest.approx(workload.tokens_per_iteration / plan.estimate.iteration_s)


def test_stats_cover_every_allocation(qwen_result):
    workload, cluster, result = qwen_result
    placements = space.own_placements(workload)
    total = sum(len(list(space.allocations(len(p), cluster.gpus, cluster.gpus_per_node, idle=True)))
                for p in placements)
    stats = result.stats
    assert stats.placements == BELL[4] + BELL[5] == 67
    assert stats.allocations == total
    assert stats.evaluated == sum(c.status == "evaluated" for c in result.candidates)
    assert stats.evaluated + stats.pruned + stats.infeasible == stats.allocations
    assert stats.simpy_runs >= stats.evaluated


def test_no_row_is_pruned_by_an_infinite_bound(lab):
    """A row standing for allocations where nothing can fit (four sets on two GPUs, a set with no size left
    that holds it) is infeasible, not 'pruned' by an infinite bound."""
    result = lab.search("ppo-tight-2gpu")
    reference = lab.reference("ppo-tight-2gpu")
    for c in result.candidates:
        if c.status == "pruned":
            assert _covered(c, reference), (c.placement, c.allocation, c.reason)  # stands for some allocation
            assert "inf" not in c.reason, (c.placement, c.allocation, c.reason)


def test_too_small_cluster_names_the_minimum():
    workload = workload_from_dict({"algorithm": "ppo", "models": {r: "llama2-70b" for r in ALGORITHM_ROLES["ppo"]}},
                                  "ppo-llama2-70b")
    with pytest.raises(HfplanError) as error:
        search(workload, make_cluster(4, "a100-80g"))
    message = str(error.value)
    assert "at least" in message
    assert "GPU" in message and "GiB" in message  # why: memory per GPU
    minimum = int(message.split("at least")[1].split()[0])
    assert minimum > 4
    search(workload, make_cluster(minimum, "a100-80g"), top_k=1)  # the minimum fits
    with pytest.raises(HfplanError):
        search(workload, make_cluster(minimum - 1, "a100-80g"), top_k=1)  # one fewer does not


def test_the_minimum_in_the_message_is_the_true_minimum(lab):
    """The error names the fewest GPUs that fit, partial nodes included: here 3 (one node and half of one)."""
    case = ALL_CASES["ppo-tight-3gpu-partial-node"]
    workload, hardware = lab.workload(case), lab.hardware
    with pytest.raises(HfplanError) as error:
        search(workload, make_cluster(2, hardware, 2))
    minimum = int(str(error.value).split("at least")[1].split()[0])
    search(workload, make_cluster(minimum, hardware, 2))  # fits on the minimum
    with pytest.raises(HfplanError):
        search(workload, make_cluster(minimum - 1, hardware, 2))  # and not on one fewer


def test_workload_that_fits_nowhere_fails_promptly():
    """Finding the minimum GPU count must not scan every count up to thousands when none fits."""
    # One sequence of 128k tokens (qwen2.5-1.5b's whole context): its logits alone exceed an A100 at any
    # parallelism the model allows.
    workload = workload_from_dict({"algorithm": "ppo", "models": {r: "qwen2.5-1.5b" for r in ALGORITHM_ROLES["ppo"]},
                                   "prompt_len": 65536, "response_len": 65536, "batch_prompts": 8,
                                   "mini_batches": 1}, "test")
    with _deadline(10), pytest.raises(HfplanError, match="fit"):
        search(workload, make_cluster(8, "a100-80g"))


def test_jobs_two_gives_the_same_best_as_one(qwen_result):
    workload, cluster, result = qwen_result
    parallel = search(workload, cluster, top_k=6, jobs=2)
    assert [p.estimate.iteration_s for p in parallel.top] == pytest.approx(
        [p.estimate.iteration_s for p in result.top], rel=1e-12)
    assert parallel.best.placement == result.best.placement
    assert parallel.best.parallelism == result.best.parallelism
    assert [(c.placement, c.allocation, c.status) for c in parallel.candidates] == [
        (c.placement, c.allocation, c.status) for c in result.candidates]


def test_jobs_two_on_a_tight_case_matches_exhaustive(lab):
    case = ALL_CASES["ppo-tight-2gpu"]
    result = search(lab.workload(case), lab.cluster(case), top_k=case.top_k, jobs=2)
    expected = _reference_best(lab.reference("ppo-tight-2gpu"))
    assert result.best.estimate.iteration_s == pytest.approx(expected, rel=1e-9)


def test_partial_node_cluster_twelve_gpus_eight_per_node():
    workload = workload_from_dict({"algorithm": "ppo", "models": {r: "qwen2.5-0.5b" for r in ALGORITHM_ROLES["ppo"]},
                                   "prompt_len": 512, "response_len": 512, "batch_prompts": 64, "mini_batches": 4},
                                  "test")
    cluster = make_cluster(12, "a100-80g", 8)
    result = search(workload, cluster, top_k=3)
    sizes = set(space.set_sizes(12, 8))
    for plan in result.top:
        assert sum(s.gpus for s in plan.placement) <= 12
        assert all(s.gpus in sizes for s in plan.placement)
        assert plan.estimate.iteration_s == pytest.approx(engine.simulate_plan(plan).estimate.iteration_s)


def test_progress_reports_reach_the_end(lab):
    case = ALL_CASES["ppo-2gpu"]
    seen = []
    search(lab.workload(case), lab.cluster(case), progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert seen
    stage, done, total = seen[-1]
    assert done == total


def _own_contexts(lab, name: str):
    """A reference case's cluster, its exhaustive reference, and hfplan's two search contexts over it (the hybrid
    engine's placements and, sharing its costs, those with a rollout set)."""
    from hfplan.planner.context import SearchContext
    from hfplan.planner.strategies import Rules

    case = ALL_CASES[name]
    workload, cluster = lab.workload(case), lab.cluster(case)
    dag = trace(workload)
    hybrid = SearchContext(workload, cluster.profile, cluster.gpus_per_node, dag, Rules(idle_gpus=True))
    rollout = SearchContext(workload, cluster.profile, cluster.gpus_per_node, dag,
                            Rules(rollout=True, idle_gpus=True), shared=hybrid)
    return cluster, lab.reference(name), (hybrid, rollout)


def _bounds_between(lab, name: str, loosen) -> int:
    """Walk every prefix of case `name`'s placements with the bounds as built and with `loosen` applied to a second
    copy: each child's loosened bound <= its bound <= the exhaustive best of every allocation under it. Returns
    how many children the built bound raised above the loosened one."""
    from hfplan.planner.bounds import PlacementBounds

    cluster, reference, contexts = _own_contexts(lab, name)
    tighter = 0
    for ctx in contexts:
        for placement in ctx.placements:
            pb = PlacementBounds(ctx.bounds, placement, cluster.gpus)
            loose_pb = PlacementBounds(ctx.bounds, placement, cluster.gpus)
            loosen(loose_pb)
            todo = [()]
            while todo:
                prefix = todo.pop()
                if len(prefix) == pb.k:
                    continue
                for (child, bound, _), (_, loose, _) in zip(pb.children(prefix), loose_pb.children(prefix),
                                                            strict=True):
                    best = min((r.best_s for (p, a), r in reference.items()
                                if p == placement and a[:len(child)] == child), default=math.inf)
                    assert loose <= bound <= best * (1 + 1e-9), (name, placement, child, loose, bound, best)
                    tighter += loose < bound < math.inf
                    todo.append(child)
    return tighter


def _floors_only(pb) -> None:
    pb.gen_set = None


@pytest.mark.parametrize("name", ["ppo-4gpu-2nodes", "grpo-4gpu-2nodes", "ppo-tight-4gpu-2nodes"])
def test_prefix_bounds_are_below_every_allocation_under_them(lab, name):
    """Every prefix bound the walk uses (children) is at most the exhaustive best of every allocation that extends
    it, by the generating role's options (Floors.generator_rows) as by the floors alone; and the options' bound is
    above the floors' somewhere, or the rule would not prune anything."""
    assert _bounds_between(lab, name, _floors_only)


def _without_role_options(pb) -> None:
    pb._by_role_option = lambda prefix, js, rows, switches: np.full(len(js), -np.inf)


def _without_sync_across_nodes(pb) -> None:
    pb.apart_switch, pb.best_apart = pb.switch, pb.best_switch


@pytest.mark.parametrize("rule", [_without_role_options, _without_sync_across_nodes])
def test_tighter_bounds_are_below_every_allocation_under_them(lab, rule):
    """Each rule that tightens children's bounds, taken away (`rule`): by each role's options (PlacementBounds.
    _by_role_option: a trained role's update and inference calls from one option, not each at its fastest over
    options), and a rollout set's weight sync across nodes where it cannot share one with the actor's set, sized or
    not (apart_switch, best_apart). With it every bound of three small cases is at most the exhaustive best of every
    allocation under it, and above the bound without it for some child, or the rule would prune nothing."""
    assert sum(_bounds_between(lab, name, rule)
               for name in ["ppo-4gpu-2nodes", "grpo-4gpu-2nodes", "ppo-tight-4gpu-2nodes"])


@pytest.mark.parametrize("name", ["ppo-4gpu-2nodes", "grpo-4gpu-2nodes"])
def test_children_past_a_threshold_are_bounded_by_their_floors_alone(lab, name):
    """children(prefix, threshold) schedules option by option only the children whose floors' bound is under the
    threshold: those keep the bound children(prefix) gives, the others get one still at least the threshold, so the
    walk, which prunes every child at or above it when made, prunes the same ones. Some child gets its floors' bound
    below its options' one (the schedule it skips)."""
    from hfplan.planner.bounds import PlacementBounds

    cluster, _, contexts = _own_contexts(lab, name)
    skipped = 0
    for ctx in contexts:
        for placement in ctx.placements:
            pb = PlacementBounds(ctx.bounds, placement, cluster.gpus)
            todo = [()]
            while todo:
                prefix = todo.pop()
                if len(prefix) == pb.k:
                    continue
                full = pb.children(prefix)
                for threshold in sorted({b for _, b, _ in full if b < math.inf}):
                    for (child, bound, why), (same, cut, why_cut) in zip(full, pb.children(prefix, threshold),
                                                                         strict=True):
                        assert (child, why) == (same, why_cut)
                        assert cut == bound if bound < threshold else threshold <= cut <= bound, (child, threshold)
                        skipped += cut < bound
                todo.extend(child for child, _, _ in full)
    assert skipped


def test_children_pruned_when_made_agree_with_exhaustive(lab):
    """The walk prunes a child whose bound is at least the K-th best time so far when it makes it. Keeping the top 3
    on the two-node tight case it does (the cases' own top-K walks hold no K-th best while prefixes are left to
    expand): the best is still the exhaustive best, every allocation is covered by a row, and every allocation those
    rows stand for is no better than the exhaustive K-th best."""
    name, top_k = "ppo-tight-4gpu-2nodes", 3
    case, reference = ALL_CASES[name], lab.reference(name)
    result = search(lab.workload(case), lab.cluster(case), top_k=top_k)
    made = [c for c in result.candidates if c.reason.startswith(("bound at least", "no size of set"))]
    assert made
    assert result.best.estimate.iteration_s == pytest.approx(_reference_best(reference), rel=1e-9)
    assert {key for c in result.candidates for key in _covered(c, reference)} == set(reference)
    kth = sorted(r.best_s for r in reference.values())[top_k - 1]
    for c in made:
        for key in _covered(c, reference):
            assert reference[key].best_s >= kth * (1 - 1e-9), (c.placement, c.allocation, key)


@pytest.mark.parametrize("name", ["ppo-4gpu-2nodes", "grpo-4gpu-2nodes", "ppo-tight-4gpu-2nodes"])
def test_unsized_sets_rule_never_prunes_an_allocation_that_beats_the_threshold(lab, name):
    """The walk's rule for a prefix of whole-node sets with the others unsized (search._unsized_prunes: one branch
    and bound for every size they can take, idle GPUs the rest) prunes at a threshold only when no completion of
    the prefix beats it: never at just above the exhaustive best of its completions. And it is not vacuous: at just
    below that best it prunes some prefixes, with one set unsized and with two, where the floors' bound does not."""
    from hfplan.planner.bounds import PlacementBounds
    from hfplan.planner.search import SearchStats, _unsized_prunes

    cluster, reference, contexts = _own_contexts(lab, name)
    checked, tighter = 0, set()
    for ctx in contexts:
        for placement in ctx.placements:
            pb = PlacementBounds(ctx.bounds, placement, cluster.gpus)
            prefixes = {a[:m] for p, a in reference if p == placement for m in range(1, len(p))}
            for prefix in prefixes:
                best = min(r.best_s for (p, a), r in reference.items()
                           if p == placement and a[:len(prefix)] == prefix)
                if best == math.inf or any(size % cluster.gpus_per_node for size in prefix):
                    continue
                checked += 1
                assert not _unsized_prunes(ctx, pb, prefix, best * (1 + 1e-9), SearchStats()), (placement, prefix)
                if _unsized_prunes(ctx, pb, prefix, best * (1 - 1e-9), SearchStats()) and \
                        pb.bound(prefix) < best * (1 - 1e-9):
                    tighter.add(len(placement) - len(prefix))
    assert checked and tighter, (checked, tighter)
    if name == "ppo-4gpu-2nodes":
        assert tighter == {1, 2}, tighter



@pytest.mark.parametrize("name", ["ppo-8gpu-4nodes-one-prompt", "ppo-4gpu-2nodes", "grpo-4gpu-2nodes",
                                  "ppo-tight-4gpu-2nodes"])
def test_padded_sizes_are_never_better_than_the_size_covering_them(lab, name):
    """A set size the walk leaves out as padded (Floors.padded_sizes: every option of each role has one on a smaller
    whole-node size no slower, and no larger where the set holds several roles) never holds a better plan: with
    every other set's size kept, the exhaustive best with the set on the covering size is at most the best with it
    on the padded one. The one-prompt case leaves some size out."""
    from hfplan.planner.bounds import PlacementBounds

    cluster, reference, contexts = _own_contexts(lab, name)
    checked = 0
    for ctx in contexts:
        for placement in ctx.placements:
            pb = PlacementBounds(ctx.bounds, placement, cluster.gpus)
            for i, padded in enumerate(pb.padded):
                for size, cover in padded.items():
                    assert cover < size and not cover % cluster.gpus_per_node
                    for (p, a), r in reference.items():
                        if p == placement and a[i] == size:
                            covered = reference[(p, (*a[:i], cover, *a[i + 1:]))]
                            assert covered.best_s <= r.best_s * (1 + 1e-12), (placement, a, cover)
                            checked += 1
    if name == "ppo-8gpu-4nodes-one-prompt":
        assert checked  # not vacuous


def test_set_tables_are_shared_and_hold_each_sizes_bound(lab):
    """PlacementBounds takes each set's bounds at every size from one SetTable per set (Floors.set_table), shared by
    the placements holding it: its rows are set_bound's at each size, its running minima the least over the feasible
    sizes up to each; and child_completions adds up the children's completions."""
    from hfplan.planner.bounds import PlacementBounds

    cluster, _, contexts = _own_contexts(lab, "ppo-12gpu-partial-node")
    shared = 0
    for ctx in contexts:
        tables = {}
        for placement in ctx.placements:
            pb = PlacementBounds(ctx.bounds, placement, cluster.gpus)
            for i, roles in enumerate(placement):
                table = ctx.bounds.set_table(roles, tuple(pb.sizes), 1)
                shared += tables.setdefault(roles, table) is table and len(tables) > 1
                least = np.full(len(ctx.dag.nodes), np.inf)
                for j, size in enumerate(pb.sizes):
                    bound = ctx.bounds.set_bound(roles, size)
                    assert pb.feasible[i, j] == (not bound.why)
                    if not bound.why:
                        assert np.array_equal(pb.rows[i, j], bound.row) and pb.switch[i, j] == bound.switch
                        least = np.minimum(least, bound.row)
                    assert np.array_equal(pb.best_rows[i, j], least)
            js = np.arange(len(pb.sizes))[np.array(pb.sizes) <= cluster.gpus - (pb.k - 1)]
            assert pb.child_completions((), js) == sum(pb.completions((pb.sizes[j],)) for j in js.tolist())
    assert shared  # some set's table served several placements
