"""Automatic device mapping (HybridFlow's Algorithm 1, made exact by branch and bound).

For every placement (set partition of the roles) and every allocation of the GPUs to its sets, find
the parallel strategies of every role that minimise the simulated iteration time, and keep the best
plans. The schedule of the simpy engine is a longest path over the traced DAG plus each set's
program-order chain, so it never shortens when a call lengthens. That gives exact bounds:
- an allocation whose sets, each role alone at its fastest, cannot beat the K-th best plan found so
  far is skipped (colocation only takes memory away);
- within an allocation, a partial choice of strategies whose schedule, with every unchosen call at its
  fastest, is no better than the best known is abandoned.
Complete choices that beat the best known are run on the simpy engine, which gives their time.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from hfplan.errors import HfplanError
from hfplan.layout import ROLLOUT, generating_role, set_index
from hfplan.plan import PlacementSet, Plan, RoleParallelism
from hfplan.planner import space
from hfplan.planner.bounds import PlacementBounds
from hfplan.planner.strategies import RoleChoices, RoleOption, Rules, SearchContext, agrees
from hfplan.simulator import engine
from hfplan.simulator.mapping import PlanCosts, call_seconds, switch_seconds
from hfplan.simulator.schedule import Precedence
from hfplan.simulator.trace import Dag, trace
from hfplan.spec import Cluster, Workload

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class Candidate:
    """One (placement, allocation) pair and what the search concluded about it. Pruned and infeasible
    rows may stand for every allocation that starts with `allocation` (shorter than the placement)."""

    placement: tuple[tuple[str, ...], ...]
    allocation: tuple[int, ...]
    status: str  # evaluated | infeasible | pruned
    iteration_s: float = math.inf
    reason: str = ""
    pars: dict[str, RoleParallelism] | None = None
    peak_gib: tuple[float, ...] = ()


@dataclass
class SearchStats:
    placements: int = 0
    allocations: int = 0
    evaluated: int = 0
    pruned: int = 0
    infeasible: int = 0
    strategy_choices: int = 0  # complete strategy choices reached by the branch and bound
    simpy_runs: int = 0
    seconds: float = 0.0


@dataclass
class SearchResult:
    top: list[Plan]
    candidates: list[Candidate]
    stats: SearchStats = field(default_factory=SearchStats)

    @property
    def best(self) -> Plan:
        return self.top[0]


class _Pair:
    """Fast schedule of one (placement, allocation): the schedule rule's precedence with the transfers
    of this allocation; durations come per strategy choice, the generating role's switch added at
    each switch point."""

    def __init__(self, ctx: SearchContext, placement: tuple[tuple[str, ...], ...], allocation: tuple[int, ...]):
        self.ctx = ctx
        self.placement = placement
        self.allocation = allocation
        self.set_of_role = set_index(placement)
        # Only the sets' positions matter for transfers: no parallelism needed.
        where = PlanCosts(ctx.workload, list(zip(placement, allocation, strict=True)), {}, ctx.hw, ctx.gpus_per_node)
        self.same_node = where.same_node
        self.precedence = Precedence.of(ctx.dag, [where.set_of(n) for n in ctx.dag.nodes], where.edge_seconds)
        self.switch_ids = ctx.switch_ids

    def makespan_many(self, seconds: np.ndarray, switch: np.ndarray) -> np.ndarray:
        """makespan() of many duration rows at once: seconds (rows x nodes), switch (rows,)."""
        if self.switch_ids:
            seconds = seconds.copy()
            seconds[:, self.switch_ids] += switch[:, None]
        return self.precedence.makespan_many(seconds)

    def makespan(self, seconds: Sequence[float], switch: float) -> float:
        durations = list(seconds)
        for i in self.switch_ids:
            durations[i] += switch
        return self.precedence.makespan(durations)


class _PairSearch:
    """Branch and bound over the strategies of every role of one (placement, allocation)."""

    def __init__(self, pair: _Pair, threshold: float, stats: SearchStats, exact: Callable[[dict], float] | None):
        """exact: the simpy iteration time of a complete choice; None to stop at the first choice that fits."""
        self.pair, self.threshold, self.stats, self.exact = pair, threshold, stats, exact
        ctx = pair.ctx
        self.ctx = ctx
        self.usable = ctx.hw.memory.usable_bytes
        # The generating role first, then the roles that share its GPUs (they decide its KV-cache room).
        gen_set = pair.set_of_role.get(ctx.generator, -1)
        self.roles = sorted(pair.set_of_role, key=lambda r: (r != ctx.generator, pair.set_of_role[r] != gen_set,
                                                             not ctx.trains(r), r))
        self.gen_set = gen_set
        self._gen_cache: dict[tuple, list[float]] = {}
        self.gpus = {r: pair.allocation[pair.set_of_role[r]] for r in self.roles}
        self.own_ids = {r: [n.id for n in ctx.own_nodes(r)] for r in self.roles}
        self.gen_ids = [n.id for n in ctx.generate_nodes]
        self.arrays = {r: ctx.choices(r, self.gpus[r]) for r in self.roles}
        if ROLLOUT in self.arrays:
            self.arrays[ROLLOUT] = self._with_weight_sync(self.arrays[ROLLOUT])
        self.options = {r: a.options for r, a in self.arrays.items()}
        self.floor = [0.0] * len(ctx.dag.nodes)  # fastest any option can make each call
        self.min_switch = 0.0
        self.min_resident: dict[str, float] = {}
        for r in self.roles:
            floor = ctx.floor(r, self.gpus[r])
            if floor is None:
                continue
            for node_id, secs in zip(self.own_ids[r], floor.seconds, strict=True):
                self.floor[node_id] = secs
            if r == ctx.generator:
                for node_id, secs in zip(self.gen_ids, floor.gen, strict=True):
                    self.floor[node_id] = secs
                self.min_switch = floor.switch
            self.min_resident[r] = floor.resident
        for roles, gpus in zip(pair.placement, pair.allocation, strict=True):
            if len(roles) > 1:
                for node_id, secs in (ctx.set_floor(roles, gpus) or {}).items():
                    self.floor[node_id] = max(self.floor[node_id], secs)
        self.min_transient = {r: float(a.transient.min()) if len(a.options) else math.inf
                              for r, a in self.arrays.items()}
        self.best_time = math.inf
        self.best_choice: dict[str, RoleOption] | None = None
        self.unfit: tuple[tuple[str, ...], int] | None = None  # a set no strategy choice fits

    def _with_weight_sync(self, choices: RoleChoices) -> RoleChoices:
        """Rollout options with the weight sync this placement really pays (same node as the actor?)."""
        ctx, pair = self.ctx, self.pair
        same = pair.same_node(pair.set_of_role[generating_role(ctx.workload)], pair.set_of_role[ROLLOUT])
        gpus = self.gpus[ROLLOUT]
        synced = [replace(o, switch=switch_seconds(ctx.workload, ctx.hw, ctx.gpus_per_node, ROLLOUT, o.par, gpus, same,
                                                   ctx.memo))
                  for o in choices.options]
        return RoleChoices(synced)

    def _gen_seconds(self, option: RoleOption, kv_budget: float) -> list[float]:
        """Generate calls of `option` with `kv_budget` bytes per GPU for the KV cache (they depend on the
        budget only through how many sequences it holds)."""
        key = (option.gen_key, int(kv_budget // option.memory.kv_per_sequence))
        if key not in self._gen_cache:
            ctx, gpus = self.ctx, self.gpus[option.role]
            self._gen_cache[key] = [call_seconds(ctx.workload, ctx.hw, ctx.gpus_per_node, n, option.role, option.par,
                                                 gpus, kv_budget, ctx.memo) for n in ctx.generate_nodes]
        return self._gen_cache[key]

    def run(self) -> None:
        if any(not opts for opts in self.options.values()):
            return
        for roles, gpus in zip(self.pair.placement, self.pair.allocation, strict=True):
            if not self.ctx.set_fits(roles, gpus):
                self.unfit = (roles, gpus)
                return
        self._descend(0, {}, list(self.floor), self.min_switch)

    def _set_state(self, chosen: dict[str, RoleOption], index: int) -> tuple[float, float, bool]:
        """(held resident bytes, largest transient, complete?) of one set, the unchosen roles counted at
        their least memory."""
        held, transient, complete = 0.0, 0.0, True
        for r in self.pair.placement[index]:
            if r in chosen:
                held += chosen[r].memory.resident
                transient = max(transient, chosen[r].memory.transient)
            else:
                held += self.min_resident[r]
                transient = max(transient, self.min_transient[r])
                complete = False
        return held, transient, complete

    def _descend(self, depth: int, chosen: dict[str, RoleOption], seconds: list[float], switch: float) -> None:
        """Try every option of the next role, most promising first, while its bound (the schedule with
        the unchosen calls at their fastest) can still beat the best choice found."""
        if depth == len(self.roles):
            self._leaf(chosen, seconds, switch)
            return
        role = self.roles[depth]
        arrays = self.arrays[role]
        held, transient, _ = self._set_state(chosen, self.pair.set_of_role[role])
        held = held - self.min_resident[role] + arrays.resident
        transient = np.maximum(transient, arrays.transient)
        fits = held + transient <= self.usable
        if self.ctx.rules.agree is not None:
            fits &= self._agreeing(role, chosen, arrays)
        rows = np.tile(np.asarray(seconds, dtype=float), (len(arrays.options), 1))
        if self.own_ids[role]:
            rows[:, self.own_ids[role]] = arrays.seconds
        is_gen = role == self.ctx.generator
        if self.pair.set_of_role[role] == self.gen_set:
            self._bound_generation(role, chosen, arrays, held, fits, rows)
        switches = arrays.switch if is_gen else np.full(len(arrays.options), switch)
        bounds = self.pair.makespan_many(rows, switches)
        for k in np.argsort(np.where(fits, bounds, np.inf), kind="stable"):
            if not fits[k] or bounds[k] >= min(self.best_time, self.threshold):
                break
            option = arrays.options[k]
            self._descend(depth + 1, {**chosen, role: option}, rows[k].tolist(), float(switches[k]))

    def _agreeing(self, role: str, chosen: dict[str, RoleOption], arrays: RoleChoices) -> np.ndarray:
        """Which options of `role` agree with the facets of the roles chosen so far (Rules.agree)."""
        rules = self.ctx.rules
        values = {name: value for r, o in chosen.items() for name, value in rules.facets(r, o.par)}
        return np.array([agrees(rules.facets(role, o.par), values) for o in arrays.options], dtype=bool)

    def _bound_generation(self, role: str, chosen: dict[str, RoleOption], arrays: RoleChoices, held: np.ndarray,
                          fits: np.ndarray, rows: np.ndarray) -> None:
        """Generation calls at the KV-cache room left by the roles of its set chosen so far (the others
        at their least memory): more room never slows generation, so this stays a lower bound."""
        gen = self.ctx.generator
        for k in np.flatnonzero(fits):
            option = arrays.options[k] if role == gen else chosen[gen]
            need = option.memory
            budget = self.usable - float(held[k]) - need.gen_extra
            if budget < need.kv_per_sequence:
                fits[k] = False
                continue
            rows[k, self.gen_ids] = self._gen_seconds(option, budget)

    def _leaf(self, chosen: dict[str, RoleOption], seconds: list[float], switch: float) -> None:
        self.stats.strategy_choices += 1
        seconds = list(seconds)
        gen = self.ctx.generator
        if gen in chosen:
            index = self.pair.set_of_role[gen]
            held, transient, _ = self._set_state(chosen, index)
            need = chosen[gen].memory
            kv_budget = self.usable - held - need.gen_extra
            if kv_budget < need.kv_per_sequence:
                return
            for node_id, secs in zip(self.gen_ids, self._gen_seconds(chosen[gen], kv_budget), strict=True):
                seconds[node_id] = secs
        if self.exact is None:  # only asked whether anything fits
            self.best_time, self.best_choice = -math.inf, dict(chosen)
            return
        fast = self.pair.makespan(seconds, switch)
        if fast >= min(self.best_time, self.threshold):
            return
        pars = {r: o.par for r, o in chosen.items()}
        measured = self.exact(pars)
        self.stats.simpy_runs += 1
        if not math.isclose(measured, fast, rel_tol=1e-9, abs_tol=1e-12):
            raise AssertionError(f"search bound {fast} disagrees with the simpy engine {measured}")
        self.best_time, self.best_choice = measured, dict(chosen)


def search(workload: Workload, cluster: Cluster, top_k: int = 5, progress: Progress | None = None,
           jobs: int = 1, rules: Rules | None = None) -> SearchResult:
    """Best plans for `workload` on `cluster`, best first (at most top_k), within `rules` (none by
    default). Raises HfplanError when nothing fits."""
    started = time.perf_counter()
    hw, per_node = cluster.profile, cluster.gpus_per_node
    dag = trace(workload)
    ctx = SearchContext(workload, hw, per_node, dag, rules)
    stats = SearchStats()
    placements = list(ctx.rules.placements or space.set_partitions(workload.model_roles))
    stats.placements = len(placements)
    if jobs > 1:
        from hfplan.planner.pool import warm_floors

        warm_floors(ctx, cluster.gpus, jobs, progress)
    candidates: list[Candidate] = []
    kept: list[tuple[float, int, Candidate]] = []  # max-heap by time of the top_k best
    heap: list[tuple[float, int, int, tuple[int, ...]]] = []
    bounds = []
    seen_infeasible: set[tuple[int, int, int]] = set()
    for index, placement in enumerate(placements):
        pb = PlacementBounds(ctx, placement, cluster.gpus)
        bounds.append(pb)
        stats.allocations += pb.completions(())
        heapq.heappush(heap, (pb.bound(()), len(heap), index, ()))
    order = len(heap)
    while heap:
        threshold = -kept[0][0] if len(kept) >= top_k else math.inf
        bound, _, index, prefix = heapq.heappop(heap)
        pb, placement = bounds[index], placements[index]
        if progress is not None:
            progress("searching allocations", stats.evaluated + stats.pruned + stats.infeasible, stats.allocations)
        if bound >= threshold:
            # Best-first: every allocation left has a bound at least this large. An infinite bound
            # means no allocation under it fits at all.
            for b, _, i, p in [(bound, 0, index, prefix), *heap]:
                if math.isinf(b):
                    candidates.append(Candidate(placements[i], p, "infeasible", reason=_unbounded_reason(bounds[i], p)))
                    stats.infeasible += bounds[i].completions(p)
                    continue
                reason = f"bound {b:.4g} s >= {threshold:.4g} s, the slowest of the top {top_k}"
                candidates.append(Candidate(placements[i], p, "pruned", reason=reason))
                stats.pruned += bounds[i].completions(p)
            break
        if len(prefix) < pb.k:
            for child, why in pb.children(prefix):
                child_bound = pb.bound(child) if not why else math.inf
                if math.isinf(child_bound):
                    stats.infeasible += pb.completions(child)
                    key = (index, len(prefix), child[-1])
                    if key not in seen_infeasible:
                        seen_infeasible.add(key)
                        candidates.append(Candidate(placement, child, "infeasible",
                                                    reason=why or "some set fits with no GPU count left"))
                    continue
                order += 1
                heapq.heappush(heap, (child_bound, order, index, child))
            continue
        candidate = _evaluate_pair(ctx, placement, prefix, threshold, stats)
        candidates.append(candidate)
        if candidate.status == "evaluated":
            stats.evaluated += 1
            heapq.heappush(kept, (-candidate.iteration_s, len(candidates), candidate))
            if len(kept) > top_k:
                heapq.heappop(kept)
        elif candidate.status == "infeasible":
            stats.infeasible += 1
        else:
            stats.pruned += 1
    if progress is not None:
        progress("searching allocations", stats.allocations, stats.allocations)
    if not kept:
        raise HfplanError(_no_plan_message(ctx, cluster, candidates))
    best = sorted((c for _, _, c in kept), key=lambda c: c.iteration_s)
    top = [_to_plan(workload, cluster, dag, c) for c in best]
    stats.seconds = time.perf_counter() - started
    return SearchResult(top, candidates, stats)


def _unbounded_reason(pb: PlacementBounds, prefix: tuple[int, ...]) -> str:
    if pb.k - len(prefix) > pb.gpus - sum(prefix):
        return f"{pb.k} sets need at least one GPU each"
    return "some set fits with no GPU count it could still get"


def _alone_reason(ctx: SearchContext, placement, allocation) -> str:
    for roles, gpus in zip(placement, allocation, strict=True):
        for role in roles:
            if ctx.floor(role, gpus) is None:
                return f"{role} alone does not fit on {gpus} GPUs with any parallel layout"
    return "no strategy fits"


def _evaluate_pair(ctx: SearchContext, placement, allocation, threshold: float, stats: SearchStats) -> Candidate:
    pair = _Pair(ctx, placement, allocation)
    sets = [(roles, gpus) for roles, gpus in zip(placement, allocation, strict=True)]

    def exact(pars: dict[str, RoleParallelism]) -> float:
        plan_costs = PlanCosts(ctx.workload, sets, pars, ctx.hw, ctx.gpus_per_node, ctx.memo)
        return engine.run(ctx.dag, plan_costs).iteration_s

    bb = _PairSearch(pair, threshold, stats, exact)
    bb.run()
    if bb.best_choice is None:
        if not all(bb.options.values()):
            return Candidate(placement, allocation, "infeasible", reason=_alone_reason(ctx, placement, allocation))
        if bb.unfit is not None:
            roles, gpus = bb.unfit
            reason = f"{'+'.join(roles)} together fit on {gpus} GPUs with no strategies (memory per GPU)"
            return Candidate(placement, allocation, "infeasible", reason=reason)
        return Candidate(placement, allocation, "pruned", reason=f"no strategy choice beats {threshold:.4g} s")
    pars = {r: o.par for r, o in bb.best_choice.items()}
    plan_costs = PlanCosts(ctx.workload, sets, pars, ctx.hw, ctx.gpus_per_node, ctx.memo)
    peaks = tuple(round(m.peak / 2**30, 2) for m in plan_costs.memory)
    return Candidate(placement, allocation, "evaluated", bb.best_time, pars=pars, peak_gib=peaks)


def _to_plan(workload: Workload, cluster: Cluster, dag: Dag, c: Candidate) -> Plan:
    plan = Plan(workload=workload, cluster=cluster,
                placement=[PlacementSet(models=list(roles), gpus=gpus)
                           for roles, gpus in zip(c.placement, c.allocation, strict=True)],
                parallelism=c.pars)
    result = engine.simulate_plan(plan)
    return plan.model_copy(update={"estimate": result.estimate})


def _no_plan_message(ctx: SearchContext, cluster: Cluster, candidates: list[Candidate]) -> str:
    """Why nothing fits: the fewest GPUs that would, and the memory that decides it."""
    minimum = minimum_gpus(ctx)
    usable = ctx.hw.memory.usable_bytes / 2**30
    if minimum is None:
        return (f"no plan fits on {cluster.gpus} GPUs of {cluster.hardware} ({usable:.1f} GiB usable per GPU), nor on "
                f"any count up to 4096: some role fits on no set of GPUs (its weights, states or one sequence's "
                f"activations exceed the memory of every layout)")
    return (f"no plan fits on {cluster.gpus} GPUs of {cluster.hardware} ({usable:.1f} GiB usable per GPU): the "
            f"models need at least {minimum} GPUs (weights, optimizer states and KV cache per GPU)")


def minimum_gpus(ctx: SearchContext, limit: int = 4096) -> int | None:
    """Fewest GPUs on which some placement fits memory, trying every count up to `limit`; None when some
    role fits on no set of up to `limit` GPUs (or nothing fits up to there)."""
    # A larger set does not always fit what a smaller one does (its data-parallel ranks may outnumber the
    # batch: hfplan.layout.unsupported_split), so a role that fits nowhere is found by trying every size.
    sizes = space.set_sizes(limit, ctx.gpus_per_node)
    if any(all(ctx.floor(role, size) is None for size in sizes) for role in ctx.gpu_roles):
        return None
    placements = ctx.rules.placements or space.set_partitions(ctx.workload.model_roles)
    for gpus in range(1, limit + 1):
        for placement in placements:
            for allocation in space.allocations(len(placement), gpus, ctx.gpus_per_node, ctx.rules.power_of_two_sets):
                if all(ctx.set_fits(roles, size) for roles, size in zip(placement, allocation, strict=True)):
                    return gpus
    return None
