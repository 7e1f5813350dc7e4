"""Automatic device mapping (HybridFlow's Algorithm 1, made exact by branch and bound).

For every placement (set partition of the roles) and every allocation of the GPUs to its sets, find
the parallel strategies of every role that minimise the simulated iteration time, and keep the best
plans. The schedule of the simpy engine is a longest path over the traced DAG plus each set's
program-order chain, so it never shortens when a call lengthens. That gives exact bounds:
- an allocation whose sets, each role alone at its fastest, cannot beat the K-th best plan found so
  far is skipped (colocation only takes memory away);
- within an allocation, a partial choice of strategies whose schedule, with every unchosen call at its
  fastest, is no better than the best known is abandoned;
- a prefix's child (the next set sized) whose bound is at least the K-th best time so far is pruned when it is
  made, never held open: that time only falls, so a best-first walk would never pop it.
An allocation's best complete choice is run on the simpy engine, which gives its time (the fast schedule equals
it: checked there); where sets share a host's cores the engine may be slower than that schedule, a lower bound
then, so every choice that beats the best known is run.
A walk cut short by a time limit keeps that proof's other half: every allocation left open has a bound at least
the least one popped, so the best found is within best / that bound - 1 of the optimum (SearchResult.gap).
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from hfplan.errors import HfplanError
from hfplan.layout import ROLLOUT, facts_of, generating_role, model_role, set_index, staleness_problem
from hfplan.plan import PlacementSet, Plan, RoleParallelism
from hfplan.planner import space
from hfplan.planner.bounds import PlacementBounds
from hfplan.planner.context import SearchContext
from hfplan.planner.facts import SetKey
from hfplan.planner.fit import MemoryFront
from hfplan.planner.strategies import GenKey, RoleChoices, RoleOption, Rules, agrees
from hfplan.simulator import engine
from hfplan.simulator.mapping import PlanCosts, switch_seconds
from hfplan.simulator.pipeline import Pipelined
from hfplan.simulator.schedule import Precedence
from hfplan.simulator.trace import Dag, trace
from hfplan.spec import Cluster, Workload

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One (placement, allocation) pair and what the search concluded about it. Pruned and infeasible
    rows may stand for every allocation that starts with `allocation` (shorter than the placement)."""

    placement: tuple[tuple[str, ...], ...]
    allocation: tuple[int, ...]
    status: str  # evaluated | infeasible | pruned | open (not walked: the time limit came first)
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
    open: int = 0  # allocations left unwalked when the time limit came (their least bound is the lower bound)
    stopped_by: str = ""  # why the walk stopped early: "time limit" or "open prefixes" (MAX_OPEN_PREFIXES)
    twins: int = 0  # evaluated pairs left out of the top as twins of a kept plan
    strategy_choices: int = 0  # complete strategy choices reached by the branch and bound
    simpy_runs: int = 0
    seconds: float = 0.0


@dataclass
class SearchResult:
    top: list[Plan]
    candidates: list[Candidate]
    stats: SearchStats = field(default_factory=SearchStats)
    # No plan in the space is faster than this: the best plan's time when the walk finished, else the least bound
    # of the allocations it left open (best-first, so every one left has a bound at least as large).
    lower_bound: float = 0.0
    # A workload that allows staleness: the best synchronous plan and the best asynchronous one (None: none fits).
    synchronous: Plan | None = None
    asynchronous: Plan | None = None

    @property
    def best(self) -> Plan:
        return self.top[0]

    @property
    def gap(self) -> float:
        """How much slower the best plan may be than the optimum: 0 when it is the optimum."""
        return max(0.0, self.best.estimate.iteration_s / self.lower_bound - 1.0) if self.lower_bound > 0 else math.inf


class _Pair:
    """Fast schedule of one (placement, allocation): the schedule rule's precedence with the transfers
    of this allocation; durations come per strategy choice, the generating role's switch added at
    each switch point."""

    def __init__(self, ctx: SearchContext, placement: tuple[tuple[str, ...], ...], allocation: tuple[int, ...],
                 edge_seconds: Callable[[int, int, float], float] | None = None):
        """edge_seconds: the transfers' seconds by (source set, destination set, bytes); by default this
        allocation's (_unsized_prunes passes a lower bound over the allocations it stands for)."""
        self.ctx = ctx
        self.placement = placement
        self.allocation = allocation
        self.set_of_role = set_index(placement)
        # Only the sets' positions matter for transfers: no parallelism needed.
        where = PlanCosts(ctx.workload, list(zip(placement, allocation, strict=True)), {}, ctx.hw, ctx.gpus_per_node)
        self.same_node = where.same_node
        sets = [where.set_of(n) for n in ctx.dag.nodes]
        edges = where.edge_seconds if edge_seconds is None else edge_seconds
        self.precedence = Precedence.of(ctx.dag, sets, edges)
        self.openings = np.array(where.task_openings(ctx.dag))  # what the engine adds to the calls opening a task
        self.switch_ids = ctx.switch_ids
        # An asynchronous workload's time is its pipelined window, the weight sync after it
        self.pipelined = Pipelined.of(ctx.dag, sets, edges) if ctx.workload.staleness else None

    def makespan_many(self, seconds: np.ndarray, switch: np.ndarray) -> np.ndarray:
        """makespan() of many duration rows at once: seconds (rows x nodes), switch (rows,)."""
        seconds = seconds + self.openings
        if self.pipelined is not None:
            return self.pipelined.window_many(seconds, switch)
        if self.switch_ids:
            seconds[:, self.switch_ids] += switch[:, None]
        return self.precedence.makespan_many(seconds)

    def makespan(self, seconds: Sequence[float], switch: float) -> float:
        durations = [float(s) for s in np.asarray(seconds) + self.openings]
        if self.pipelined is not None:
            return self.pipelined.window(durations, switch)
        for i in self.switch_ids:
            durations[i] += switch
        return self.precedence.makespan(durations)


class _Unit(NamedTuple):
    """What the branch and bound chooses at one depth: one role's option, or a joint option of a colocated set's
    roles that do not generate."""

    name: str  # the role, or the set's roles joined by "+"
    roles: tuple[str, ...]
    set_index: int
    call_ids: list[int]  # node ids of its roles' own calls
    choices: RoleChoices


class _GenRoom(NamedTuple):
    """What the generate calls of an option depend on at a KV-cache budget: its generation layout and engine, and
    how many sequences the budget holds (KvSequence.slots)."""

    gen: GenKey | None
    slots: int
    bursts: int


class _Free(NamedTuple):
    """The sets of a placement after its first `sized` left unsized (_PairSearch's bound mode): the floor of each
    of their calls over every size they can still get, and their least switch (where one holds the generating
    role)."""

    sized: int
    row: np.ndarray  # by node id; only the unsized sets' own calls (and generate calls) are read
    switch: float


class _Held(NamedTuple):
    """The memory the chosen units of one set take together."""

    resident: float
    transient: float  # the largest


class _PairSearch:
    """Branch and bound over the strategies of every role of one (placement, allocation).

    It descends unit by unit: the generating role first, then each role that shares its GPUs (they decide
    its KV-cache room), then every other set as one unit of joint choices (RoleOptions.joint; its roles
    one by one when those are too many)."""

    def __init__(self, pair: _Pair, threshold: float, stats: SearchStats, exact: Callable[[dict], float] | None,
                 free: _Free | None = None, engine_slower: bool = False):
        """exact: the simpy iteration time of a complete choice; with `engine_slower` (sets sharing a host's
        cores, engine.Hosts, or a cost of calls after an idle wait, Compute.idle_wake) it may exceed the schedule's
        makespan, a lower bound of it. free: bound mode
        (_unsized_prunes): the placement's sets after its first free.sized are not sized, their calls stay at
        `free`'s floors, and the search only asks whether some choice of the sized sets' strategies has a schedule
        under `threshold` (best_time: the first such, no simpy run)."""
        self.pair, self.threshold, self.stats, self.exact, self.free = pair, threshold, stats, exact, free
        self.engine_slower = engine_slower
        ctx = pair.ctx
        self.ctx = ctx
        self.usable = ctx.hw.memory.usable_bytes
        gen_set = pair.set_of_role.get(ctx.generator, -1)
        self.gen_set = gen_set
        self.free_sets = set(range(free.sized, len(pair.placement))) if free is not None else set()
        sized = [r for r in pair.set_of_role if pair.set_of_role[r] not in self.free_sets]
        self.gpus = {r: pair.allocation[pair.set_of_role[r]] for r in sized}
        self.gen_ids = [n.id for n in ctx.generate_nodes]
        roles = sorted(sized, key=lambda r: (r != ctx.generator, pair.set_of_role[r] != gen_set,
                                             not ctx.trains(r), r))
        role_arrays = {r: ctx.options.choices(r, self.gpus[r]) for r in roles}
        if ROLLOUT in role_arrays:
            role_arrays[ROLLOUT] = self._with_weight_sync(role_arrays[ROLLOUT])
        self.options = {r: a.options for r, a in role_arrays.items()}
        self.units: list[_Unit] = []  # in descent order
        joined: set[int] = set()
        for r in roles:
            index = pair.set_of_role[r]
            group = pair.placement[index]
            # Joint options are pruned on seconds alone, so a rule set whose roles must agree (Rules.agree) chooses
            # role by role.
            alone = index == gen_set or len(group) == 1 or ctx.rules.agree is not None
            joint = None if alone else ctx.options.joint(group, self.gpus[r])
            if joint is None:
                self.units.append(_Unit(r, (r,), index, [n.id for n in ctx.own_nodes(r)], role_arrays[r]))
            elif index not in joined:
                joined.add(index)
                ids = [n.id for member in group for n in ctx.own_nodes(member)]
                self.units.append(_Unit("+".join(group), group, index, ids, joint))
        # For each unit, the least memory the units of its set after it in the descent can take together
        self.rest_front: list[MemoryFront] = []
        for depth, unit in enumerate(self.units):
            later = tuple(r for u in self.units[depth + 1:] if u.set_index == unit.set_index for r in u.roles)
            self.rest_front.append(ctx.fit.memory_front(later, pair.allocation[unit.set_index]))
        self._gen_cache: dict[_GenRoom, list[float]] = {}
        self.floor = list(ctx.controller_seconds)  # fastest any option can make each call
        self.min_switch = 0.0
        for r in roles:
            floor = ctx.bounds.floor(r, self.gpus[r])
            if floor is None:
                continue
            for node, secs in zip(ctx.own_nodes(r), floor.seconds, strict=True):
                self.floor[node.id] = secs
            if r == ctx.generator:
                for node_id, secs in zip(self.gen_ids, floor.gen, strict=True):
                    self.floor[node_id] = secs
                self.min_switch = floor.switch
        if free is not None:
            for r in (r for index in self.free_sets for r in pair.placement[index]):
                ids = [n.id for n in ctx.own_nodes(r)] + (self.gen_ids if r == ctx.generator else [])
                for node_id in ids:
                    self.floor[node_id] = float(free.row[node_id])
                if r == ctx.generator:
                    self.min_switch = free.switch
        for index, (group, gpus) in enumerate(zip(pair.placement, pair.allocation, strict=True)):
            if len(group) > 1 and index not in self.free_sets:
                for node_id, secs in (ctx.bounds.set_floor(group, gpus) or {}).items():
                    self.floor[node_id] = max(self.floor[node_id], secs)
        self.best_time = math.inf
        self.best_choice: dict[str, RoleOption] | None = None
        self.unfit: SetKey | None = None  # a set no strategy choice fits

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
        kv = option.memory.kv  # the room decides generation through the sequences held at once (KvSequence.slots)
        key = _GenRoom(option.gen_key, int(kv_budget // kv.slot), int(kv_budget // kv.burst))
        if key not in self._gen_cache:
            ctx, gpus = self.ctx, self.gpus[option.role]
            self._gen_cache[key] = [ctx.seconds(n, option.role, option.par, gpus, kv_budget)
                                    for n in ctx.generate_nodes]
        return self._gen_cache[key]

    def run(self) -> None:
        if any(not opts for opts in self.options.values()):
            return
        for index, (roles, gpus) in enumerate(zip(self.pair.placement, self.pair.allocation, strict=True)):
            if index not in self.free_sets and not self.ctx.fit.set_fits(roles, gpus):
                self.unfit = self.ctx.set_key(roles, gpus)
                return
        self._descend(0, {}, list(self.floor), self.min_switch)

    def _held(self, chosen: dict[str, RoleOption], index: int) -> _Held:
        """The memory the chosen units of set `index` take."""
        resident, transient = 0.0, 0.0
        for unit in self.units:
            if unit.set_index == index and unit.name in chosen:
                resident += chosen[unit.name].memory.resident
                transient = max(transient, chosen[unit.name].memory.transient)
        return _Held(resident, transient)

    def _descend(self, depth: int, chosen: dict[str, RoleOption], seconds: list[float], switch: float) -> None:
        """Try every option of the next unit, most promising first, while its bound (the schedule with
        the unchosen calls at their fastest) can still beat the best choice found. An option is tried
        only if the units of its set still to choose can fit beside it (rest_front)."""
        if depth == len(self.units):
            self._leaf(chosen, seconds, switch)
            return
        unit = self.units[depth]
        name, index, own_ids, arrays = unit.name, unit.set_index, unit.call_ids, unit.choices
        front = self.rest_front[depth]
        if front.empty:
            return  # the units after it in its set fit together with no choice
        held = self._held(chosen, index)
        mine = held.resident + arrays.resident
        room = self.usable - mine[:, None] - front.resident[None, :]
        ok = room >= np.maximum(np.maximum(held.transient, arrays.transient)[:, None], front.transient[None, :])
        gen = self.ctx.generator
        if index == self.gen_set:
            need = arrays.gen_need if name == gen else chosen[gen].memory.gen_extra + chosen[gen].memory.kv_per_sequence
            ok &= room >= np.reshape(need, (-1, 1))
        fits = ok.any(axis=1)
        if self.ctx.rules.agree is not None:
            fits &= self._agreeing(name, chosen, arrays)
        rows = np.tile(np.asarray(seconds, dtype=float), (len(arrays.options), 1))
        if own_ids:
            rows[:, own_ids] = arrays.seconds
        if index == self.gen_set:
            self._bound_generation(name, chosen, arrays, mine + float(front.resident.min()), fits, rows)
        switches = arrays.switch if name == gen else np.full(len(arrays.options), switch)
        bounds = self.pair.makespan_many(rows, switches)
        order = [int(k) for k in np.argsort(np.where(fits, bounds, np.inf), kind="stable")
                 if fits[k] and bounds[k] < min(self.best_time, self.threshold)]
        if depth == len(self.units) - 2 and self.units[-1].set_index != self.gen_set:
            self._last_two(depth, chosen, order, rows, switches)
            return
        for k in order:
            if bounds[k] >= min(self.best_time, self.threshold):
                break
            self._descend(depth + 1, {**chosen, name: arrays.options[k]}, rows[k].tolist(), float(switches[k]))

    def _agreeing(self, role: str, chosen: dict[str, RoleOption], arrays: RoleChoices) -> np.ndarray:
        """Which options of `role` agree with the facets of the roles chosen so far (Rules.agree)."""
        rules = self.ctx.rules
        values = {name: value for r, o in chosen.items() for name, value in rules.facets(r, o.par)}
        return np.array([agrees(rules.facets(role, o.par), values) for o in arrays.options], dtype=bool)

    def _last_two(self, depth: int, chosen: dict[str, RoleOption], order: list[int], rows: np.ndarray,
                  switches: np.ndarray, batch_rows: int = 20_000) -> None:
        """The last two units at once: every option of the last (outside the generating set, so it leaves
        generation alone) beside each option `order` keeps of the one before, in one schedule over all
        pairs; then leaves in the same order the descent would take them."""
        name, arrays = self.units[depth].name, self.units[depth].choices
        final = self.units[-1]
        last = final.choices
        n = len(last.options)
        per_batch = max(1, batch_rows // max(1, n))
        for start in range(0, len(order), per_batch):
            ks = order[start:start + per_batch]
            grid = np.repeat(rows[ks], n, axis=0)
            if final.call_ids:
                grid[:, final.call_ids] = np.tile(last.seconds, (len(ks), 1))
            spans = self.pair.makespan_many(grid, np.repeat(switches[ks], n)).reshape(len(ks), n)
            for row, k in enumerate(ks):
                if float(spans[row].min()) >= min(self.best_time, self.threshold):
                    continue
                picked = {**chosen, name: arrays.options[k]}
                held = self._held(picked, final.set_index)
                fits = held.resident + last.resident + np.maximum(held.transient, last.transient) <= self.usable
                if self.ctx.rules.agree is not None:
                    fits &= self._agreeing(final.name, picked, last)
                for m in np.argsort(np.where(fits, spans[row], np.inf), kind="stable"):
                    if not fits[m] or spans[row, m] >= min(self.best_time, self.threshold):
                        break
                    self._leaf({**picked, final.name: last.options[m]}, grid[row * n + m].tolist(),
                               float(switches[k]))

    def _bound_generation(self, name: str, chosen: dict[str, RoleOption], arrays: RoleChoices, held: np.ndarray,
                          fits: np.ndarray, rows: np.ndarray) -> None:
        """Generation calls at the KV-cache room left by the units of its set chosen so far (the others
        at their least memory, `held`): more room never slows generation, so this stays a lower bound."""
        gen = self.ctx.generator
        for k in np.flatnonzero(fits):
            option = arrays.options[k] if name == gen else chosen[gen]
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
        if gen in self.gpus:  # else the generating role's set is unsized: its calls stay at their floors
            held = self._held(chosen, self.gen_set)
            need = chosen[gen].memory
            kv_budget = self.usable - held.resident - need.gen_extra
            if kv_budget < need.kv_per_sequence:
                return
            for node_id, secs in zip(self.gen_ids, self._gen_seconds(chosen[gen], kv_budget), strict=True):
                seconds[node_id] = secs
        fast = self.pair.makespan(seconds, switch)
        if fast >= min(self.best_time, self.threshold):
            return
        if self.free is not None:
            # Bound mode: one choice under the threshold settles it (the prefix cannot be pruned), so stop the
            # descent: every comparison against min(best_time, threshold) now fails.
            self.best_time, self.threshold = fast, -math.inf
            return
        picked = {r: o for unit in chosen.values() for r, o in unit.parts.items()}
        if not self.engine_slower:
            # The fast schedule is the engine's time here: one run checks the pair's best choice (finish).
            self.best_time, self.best_choice = fast, picked
            return
        measured = self.exact({r: o.par for r, o in picked.items()})
        self.stats.simpy_runs += 1
        slower = measured > fast  # sets computing at once on a shared host, calls after a wait
        if not (slower or math.isclose(measured, fast, rel_tol=1e-9, abs_tol=1e-12)):
            raise AssertionError(f"search bound {fast} disagrees with the simpy engine {measured}")
        if measured >= min(self.best_time, self.threshold):
            return
        self.best_time, self.best_choice = measured, picked

    def finish(self) -> None:
        """Where the engine is not slower, the best choice's time by the simpy engine, which the fast schedule equals
        (checked here, once per pair: a choice beaten later within the pair needs no run); else each leaf ran it."""
        if self.best_choice is None or self.exact is None or self.engine_slower:
            return
        measured = self.exact({r: o.par for r, o in self.best_choice.items()})
        self.stats.simpy_runs += 1
        if not math.isclose(measured, self.best_time, rel_tol=1e-9, abs_tol=1e-12):
            raise AssertionError(f"search bound {self.best_time} disagrees with the simpy engine {measured}")
        self.best_time = measured


def _cyclic_gc_paused(fn: Callable[..., SearchResult]) -> Callable[..., SearchResult]:
    """Run fn with the cyclic garbage collector paused. A search allocates hundreds of thousands of objects
    (cost tables, parts, options) and frees them by reference counting, as nothing of it forms a cycle: the
    collector's full passes over everything alive took a tenth of a 64-GPU search and freed nothing."""

    @functools.wraps(fn)
    def paused(*args, **kwargs) -> SearchResult:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@_cyclic_gc_paused
def search(workload: Workload, cluster: Cluster, top_k: int = 5, progress: Progress | None = None,
           jobs: int = 1, rules: Rules | None = None, time_limit: float | None = None,
           engines: tuple[str, ...] = ("torch",)) -> SearchResult:
    """Best plans for `workload` on `cluster`, best first (at most top_k; twins counted once), within
    `rules`; None: hfplan's own space, every placement both with the hybrid engine and with a separate
    rollout set, using at most the cluster's GPUs (a workload with staleness > 0 given rules: they place a rollout
    set apart from training, as _sync_and_async's do). time_limit: seconds from the start after which the walk of
    the allocations stops, the ones left marked open and the result's lower_bound their least bound (None: walk
    to the end: the best is the optimum). engines: the rollout engines hfplan's own space generates with
    (Rules.engines). Raises HfplanError when nothing fits, or when the cluster is more
    than the search can cover (check_scale)."""
    started = time.perf_counter()
    check_scale(cluster)
    if workload.staleness and rules is None:
        return _sync_and_async(workload, cluster, top_k, progress, jobs, time_limit, engines)
    hw, per_node = cluster.profile, cluster.gpus_per_node
    dag = trace(workload)
    own = rules is None
    hybrid = SearchContext(workload, hw, per_node, dag, Rules(idle_gpus=True, engines=engines) if own else rules)
    contexts = [hybrid]
    if own:
        contexts.append(SearchContext(workload, hw, per_node, dag, Rules(rollout=True, idle_gpus=True, engines=engines),
                                      shared=hybrid))
    stats = SearchStats()
    entries = [(ctx, placement) for ctx in contexts for placement in ctx.placements]
    stats.placements = len(entries)
    if jobs > 1:
        from hfplan.planner.pool import warm_floors

        for ctx in contexts:
            warm_floors(ctx, cluster.gpus, jobs, progress)
    candidates: list[Candidate] = []
    kept: list[tuple[float, int, Candidate]] = []  # max-heap by time of the top_k best
    kept_twins: dict[tuple, list[float]] = {}  # twin key -> times of the kept plans with it
    heap: list[tuple[float, int, int, tuple[int, ...]]] = []
    bounds = []
    seen_infeasible: dict[tuple[int, int], np.ndarray] = {}  # (placement, depth) -> sizes given a row
    seen_padded: set[tuple[int, int, int]] = set()
    for index, (ctx, placement) in enumerate(entries):
        pb = PlacementBounds(ctx.bounds, placement, cluster.gpus, top_k)
        bounds.append(pb)
        stats.allocations += pb.completions(())
        heapq.heappush(heap, (pb.bound(()), len(heap), index, ()))
        if progress is not None:
            progress("bounding placements", index + 1, len(entries))
    order = len(heap)
    lower_bound = math.inf  # the least bound left open; infinite when the walk ends
    dive: tuple[float, int, tuple[int, ...]] | None = None  # the next prefix, taken out of best-first order
    while heap or dive is not None:
        threshold = -kept[0][0] if len(kept) >= top_k else math.inf
        popped = dive is None  # best-first: every entry left has a bound at least this one's
        if dive is not None:
            (bound, index, prefix), dive = dive, None
        else:
            bound, _, index, prefix = heapq.heappop(heap)
        crowded = len(heap) + len(candidates) > MAX_OPEN_PREFIXES
        late = crowded or (time_limit is not None and time.perf_counter() - started > time_limit)
        if popped and late and kept and bound < threshold:
            lower_bound = bound
            stats.stopped_by = "open prefixes" if crowded else "time limit"
            for b, _, i, p in [(bound, 0, index, prefix), *heap]:
                reason = f"not walked ({stats.stopped_by}): bound {b:.4g} s"
                candidates.append(Candidate(entries[i][1], p, "open", reason=reason))
                stats.open += bounds[i].completions(p)
            break
        pb, (ctx, placement) = bounds[index], entries[index]
        if progress is not None:
            progress("searching allocations", stats.evaluated + stats.pruned + stats.infeasible, stats.allocations)
        if popped and bound >= threshold:
            # Best-first: every allocation left has a bound at least this large. An infinite bound
            # means no allocation under it fits at all.
            for b, _, i, p in [(bound, 0, index, prefix), *heap]:
                if math.isinf(b):
                    candidates.append(Candidate(entries[i][1], p, "infeasible", reason=_unbounded_reason(bounds[i], p)))
                    stats.infeasible += bounds[i].completions(p)
                    continue
                reason = f"bound {b:.4g} s >= {threshold:.4g} s, the slowest of the top {top_k}"
                candidates.append(Candidate(entries[i][1], p, "pruned", reason=reason))
                stats.pruned += bounds[i].completions(p)
            break
        if len(prefix) < pb.k:
            kids = pb.child_bounds(prefix, threshold)
            finite = np.isfinite(kids.bounds)
            below = finite & (kids.bounds < threshold)
            # A child whose bound is at least the K-th best time so far is never walked (that time only falls): it
            # is pruned now rather than held open, one row for the prefix where no child is under it.
            under = bool(below.any())
            if under and _unsized_prunes(ctx, pb, prefix, threshold, stats):
                reason = (f"no strategy choice of the sized sets beats {threshold:.4g} s with the others at their "
                          f"fastest on any size left")
                candidates.append(Candidate(placement, prefix, "pruned", reason=reason))
                stats.pruned += pb.completions(prefix)
                continue
            for child, cover in pb.padded_children(prefix):
                stats.pruned += pb.completions(child)
                key = (index, len(prefix), child[-1])
                if key not in seen_padded:
                    seen_padded.add(key)
                    others = f" (nor than on {top_k - 1} other smaller sizes)" if top_k > 1 else ""
                    candidates.append(Candidate(placement, child, "pruned",
                                                reason=f"padded: no better than with this set on {cover} GPUs and "
                                                       f"the rest idle{others}"))
            depth = len(prefix)
            nowhere = kids.js[~finite]  # nothing under these children fits: one row per (placement, depth, size)
            if len(nowhere):
                stats.infeasible += pb.child_completions(prefix, nowhere)
                seen = seen_infeasible.setdefault((index, depth), np.zeros(len(pb.sizes), dtype=bool))
                for j in nowhere[~seen[nowhere]].tolist():
                    why = "" if pb.feasible[depth, j] else pb.why[(depth, j)]
                    candidates.append(Candidate(placement, (*prefix, pb.sizes[j]), "infeasible",
                                                reason=why or "some set fits with no GPU count left"))
                seen[nowhere] = True
            beaten = kids.js[finite & ~below]
            if len(beaten):
                stats.pruned += len(beaten) if depth + 1 == pb.k else pb.child_completions(prefix, beaten)
                if under:
                    above = f"bound at least {threshold:.4g} s, the slowest of the top {top_k}"
                    candidates.extend(Candidate(placement, (*prefix, pb.sizes[j]), "pruned", reason=above)
                                      for j in beaten.tolist())
            for j, child_bound in zip(kids.js[below].tolist(), kids.bounds[below].tolist(), strict=True):
                child = (*prefix, pb.sizes[j])
                if late and not kept and (dive is None or child_bound < dive[0]):
                    # Past the time limit with no plan yet: dive to a complete allocation (the most promising
                    # child next) so that a plan, and with it a gap, comes soon; the other children wait in the heap.
                    if dive is not None:
                        order += 1
                        heapq.heappush(heap, (dive[0], order, dive[1], dive[2]))
                    dive = (child_bound, index, child)
                    continue
                order += 1
                heapq.heappush(heap, (child_bound, order, index, child))
            if len(beaten) and not under:
                reason = (f"no size of set {len(prefix) + 1} gives a bound under {threshold:.4g} s, the slowest of the "
                          f"top {top_k}")
                candidates.append(Candidate(placement, prefix, "pruned", reason=reason))
            continue
        candidate = _evaluate_pair(ctx, placement, prefix, threshold, stats)
        if candidate.status == "evaluated":
            stats.evaluated += 1
            key = twin_key(workload, candidate)
            if any(math.isclose(t, candidate.iteration_s, rel_tol=1e-9) for t in kept_twins.get(key, ())):
                stats.twins += 1
                candidate = replace(candidate, reason="twin of a plan kept: the same with roles holding one model "
                                                      "swapped, and the same time")
            else:
                kept_twins.setdefault(key, []).append(candidate.iteration_s)
                heapq.heappush(kept, (-candidate.iteration_s, len(candidates), candidate))
                if len(kept) > top_k:
                    _, _, dropped = heapq.heappop(kept)
                    kept_twins[twin_key(workload, dropped)].remove(dropped.iteration_s)
        elif candidate.status == "infeasible":
            stats.infeasible += 1
        else:
            stats.pruned += 1
        candidates.append(candidate)
    if progress is not None:
        progress("searching allocations", stats.allocations, stats.allocations)
    if not kept:
        raise HfplanError(_no_plan_message(contexts, cluster))
    best = sorted((c for _, _, c in kept), key=lambda c: c.iteration_s)
    top = [_to_plan(workload, cluster, dag, c) for c in best]
    stats.seconds = time.perf_counter() - started
    return SearchResult(top, candidates, stats, min(lower_bound, best[0].iteration_s))


# The staleness an asynchronous plan runs with: the pipelined window is the same for every staleness >= 1
# (hfplan.simulator.pipeline), so the least stale.
ASYNC_STALENESS = 1


def _sync_and_async(workload: Workload, cluster: Cluster, top_k: int, progress: Progress | None, jobs: int,
                    time_limit: float | None, engines: tuple[str, ...]) -> SearchResult:
    """A workload that allows staleness: hfplan's space synchronously (staleness 0), and its plans with a rollout set
    apart from training asynchronously (staleness 1, the pipelined window), each searched exactly; the best of both
    kept, and each side's best reported. A time limit covers both: the second gets what the first left."""
    sync = search(workload.model_copy(update={"staleness": 0}), cluster, top_k, progress, jobs, None, time_limit,
                  engines)
    pipelined_workload = workload.model_copy(update={"staleness": ASYNC_STALENESS})
    placements = tuple(p for p in space.set_partitions((*workload.model_roles, ROLLOUT))
                       if staleness_problem(pipelined_workload, p) is None)
    left = None if time_limit is None else max(0.0, time_limit - sync.stats.seconds)
    try:
        pipelined = search(pipelined_workload, cluster, top_k, progress, jobs,
                           Rules(placements=placements, rollout=True, idle_gpus=True, engines=engines), left)
    except HfplanError:  # no plan with a rollout set of its own fits
        return replace(sync, synchronous=sync.best)
    return replace(merge_results([sync, pipelined], top_k), synchronous=sync.best, asynchronous=pipelined.best)


def merge_results(results: Sequence[SearchResult], top_k: int) -> SearchResult:
    """Searches of parts of one space as one: the best top_k of all, every candidate, the counts added."""
    top = sorted((p for r in results for p in r.top), key=lambda p: p.estimate.iteration_s)[:top_k]
    stats = SearchStats()
    for r in results:
        for name in ("placements", "allocations", "evaluated", "pruned", "infeasible", "open", "twins",
                     "strategy_choices", "simpy_runs", "seconds"):
            setattr(stats, name, getattr(stats, name) + getattr(r.stats, name))
        stats.stopped_by = stats.stopped_by or r.stats.stopped_by
    return replace(results[0], top=top, candidates=[c for r in results for c in r.candidates], stats=stats,
                   lower_bound=min(r.lower_bound for r in results))


def twin_key(workload: Workload, c: Candidate) -> tuple:
    """The (placement, allocation) with each role replaced by what it is (its model, whether it trains
    or generates, its head): pairs that map onto each other by swapping roles holding the same model
    have one key. Two evaluated pairs with one key and the same time are twins, shown once."""

    def what(role: str) -> tuple:
        facts = facts_of(workload, role)
        return (role == ROLLOUT, workload.models[model_role(workload, role)], facts.trains, facts.generates,
                facts.head)

    return tuple(sorted((gpus, tuple(sorted(what(r) for r in roles)))
                        for roles, gpus in zip(c.placement, c.allocation, strict=True)))


# The most GPUs the search covers: 4,096 nodes of 8.
MAX_GPUS = 32_768
# Up to here a partial last node is searched (its GPUs as sets under a node); past it, whole nodes only.
PARTIAL_NODE_GPUS = 2_048


# Past PARTIAL_NODE_GPUS, the seconds a search walks unless told otherwise (default_time_limit).
DEFAULT_TIME_LIMIT_S = 60.0
# The most prefixes the walk holds open, with the rows of candidates it has written: past them it stops as at its time
# limit, with its proven gap (memory: an open prefix is a heap entry and a row when the walk stops, a pruned child a
# row at once: 7 million rows with the rest of a 32,768-GPU search took 2.2 GB, so the cap is a few GiB).
MAX_OPEN_PREFIXES = 20_000_000


def default_time_limit(cluster: Cluster) -> float | None:
    """The time limit of a search of `cluster` that names none (hfplan search without --time-limit): none up to
    PARTIAL_NODE_GPUS GPUs, whose walks end (the best optimal); past it DEFAULT_TIME_LIMIT_S, so that a walk that
    cannot end soon still stops, its best reported with its proven gap to the optimum."""
    return None if cluster.gpus <= PARTIAL_NODE_GPUS else DEFAULT_TIME_LIMIT_S


def check_scale(cluster: Cluster) -> None:
    """Refuse a cluster the search does not cover (more than MAX_GPUS, or past PARTIAL_NODE_GPUS a GPU count that
    is not whole nodes), naming why, in one line."""
    gpus, per_node = cluster.gpus, cluster.gpus_per_node
    if gpus > MAX_GPUS:
        raise HfplanError(f"--gpus {gpus:,} is beyond the search: it covers at most {MAX_GPUS:,} GPUs. Plan for fewer "
                          f"GPUs: a plan may leave GPUs idle")
    if gpus > PARTIAL_NODE_GPUS and gpus % per_node:
        raise HfplanError(f"--gpus {gpus:,} is not whole nodes of {per_node} GPUs: past {PARTIAL_NODE_GPUS:,} GPUs the "
                          f"search covers whole nodes only (try {gpus - gpus % per_node:,})")


def _unbounded_reason(pb: PlacementBounds, prefix: tuple[int, ...]) -> str:
    if pb.k - len(prefix) > pb.gpus - sum(prefix):
        return f"{pb.k} sets need at least one GPU each"
    return "some set fits with no GPU count it could still get"


def _alone_reason(ctx: SearchContext, placement, allocation) -> str:
    for roles, gpus in zip(placement, allocation, strict=True):
        for role in roles:
            if ctx.bounds.floor(role, gpus) is None:
                return f"{role} alone does not fit on {gpus} GPUs with any parallel layout"
    return "no strategy fits"


def _unsized_prunes(ctx: SearchContext, pb: PlacementBounds, prefix: tuple[int, ...], threshold: float,
                    stats: SearchStats) -> bool:
    """Whether no allocation completing `prefix` (its first sets sized, the rest not) can beat `threshold`, proved by
    one branch and bound over the sized sets' strategies for every size the others can take, instead of one per
    allocation: in particular the allocations that differ only in how many GPUs the last set takes and how many stay
    idle.

    Proof. A completion gives each unsized set some size; its time is the schedule's longest path (the fast
    schedule, equal to the simpy engine's) over its calls and transfers. (1) A set of whole nodes shares no node
    with another set (sets hold disjoint GPUs), so when every sized set is whole nodes, a transfer to or from a
    sized set, and a sized rollout set's weight sync, cross nodes in every completion; a transfer between two
    unsized sets may or may not, so it costs at least the lesser of the two (`near`: the unsized sets on one node,
    `far`: each on nodes of its own). (2) The sized sets have their sizes, so the same strategy choices, memory and
    KV-cache room as in the completion. (3) Each call of an unsized set takes at least its floor on the size it
    gets, so at least the least floor over every size it can still get (PlacementBounds.unsized_floor, generation
    at the most room alone), and the switch at least the least switch. The longest path never shortens when a
    duration lengthens, so each completion's time is at least the schedule of some choice of the sized sets with
    the rest at these bounds. If the branch and bound finds none under the threshold (the K-th best time so far; it
    only falls), no completion is under it, and none would have been kept: the walk's plans are the same.
    Returns False when this does not apply, or when some sized set fits with no choice (the walk then says why)."""
    k, per_node = len(pb.placement), ctx.gpus_per_node
    unsized = k - len(prefix)
    if math.isinf(threshold) or not prefix or not 0 < unsized <= per_node or any(size % per_node for size in prefix):
        return False
    floor = pb.unsized_floor(prefix)
    if floor is None:
        return False
    sets = list(pb.placement)
    near = PlanCosts(ctx.workload, list(zip(sets, (*prefix, *[1] * unsized), strict=True)), {}, ctx.hw, per_node)
    far_allocation = (*prefix, *[per_node] * unsized)
    far = PlanCosts(ctx.workload, list(zip(sets, far_allocation, strict=True)), {}, ctx.hw, per_node)

    def edge_seconds(src: int, dst: int, nbytes: float) -> float:
        return min(near.edge_seconds(src, dst, nbytes), far.edge_seconds(src, dst, nbytes))

    pair = _Pair(ctx, pb.placement, far_allocation, edge_seconds)
    bb = _PairSearch(pair, threshold, stats, None, _Free(len(prefix), *floor))
    bb.run()
    return all(bb.options.values()) and bb.unfit is None and math.isinf(bb.best_time)


def _evaluate_pair(ctx: SearchContext, placement, allocation, threshold: float, stats: SearchStats) -> Candidate:
    pair = _Pair(ctx, placement, allocation)
    sets = [(roles, gpus) for roles, gpus in zip(placement, allocation, strict=True)]

    run = engine.run_pipelined if ctx.workload.staleness else engine.run

    def exact(pars: dict[str, RoleParallelism]) -> float:
        plan_costs = PlanCosts(ctx.workload, sets, pars, ctx.hw, ctx.gpus_per_node, ctx.memo)
        return run(ctx.dag, plan_costs).iteration_s

    shared_hosts = (ctx.hw.compute.host_parallelism is not None  # GPUs: no PlanCosts to build per pair
                    and PlanCosts(ctx.workload, sets, {}, ctx.hw, ctx.gpus_per_node).host_ranks() is not None)
    engine_slower = shared_hosts or ctx.hw.compute.idle_wake is not None
    bb = _PairSearch(pair, threshold, stats, exact, engine_slower=engine_slower)
    bb.run()
    bb.finish()
    if bb.best_choice is None:
        if not all(bb.options.values()):
            return Candidate(placement, allocation, "infeasible", reason=_alone_reason(ctx, placement, allocation))
        if bb.unfit is not None:
            unfit = bb.unfit
            reason = f"{'+'.join(unfit.roles)} together fit on {unfit.gpus} GPUs with no strategies (memory per GPU)"
            return Candidate(placement, allocation, "infeasible", reason=reason)
        return Candidate(placement, allocation, "pruned", reason=f"no strategy choice beats {threshold:.4g} s")
    pars = {r: bb.best_choice[r].par for roles in placement for r in roles}  # in placement order
    plan_costs = PlanCosts(ctx.workload, sets, pars, ctx.hw, ctx.gpus_per_node, ctx.memo)
    peaks = tuple(round(m.peak / 2**30, 2) for m in plan_costs.memory)
    return Candidate(placement, allocation, "evaluated", bb.best_time, pars=pars, peak_gib=peaks)


def _to_plan(workload: Workload, cluster: Cluster, dag: Dag, c: Candidate) -> Plan:
    plan = Plan(workload=workload, cluster=cluster,
                placement=[PlacementSet(models=list(roles), gpus=gpus)
                           for roles, gpus in zip(c.placement, c.allocation, strict=True)],
                parallelism=c.pars)
    plan = _with_engine_batch(plan, dag)
    result = engine.simulate_plan(plan)
    return plan.model_copy(update={"estimate": result.estimate})


def _with_engine_batch(plan: Plan, dag: Dag) -> Plan:
    """The plan with its generation engine capped at the batch the simulator chose (GenConfig.max_batch),
    so that `hfplan execute` runs the waves or slots the estimate assumes; a vLLM engine also gets the
    gpu_memory_utilization that gives its KV cache the room the plan was costed with."""
    plan_costs = PlanCosts.of_plan(plan)
    batch = plan_costs.engine_batch(dag)
    if batch is None:
        return plan
    role = plan_costs.generator
    par = plan.parallelism[role]
    update: dict = {"max_batch": batch}
    if par.gen.engine == "vllm":
        update["gpu_memory_utilization"] = plan_costs.vllm_memory_utilization()
    capped = par.model_copy(update={"gen": par.gen.model_copy(update=update)})
    return plan.model_copy(update={"parallelism": {**plan.parallelism, role: capped}})


def _no_plan_message(contexts: list[SearchContext], cluster: Cluster) -> str:
    """Why nothing fits: the fewest GPUs that would, and the memory that decides it."""
    found = [m for m in (minimum_gpus(ctx) for ctx in contexts) if m is not None]
    usable = contexts[0].hw.memory.usable_bytes / 2**30
    if not found:
        return (f"no plan fits on {cluster.gpus} GPUs of {cluster.hardware} ({usable:.1f} GiB usable per GPU), nor on "
                f"any count up to 4096: some role fits on no set of GPUs (its weights, states or one sequence's "
                f"activations exceed the memory of every layout)")
    return (f"no plan fits on {cluster.gpus} GPUs of {cluster.hardware} ({usable:.1f} GiB usable per GPU): the "
            f"models need at least {min(found)} GPUs (weights, optimizer states and KV cache per GPU)")


def minimum_gpus(ctx: SearchContext, limit: int = 4096) -> int | None:
    """Fewest GPUs on which some placement fits memory, trying every count up to `limit`; None when some
    role fits on no set of up to `limit` GPUs (or nothing fits up to there)."""
    # A larger set does not always fit what a smaller one does (its data-parallel ranks may outnumber the
    # batch: hfplan.layout.unsupported_split), so a role that fits nowhere is found by trying every size.
    sizes = space.set_sizes(limit, ctx.gpus_per_node)
    if any(all(ctx.bounds.floor(role, size) is None for size in sizes) for role in ctx.gpu_roles):
        return None
    for gpus in range(1, limit + 1):
        for placement in ctx.placements:
            for allocation in space.allocations(len(placement), gpus, ctx.gpus_per_node, ctx.rules.power_of_two_sets):
                if all(ctx.fit.set_fits(roles, size) for roles, size in zip(placement, allocation, strict=True)):
                    return gpus
    return None
