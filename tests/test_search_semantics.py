"""What the search space means (issue 10): plans may leave GPUs idle, so more GPUs never give a worse
plan; a separate rollout set is searched beside the hybrid engine, so hfplan is never slower than another
system's mapping; twins count once; stage times add up to the iteration; the search refuses a cluster it
cannot cover and reports its progress. Exactness against brute force is tests/test_search.py's job."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hfplan.errors import HfplanError
from hfplan.layout import (
    ROLLOUT,
    SwitchLayout,
    _most_received_numel,
    _rank_kinds,
    _Sizes,
    arch_specs,
    generation_places,
    rank_coords,
    received_numel,
)
from hfplan.plan import EDGE
from hfplan.planner import space
from hfplan.planner.baselines import baselines
from hfplan.planner.search import MAX_GPUS, PARTIAL_NODE_GPUS, search, twin_key
from hfplan.profiles.models import ModelArch
from hfplan.simulator import engine
from hfplan.simulator.schedule import Precedence
from hfplan.spec import load_workload, make_cluster
from tests.support.cli import deadline as _deadline


# -- idle GPUs ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("gpus", "per_node"), [(8, 8), (12, 8), (9, 8), (16, 4), (7, 4)])
def test_a_larger_cluster_holds_every_allocation_of_a_smaller_one(gpus, per_node):
    for sets in (1, 2, 3):
        smaller = set(space.allocations(sets, gpus, per_node, idle=True))
        larger = set(space.allocations(sets, gpus + 1, per_node, idle=True))
        assert smaller <= larger
        assert all(sum(a) <= gpus for a in smaller)
        assert any(sum(a) < gpus for a in smaller)  # idle GPUs are part of the space


def _best(workload: str, gpus: int) -> float:
    return search(load_workload(workload), make_cluster(gpus), top_k=1).best.estimate.iteration_s


# The default workload over the counts of the issue (64 -> 65, 96 -> 100 once gave a worse plan) and odd ones;
# a GRPO workload from one GPU up.
MONOTONE = {"ppo-llama2-7b": [8, 9, 16, 24, 32, 33, 36, 48, 64, 65, 72],
            "grpo-qwen2.5-1.5b": [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]}


@pytest.mark.parametrize("workload", list(MONOTONE))
def test_best_time_never_rises_with_the_gpu_count(workload):
    counts = MONOTONE[workload]
    times = [_best(workload, gpus) for gpus in counts]
    for k in range(1, len(counts)):
        assert times[k] <= times[k - 1] * (1 + 1e-12), (workload, counts[k - 1], times[k - 1], counts[k], times[k])
    assert times[-1] < times[0]  # the counts matter at all


def test_idle_gpus_are_recorded_in_the_plan():
    result = search(load_workload("ppo-llama2-7b"), make_cluster(65), top_k=3)
    for plan in result.top:
        used = sum(group.gpus for group in plan.placement)
        assert plan.estimate.idle_gpus == 65 - used > 0
        assert engine.simulate_plan(plan).estimate.idle_gpus == plan.estimate.idle_gpus


# -- the rollout set, and other systems' mappings ---------------------------------------------------
# The comparison's cases (tests/test_baselines.py's real workloads).
COMPARED = [("ppo-llama2-7b", 16), ("ppo-llama2-7b", 64), ("grpo-qwen2.5-1.5b", 8), ("remax-llama2-7b", 32),
            ("ppo-qwen2.5-0.5b", 8), ("grpo-llama2-7b", 32)]


@pytest.mark.parametrize(("name", "gpus"), COMPARED, ids=[f"{n}-{g}" for n, g in COMPARED])
def test_hfplan_never_slower_than_any_other_system(name, gpus):
    """hfplan's space holds every system's mappings that its executor runs (the rollout set included), so its
    best is no worse than any of them. Each system's rule sets are searched as written but within the
    executor's rule (ZeRO-1 and ZeRO-2 are for other frameworks, outside hfplan's own space), generating with the
    batching the executor runs (a framework's vLLM batches continuously; the mapping is what is compared)."""
    workload, cluster = load_workload(name), make_cluster(gpus)
    best = search(workload, cluster, top_k=1).best.estimate.iteration_s
    rollout_compared = False
    for baseline in baselines(workload):
        if baseline.target.workload_problem(workload):
            continue
        for rules in baseline.target.variants:
            if rules.placements == ():
                continue
            try:
                found = search(workload, cluster, top_k=1, rules=replace(rules, executable=True, gen=None)).best
            except HfplanError:
                continue
            rollout_compared |= ROLLOUT in found.placed_roles
            assert best <= found.estimate.iteration_s * (1 + 1e-9), baseline.name
    if all(b.target.workload_problem(workload) is None for b in baselines(workload)):
        assert rollout_compared  # OpenRLHF's mapping with its vLLM engines apart was among them


def test_rollout_placements_are_searched_and_can_win():
    """On one GPU per model and a bandwidth-bound generation, the search looks at rollout placements."""
    workload, cluster = load_workload("ppo-llama2-7b"), make_cluster(64)
    result = search(workload, cluster, top_k=5)
    placed = [c for c in result.candidates if any(ROLLOUT in group for group in c.placement)]
    assert placed, "rollout placements are candidates"
    assert any(ROLLOUT in plan.placed_roles for plan in result.top)
    for plan in result.top:
        if ROLLOUT in plan.placed_roles:
            assert plan.generation_role == ROLLOUT
            assert plan.parallelism["actor"].gen is None
            assert plan.estimate.iteration_s == pytest.approx(engine.simulate_plan(plan).estimate.iteration_s)


# -- twins ----------------------------------------------------------------------------------------
def test_top_k_has_no_twins_on_safe_rlhf_13b():
    """Safe-RLHF's reward and cost models (and its two critics) are the same model: today's top 5 held
    four copies of one plan with those roles swapped."""
    workload = load_workload("safe-rlhf-llama2-13b")
    result = search(workload, make_cluster(64), top_k=5)
    assert len(result.top) == 5
    assert result.stats.twins > 0  # the twins were there, and were left out
    seen = []
    for plan in result.top:
        candidate = next(c for c in result.candidates if c.status == "evaluated" and not c.reason
                         and c.placement == tuple(tuple(g.models) for g in plan.placement)
                         and c.allocation == tuple(g.gpus for g in plan.placement))
        key = twin_key(workload, candidate)
        for other_key, other_s in seen:
            assert not (key == other_key and math.isclose(other_s, plan.estimate.iteration_s, rel_tol=1e-9))
        seen.append((key, plan.estimate.iteration_s))
    twins = [c for c in result.candidates if c.reason.startswith("twin")]
    assert len(twins) == result.stats.twins
    for twin in twins:
        assert any(twin_key(workload, twin) == key and math.isclose(s, twin.iteration_s, rel_tol=1e-9)
                   for key, s in seen) or twin.iteration_s >= result.top[-1].estimate.iteration_s


# -- stages ---------------------------------------------------------------------------------------
def test_critical_path_by_hand():
    """Set 0 runs a (2 s) then c (1 s); set 1 runs b (3 s) after a's output crosses a 0.5 s link; c needs b's
    output (0.25 s). The path: a 2, transfer 0.5 + b 3, transfer 0.25 + c 1 = 6.75 s."""
    precedence = Precedence(sets=(0, 1, 0), deps=((), ((0, 0.5),), ((1, 0.25),)))
    durations = [2.0, 3.0, 1.0]
    assert precedence.makespan(durations) == pytest.approx(6.75)
    assert precedence.critical_path(durations) == [(2, 1.25), (1, 3.5), (0, 2.0)]


def test_critical_path_through_a_set_chain():
    """b waits for a on its own set, not for its input from the other set: the path goes through a."""
    precedence = Precedence(sets=(0, 1, 0), deps=((), (), ((1, 0.0),)))
    durations = [5.0, 1.0, 2.0]
    assert precedence.critical_path(durations) == [(2, 2.0), (0, 5.0)]
    assert sum(s for _, s in precedence.critical_path(durations)) == precedence.makespan(durations)


@pytest.mark.parametrize(("name", "gpus"), [("grpo-qwen2.5-1.5b", 16), ("ppo-llama2-7b", 64),
                                            ("remax-qwen2.5-1.5b", 16)])
def test_stages_add_up_to_the_iteration_and_sets_keep_their_busy_time(name, gpus):
    for plan in search(load_workload(name), make_cluster(gpus), top_k=3).top:
        est = plan.estimate
        assert sum(est.stages.values()) == pytest.approx(est.iteration_s, rel=1e-12)
        assert all(v >= 0 for v in est.stages.values())
        assert len(est.busy_s) == len(plan.placement)
        for index, busy in enumerate(est.busy_s):
            # Calls, their dispatch and switches; not transfers, nor the controller's sending (a dispatch edge).
            spans = [s for s in est.timeline if s.set == index and s.kind != "transfer"
                     and not (s.kind == "dispatch" and EDGE in s.op)]
            assert busy == pytest.approx(sum(s.end - s.start for s in spans), rel=1e-12)
            assert 0 < busy <= est.iteration_s * (1 + 1e-12)


# -- limits and progress --------------------------------------------------------------------------
def test_a_cluster_beyond_the_search_is_refused_at_once():
    for gpus in (MAX_GPUS + 8, 1_000_000):
        with _deadline(5), pytest.raises(HfplanError, match="beyond the search") as error:
            search(load_workload("ppo-llama2-7b"), make_cluster(gpus))
        assert f"{gpus:,}" in str(error.value) and "idle" in str(error.value) and "\n" not in str(error.value)
    gpus = PARTIAL_NODE_GPUS + 12  # a partial node past the pinned range
    with _deadline(5), pytest.raises(HfplanError, match="not whole nodes") as error:
        search(load_workload("ppo-llama2-7b"), make_cluster(gpus))
    assert f"{gpus - 4:,}" in str(error.value)


def test_progress_covers_bounding_and_the_walk():
    seen = []
    search(load_workload("grpo-qwen2.5-1.5b"), make_cluster(8), progress=lambda *report: seen.append(report))
    stages = [stage for stage, _, _ in seen]
    assert "bounding placements" in stages and "searching allocations" in stages
    bounding = [(done, total) for stage, done, total in seen if stage == "bounding placements"]
    assert bounding[-1][0] == bounding[-1][1] == 5 + 15  # GRPO: three roles, with and without a rollout set


def test_a_walk_cut_by_the_time_limit_proves_its_gap():
    """With no time at all the walk stops at its first plan: the allocations left are open, counted once, and the
    lower bound it reports is at most the optimum the full walk finds (gap 0 there)."""
    workload, cluster = load_workload("grpo-qwen2.5-1.5b"), make_cluster(16)
    full = search(workload, cluster, top_k=3)
    assert full.gap == 0 and full.lower_bound == full.best.estimate.iteration_s
    assert not any(c.status == "open" for c in full.candidates)
    cut = search(workload, cluster, top_k=3, time_limit=0)
    optimum = full.best.estimate.iteration_s
    assert cut.lower_bound <= optimum <= cut.best.estimate.iteration_s
    assert cut.gap == pytest.approx(cut.best.estimate.iteration_s / cut.lower_bound - 1)
    assert cut.gap > 0 and cut.stats.open > 0
    assert any(c.status == "open" for c in cut.candidates)
    stats = cut.stats
    assert stats.evaluated + stats.pruned + stats.infeasible + stats.open == stats.allocations


@pytest.mark.parametrize(("gpus", "per_node", "powers"),
                         [(40, 4, False), (40, 4, True), (12, 8, False), (19, 2, False)])
def test_allocation_counts_equal_the_allocations_listed(gpus, per_node, powers):
    """The walk's allocation counts (bounds._counts, a running sum over the whole-node sizes) equal the allocations
    space.allocations lists, with and without idle GPUs."""
    from hfplan.planner.bounds import _counts

    sizes = [s for s in space.set_sizes(gpus, per_node) if not powers or s & (s - 1) == 0]
    for idle in (False, True):
        table = _counts(tuple(sizes), gpus, idle, 4)
        for sets in range(1, 5):
            listed = sum(1 for _ in space.allocations(sets, gpus, per_node, powers, idle))
            assert table[sets][gpus] == listed, (sets, idle)


def test_a_walk_past_its_cap_of_open_prefixes_stops_with_its_proven_gap(monkeypatch):
    """Past MAX_OPEN_PREFIXES open prefixes the walk stops as at its time limit (memory): its best is no better than
    the exhaustive walk's, its lower bound no higher, and the result says why it stopped."""
    from hfplan.planner import search as search_module

    workload, cluster = load_workload("grpo-qwen2.5-1.5b"), make_cluster(16)
    exact = search(workload, cluster, top_k=1)
    monkeypatch.setattr(search_module, "MAX_OPEN_PREFIXES", 0)
    capped = search(workload, cluster, top_k=1)
    assert exact.stats.stopped_by == "" and exact.gap == 0
    assert capped.stats.stopped_by == "open prefixes" and capped.stats.open > 0
    best = exact.best.estimate.iteration_s
    assert capped.lower_bound <= best * (1 + 1e-9) <= capped.best.estimate.iteration_s * (1 + 1e-9)
    assert all(c.reason.startswith("not walked (open prefixes)") for c in capped.candidates if c.status == "open")


# -- the switch's count, as the search costs it ----------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "pp", "dp", "shards", "gen_tp", "gen_pp"),
                         [(2, 2, 4, 4, 4, 1), (1, 4, 6, 3, 2, 2), (4, 1, 4, 2, 2, 1), (2, 2, 2, 1, 8, 1),
                          (1, 2, 8, 8, 4, 1)])
def test_most_received_counts_each_kind_of_rank_once(tp, pp, dp, shards, gen_tp, gen_pp):
    """The search prices a switch by the most any rank receives, counted once per kind of rank (_rank_kinds, on
    arrays): the kinds are exactly those generation_places gives rank by rank, and the most the same."""
    arch = ModelArch(name="t", layers=6, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=100)
    train = SwitchLayout(tp, pp, dp, 1, shards)
    gen = _Sizes(gen_tp, gen_pp, tp * pp * dp // (gen_tp * gen_pp))
    per_rank = {(*rank_coords(train, r)[::2], rank_coords(train, r)[1] % shards, place.pp, place.tp)
                for r, place in enumerate(generation_places(train, gen))}
    assert {tuple(int(x) for x in kind) for kind in _rank_kinds(train, gen)} == per_rank
    assert _most_received_numel(arch, train, (gen.tp, gen.pp, gen.dp)) == max(
        received_numel(train, gen, arch_specs(arch), arch.layers))
