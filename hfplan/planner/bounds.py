"""Lower bounds of the iteration time: the floors of calls, and over GPU allocations for a best-first walk.

A role's floor on A GPUs is the fastest each of its calls can be over every strategy that fits alone (a rollout
set's weight sync at its cheaper case), whatever it is colocated with. A colocated set of roles that do not generate
has a tighter one, over the choices that fit together.

An allocation is built set by set (a prefix of sizes), using at most the cluster's GPUs. Its bound is
the schedule rule's longest path (hfplan.simulator.schedule) with every call at its floor and every
transfer at the cheaper of its costs on and off one node (mapping.least_transfer_seconds). Idle GPUs
(Rules.idle_gpus) change nothing here: the floor of a set not yet sized is over
every size it can still get, at most what is left.
For a set not yet sized, the floor is taken over every size it could still get, so the bound of a
prefix is below the bound of every allocation that extends it: a prefix whose bound cannot beat the
K-th best plan found so far can be dropped with everything below it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import NamedTuple

import numpy as np

from hfplan.layout import ON_CONTROLLER, ROLLOUT, set_index
from hfplan.planner import space
from hfplan.planner.facts import RoleKey, SearchFacts, SetKey
from hfplan.planner.options import RoleOptions
from hfplan.planner.pareto import pareto
from hfplan.simulator.mapping import least_transfer_seconds, switch_seconds
from hfplan.simulator.pipeline import Pipelined
from hfplan.simulator.schedule import Precedence


@dataclass(frozen=True)
class Floor:
    """The fastest each call of a role can be on A GPUs (over every strategy that fits alone), and its
    least switch and resident memory: lower bounds, whatever it is colocated with."""

    seconds: tuple[float, ...]  # own calls, as in own_nodes
    gen: tuple[float, ...]  # generate calls (generating role)
    switch: float
    resident: float


class GeneratorRows(NamedTuple):
    """A set holding the generating role, one row per option of that role (Floors.generator_rows)."""

    rows: np.ndarray  # (options, calls in node order): the set's calls, 0 for the others
    switch: np.ndarray  # each option's switch (a rollout set's weight sync at its cheaper case)
    apart: np.ndarray  # each option's switch where the generating set shares no node with the actor's


class SetBound(NamedTuple):
    """A set's part of an allocation bound."""

    row: np.ndarray  # the floor of every call the set runs, 0 for the others (node order)
    switch: float  # the generating role's least switch, if the set holds it
    why: str  # why it cannot fit ('' when each role can alone)


class SetTable(NamedTuple):
    """A colocated set's part of the bounds at every size of a walk (Floors.set_table): its SetBounds stacked by size,
    their running minima over the sizes up to each, and the sizes left out as padded. It depends on the set's roles and
    the sizes alone, so the placements holding one set share it."""

    rows: np.ndarray  # (sizes, nodes): SetBound.row at each size, 0 where it cannot fit
    switch: np.ndarray  # (sizes,)
    feasible: np.ndarray  # (sizes,) bool
    why: dict[int, str]  # size index -> why the set cannot fit on that size
    best_rows: np.ndarray  # (sizes, nodes): the elementwise least row over every feasible size up to each
    best_switch: np.ndarray
    apart: np.ndarray  # (sizes,): switch where the set shares no node with the actor's (least GeneratorRows.apart)
    best_apart: np.ndarray  # (sizes,): the least of apart over every feasible size up to each
    padded: dict[int, int]  # Floors.padded_sizes


class ChildBounds(NamedTuple):
    """The children of a prefix (PlacementBounds.child_bounds): the next set's sizes, as indices into
    PlacementBounds.sizes (ascending), and each child's bound (infinite: nothing under it fits)."""

    js: np.ndarray
    bounds: np.ndarray


class _GeneratorTable(NamedTuple):
    """GeneratorRows at every size of one placement's generating set, stacked: size j's options are rows
    start[j] to start[j] + count[j]."""

    rows: np.ndarray  # (options, the generating role's own and generate calls: PlacementBounds.gen_cols)
    switch: np.ndarray
    apart: np.ndarray
    start: np.ndarray
    count: np.ndarray


@dataclass
class BoundCaches:
    """What Floors computed, by key; a search's two contexts (hybrid engine, rollout set) share one."""

    floors: dict[RoleKey, Floor | None] = field(default_factory=dict)
    set_floors: dict[SetKey, dict[int, float] | None] = field(default_factory=dict)
    set_bounds: dict[SetKey, SetBound] = field(default_factory=dict)
    generator_rows: dict[SetKey, GeneratorRows | None] = field(default_factory=dict)
    covers: dict[tuple[RoleKey, int, bool], bool] = field(default_factory=dict)  # (larger, smaller, alone)
    set_tables: dict[tuple[SetKey, tuple[int, ...], int], SetTable] = field(default_factory=dict)  # (set, sizes, plans)
    option_seconds: dict[RoleKey, np.ndarray | None] = field(default_factory=dict)


class Floors:
    """The floors of roles and of colocated sets on A GPUs, from their options."""

    def __init__(self, facts: SearchFacts, options: RoleOptions, caches: BoundCaches | None = None) -> None:
        self.facts, self.options = facts, options
        self.caches = BoundCaches() if caches is None else caches

    def has_floor(self, role: str, gpus: int) -> bool:
        """Whether floor(role, gpus) is cached already."""
        return self.facts.role_key(role, gpus) in self.caches.floors

    def floor(self, role: str, gpus: int) -> Floor | None:
        """Lower bounds of the role's calls on `gpus` GPUs; None when no strategy fits. For trained roles
        it comes from the families (the minimum of each part), without building every combination."""
        key = self.facts.role_key(role, gpus)
        if key not in self.caches.floors:
            self.caches.floors[key] = self._floor(role, gpus)
        return self.caches.floors[key]

    def _floor(self, role: str, gpus: int) -> Floor | None:
        f = self.facts
        nodes = f.own_nodes(role)
        if not f.trains(role):
            opts = self.options.choices(role, gpus)
            if not opts.options:
                return None
            return Floor(tuple(opts.seconds.min(axis=0)) if nodes else (),
                         tuple(opts.alone_gen.min(axis=0)) if opts.alone_gen.size else (),
                         float(opts.switch.min()), float(opts.resident.min()))
        families = self.options.families(role, gpus)
        if not families:
            return None
        update_at = [k for k, n in enumerate(nodes) if n.kind == "update"]
        forward_at = [k for k, n in enumerate(nodes) if n.kind == "forward"]
        seconds = [math.inf] * len(nodes)
        gen = [math.inf] * len(f.generate_nodes) if role == f.generator else []
        for family in families:
            for parts, at in ((family.trains, update_at), (family.infers, forward_at)):
                for part in parts:
                    for k, value in zip(at, part.seconds, strict=True):
                        seconds[k] = min(seconds[k], value)
            for part in family.gens:
                gen = [min(a, b) for a, b in zip(gen, part.alone, strict=True)]
        switch = min(part.switch for family in families for part in family.gens)
        return Floor(tuple(seconds), tuple(gen), switch, min(family.resident for family in families))

    def set_floor(self, roles: tuple[str, ...], gpus: int, limit: int = 200_000) -> dict[int, float] | None:
        """For colocated roles that do not generate: the fastest each call (by node id) can be over the choices
        that fit together (tighter than each role alone, since colocation takes memory away). None when the
        choices are too many to enumerate (`limit`) or nothing fits."""
        f = self.facts
        key = f.set_key(roles, gpus)
        if key in self.caches.set_floors:
            return self.caches.set_floors[key]
        choices = [self.options.choices(r, gpus) for r in roles]
        sizes = [len(c.options) for c in choices]
        result = None
        if f.generator not in roles and all(sizes) and math.prod(sizes) <= limit:
            grid = np.indices(sizes).reshape(len(roles), -1)
            held = sum(c.resident[g] for c, g in zip(choices, grid, strict=True))
            transient = np.max([c.transient[g] for c, g in zip(choices, grid, strict=True)], axis=0)
            fits = held + transient <= f.usable
            if fits.any():
                result = {}
                for role, c, g in zip(roles, choices, grid, strict=True):
                    chosen = g[fits]
                    for k, node in enumerate(f.own_nodes(role)):
                        result[node.id] = float(c.seconds[chosen, k].min())
        self.caches.set_floors[key] = result
        return result

    def set_bound(self, roles: tuple[str, ...], gpus: int) -> SetBound:
        """A set's part of an allocation bound: each role's floor on its calls."""
        f = self.facts
        key = f.set_key(roles, gpus)
        if key not in self.caches.set_bounds:
            row, switch, why = np.zeros(len(f.dag.nodes)), 0.0, ""
            for role in roles:
                floor = self.floor(role, gpus)
                if floor is None:
                    why = f"{role} alone does not fit on {gpus} GPUs with any parallel layout"
                    break
                for node, secs in zip(f.own_nodes(role), floor.seconds, strict=True):
                    row[node.id] = secs
                if role == f.generator:
                    for node, secs in zip(f.generate_nodes, floor.gen, strict=True):
                        row[node.id] = secs
                    switch = floor.switch
            self.caches.set_bounds[key] = SetBound(row, switch, why)
        return self.caches.set_bounds[key]

    def set_table(self, roles: tuple[str, ...], sizes: tuple[int, ...], plans: int) -> SetTable:
        """SetTable of colocated `roles` on each of `sizes` (ascending), the walk keeping `plans` best plans."""
        key = (self.facts.set_key(roles, 0), sizes, plans)
        if key not in self.caches.set_tables:
            rows = np.zeros((len(sizes), len(self.facts.dag.nodes)))
            switch = np.zeros(len(sizes))
            feasible = np.ones(len(sizes), dtype=bool)
            why: dict[int, str] = {}
            for j, size in enumerate(sizes):
                bound = self.set_bound(roles, size)
                if bound.why:
                    feasible[j], why[j] = False, bound.why
                else:
                    rows[j], switch[j] = bound.row, bound.switch
            best_rows = np.minimum.accumulate(np.where(feasible[:, None], rows, np.inf), axis=0)
            best_switch = np.minimum.accumulate(np.where(feasible, switch, np.inf))
            apart = switch.copy()
            if self.facts.generator == ROLLOUT and ROLLOUT in roles:
                for j, size in enumerate(sizes):
                    gen = self.generator_rows(roles, size) if feasible[j] else None
                    if gen is not None:
                        apart[j] = gen.apart.min()
            best_apart = np.minimum.accumulate(np.where(feasible, apart, np.inf))
            padded = self.padded_sizes(roles, sizes, plans)
            self.caches.set_tables[key] = SetTable(rows, switch, feasible, why, best_rows, best_switch, apart,
                                                   best_apart, padded)
        return self.caches.set_tables[key]

    def generator_rows(self, roles: tuple[str, ...], gpus: int) -> GeneratorRows | None:
        """For a set holding the generating role, a bound per option of that role: its own calls as the option makes
        them, its generate calls with all memory it does not hold for the KV cache (alone_gen: colocated roles only
        take room away, and more room never slows generation), its switch (a rollout set's at its cheaper case), the
        set's other roles at their floors; rows no faster on any call than another are left out. Every strategy
        choice of the set is at or above one of these rows, so their least makespan is a lower bound, tighter than
        set_bound's, whose generating role takes each call's fastest over options that cannot all be chosen at
        once. None when the set cannot fit or its generating role has no option."""
        f = self.facts
        key = f.set_key(roles, gpus)
        if key not in self.caches.generator_rows:
            bound, result = self.set_bound(roles, gpus), None
            choices = self.options.choices(f.generator, gpus)
            if not bound.why and choices.options:
                cols = [n.id for n in f.own_nodes(f.generator)] + [n.id for n in f.generate_nodes]
                rows = np.tile(bound.row, (len(choices.options), 1))
                rows[:, cols] = np.concatenate([choices.seconds, choices.alone_gen], axis=1)
                apart = choices.switch
                if f.generator == ROLLOUT:
                    apart = np.array([switch_seconds(f.workload, f.hw, f.gpus_per_node, ROLLOUT, o.par, gpus, False,
                                                     f.memo) for o in choices.options])
                kept = pareto(np.column_stack([rows[:, cols], choices.switch, apart]))
                result = GeneratorRows(rows[kept], choices.switch[kept], apart[kept])
            self.caches.generator_rows[key] = result
        return self.caches.generator_rows[key]

    def option_seconds(self, role: str, gpus: int) -> np.ndarray | None:
        """The own calls' seconds (columns as in own_nodes) of each of the role's options on `gpus` GPUs, only the rows
        no other is at least as fast as on every call; None when no option fits. Every option's row is at or above
        one of them: what a bound by option needs (PlacementBounds._by_role_option)."""
        key = self.facts.role_key(role, gpus)
        if key not in self.caches.option_seconds:
            seconds = self.options.choices(role, gpus).seconds
            self.caches.option_seconds[key] = seconds[pareto(seconds)] if len(seconds) else None
        return self.caches.option_seconds[key]

    def padded_sizes(self, roles: tuple[str, ...], sizes: Sequence[int], plans: int = 1) -> dict[int, int]:
        """The sizes (of `sizes`, ascending) at which a set of `roles` is no better than at `plans` smaller ones with
        the difference idle (covers), each mapped to the nearest of those; the walk leaves them out and still finds
        the `plans` best times. Empty where the rule does not hold (Rules.idle_gpus off, roles that must agree on
        facets, a set holding the generating role).

        Proof. (a) One cover. Let the set take s GPUs, s' < s, both whole nodes, and let every option of each role
        on s have one on s' no slower on any of its calls and, where the set holds several roles, needing no more
        resident or transient memory (_covers). Take any allocation with the set on s and any strategy choice of
        it; give the set s' instead, the other sets their sizes (the s - s' GPUs idle: Rules.idle_gpus), each role
        of the set its covering option. (1) It fits: a role alone fits with any of its options (RoleOptions keeps
        only those), and a colocated set's memory per GPU only fell; the other sets are unchanged. (2) No transfer
        is slower: a set of whole nodes shares a node with no other set at either size, and the sets smaller than a
        node lie after every set of whole nodes (mapping.set_offsets: largest first), whose GPUs stay a multiple of
        a node, so which sets share a node is unchanged; the bytes moved do not depend on sizes. (3) No call is
        slower: the set's own calls by covering, every other call unchanged (the set holds no generating role, so
        no KV-cache room or switch changes; a rollout set's weight sync depends on its own size and on sharing a
        node, unchanged). The iteration time is a longest path that never shortens when a call lengthens, so the
        new plan is no slower. Covering is transitive.
        (b) `plans` covers. Leave s out when at least `plans` smaller sizes cover it. Its `plans` smallest covers are
        then never left out: were the j-th smallest left out, its own `plans` covers, all smaller, would cover s
        too, though only j - 1 < `plans` covers of s are smaller. So every plan left out has `plans` distinct plans
        in the walk no slower (one per cover, by (a)): the `plans` best times are unchanged, and every plan left
        out is no better than the `plans`-th best, as a pruned one is.
        Each size is compared with the nearest smaller sizes not left out, at most `plans` + 3 of them (any covers
        found suffice for (b); more comparisons would only find more)."""
        f = self.facts
        if not f.rules.idle_gpus or f.rules.agree is not None or f.generator in roles:
            return {}
        alone = len(roles) == 1
        kept: list[int] = []
        out: dict[int, int] = {}
        for size in sizes:
            if size % f.gpus_per_node:
                continue
            if all(self.options.choices(r, size).options for r in roles):
                nearest = reversed(kept[-(plans + 3):])
                covers = [u for u in nearest if all(self._covers(r, u, size, alone) for r in roles)]
                if len(covers) >= plans:
                    out[size] = covers[0]
                    continue
            kept.append(size)
        return out

    def _covers(self, role: str, smaller: int, larger: int, alone: bool) -> bool:
        """Whether every option of `role` on `larger` GPUs has one on `smaller` no slower on any of its calls (the
        switch too, though only the generating role's counts) and, unless the role is `alone` on its GPUs, needing
        no more resident or transient memory (padded_sizes)."""
        key = (self.facts.role_key(role, larger), smaller, alone)
        if key not in self.caches.covers:
            a, b = self.options.choices(role, larger), self.options.choices(role, smaller)
            result = bool(b.options)
            if result and a.options:
                big, small = (np.column_stack([c.seconds, c.switch, *(() if alone else (c.resident, c.transient))])
                              for c in (a, b))
                result = bool((small[None, :, :] <= big[:, None, :]).all(axis=2).any(axis=1).all())
            self.caches.covers[key] = result
        return self.caches.covers[key]


class PlacementBounds:
    """Bounds of the allocations of one placement on at most `gpus` GPUs, by prefix."""

    def __init__(self, floors: Floors, placement: tuple[tuple[str, ...], ...], gpus: int, plans: int = 1) -> None:
        """plans: how many best plans the walk keeps (padded sizes leave none of their times out)."""
        self.floors, self.placement, self.gpus = floors, placement, gpus
        facts = self.facts = floors.facts
        sizes = space.set_sizes(gpus, facts.gpus_per_node)
        if facts.rules.power_of_two_sets:
            sizes = [s for s in sizes if s & (s - 1) == 0]
        self.sizes = sizes
        self.size_array = np.array(sizes)
        self.index_of = {size: j for j, size in enumerate(sizes)}
        self.k = len(placement)
        where = set_index(placement)
        sets = [ON_CONTROLLER if r is None else where[r] for r in facts.runners]
        # Every transfer at the cheaper of its two costs (sharing a node or not): what it takes at least whatever
        # the sizes, and the schedule never ends earlier when a transfer takes longer
        def edges(src: int, dst: int, nbytes: float) -> float:
            return least_transfer_seconds(facts.hw, src, dst, nbytes)

        self.precedence = Precedence.of(facts.dag, sets, edges)
        self.switch_ids = facts.switch_ids
        # An asynchronous workload's bound is its pipelined window's, the weight sync after it
        self.pipelined = Pipelined.of(facts.dag, sets, edges) if facts.workload.staleness else None
        # rows[i, j]: floor seconds of set i's calls on sizes[j]; feasible[i, j]; switch[i, j]; best_rows[i, j]: the
        # set's floors over every feasible size up to sizes[j] (elementwise minimum); each set's from its SetTable
        tables = [floors.set_table(roles, tuple(sizes), plans) for roles in placement]
        self.rows = np.stack([t.rows for t in tables])
        self.switch = np.stack([t.switch for t in tables])
        self.feasible = np.stack([t.feasible for t in tables])
        self.why = {(i, j): why for i, t in enumerate(tables) for j, why in t.why.items()}
        self.best_rows = np.stack([t.best_rows for t in tables])
        self.best_switch = np.stack([t.best_switch for t in tables])
        self.apart_switch = np.stack([t.apart for t in tables])
        self.best_apart = np.stack([t.best_apart for t in tables])
        held = [i for i, roles in enumerate(placement) if facts.generator in roles]
        self.gen_set = held[0] if held else None  # the set holding the generating role
        self.actor_set = where.get(facts.trained_generator)  # the set whose weights a rollout set receives
        self.gen_cols = [n.id for n in facts.own_nodes(facts.generator)] + [n.id for n in facts.generate_nodes]
        # padded[i]: the sizes at which set i is no better than at a smaller one (Floors.padded_sizes), left out
        self.padded = [t.padded for t in tables]
        self._kept = [~np.isin(self.size_array, list(padded)) for padded in self.padded]  # the sizes not padded

    def _largest_index(self, limit: int) -> int:
        """Index of the largest allowed size <= limit (-1 if none)."""
        return int(np.searchsorted(self.sizes, limit, side="right")) - 1

    def bound(self, prefix: tuple[int, ...]) -> float:
        """Lower bound of every allocation that starts with `prefix` (sizes of the first sets)."""
        left = self.gpus - sum(prefix)
        unsized = self.k - len(prefix)
        seconds = np.array(self.facts.controller_seconds)
        switch = 0.0
        for i, size in enumerate(prefix):
            j = self.index_of[size]
            seconds += self.rows[i, j]
            switch += self.switch[i, j]
        if unsized:
            j = self._largest_index(left - (unsized - 1))  # the others need at least one GPU each
            if j < 0:
                return np.inf
            for i in range(len(prefix), self.k):
                seconds += self.best_rows[i, j]
                switch += self.best_switch[i, j]
        return self._makespan(seconds, switch)

    def unsized_floor(self, prefix: tuple[int, ...]) -> tuple[np.ndarray, float] | None:
        """The floor of each call of the sets `prefix` leaves unsized (by node id, 0 for the others), each over
        every size it can still get (the GPUs left, less one for each other unsized set), and their least switch;
        None when some unsized set fits on no size left."""
        unsized = self.k - len(prefix)
        j = self._largest_index(self.gpus - sum(prefix) - (unsized - 1))  # the others need at least one GPU each
        if j < 0:
            return None
        row = self.best_rows[len(prefix):, j].sum(axis=0)
        switch = float(self.best_switch[len(prefix):, j].sum())
        if prefix and self._apart_unsized(prefix[:-1], np.array(prefix[-1:]))[0]:
            g = self.gen_set
            switch += float(self.best_apart[g, j] - self.best_switch[g, j])
        if not np.all(np.isfinite(row)) or not np.isfinite(switch):
            return None
        return row, switch

    def _makespan(self, seconds: np.ndarray, switch: float) -> float:
        if not np.all(np.isfinite(seconds)) or not np.isfinite(switch):
            return np.inf
        durations = [float(x) for x in seconds]
        if self.pipelined is not None:
            return self.pipelined.window(durations, switch)
        for i in self.switch_ids:
            durations[i] += switch
        return self.precedence.makespan(durations)

    def children(self, prefix: tuple[int, ...], threshold: float = math.inf
                 ) -> list[tuple[tuple[int, ...], float, str]]:
        """child_bounds as (child prefix, its bound, '' or why that size is infeasible), one per child."""
        kids = self.child_bounds(prefix, threshold)
        index = len(prefix)
        return [(prefix + (self.sizes[j],), float(b), "" if self.feasible[index, j] else self.why[(index, j)])
                for j, b in zip(kids.js.tolist(), kids.bounds.tolist(), strict=True)]

    def child_bounds(self, prefix: tuple[int, ...], threshold: float = math.inf) -> ChildBounds:
        """Sizes the next set can take and their bounds, all in one schedule (bound() of each, at once). Once the set
        holding the generating role is sized, a child's bound is by that role's options (_by_generator_option), at
        least its bound by the floors alone; a child whose floors' bound is at least `threshold` keeps that one (it
        is at least `threshold` either way, so the walk prunes it the same), and only the others are scheduled
        option by option."""
        index = len(prefix)
        left = self.gpus - sum(prefix)
        unsized_after = self.k - index - 1
        js = np.flatnonzero((self.size_array <= left - unsized_after) & self._kept[index]).tolist()
        if not unsized_after and not self.facts.rules.idle_gpus:
            js = [j for j in js if self.sizes[j] == left]  # the last set takes every GPU left
        if not js:
            return ChildBounds(np.zeros(0, dtype=int), np.zeros(0))
        base = np.array(self.facts.controller_seconds)
        switch = 0.0
        for i, size in enumerate(prefix):
            j = self.index_of[size]
            base = base + self.rows[i, j]
            switch += self.switch[i, j]
        rows = base + self.rows[index, js]
        switches = switch + self.switch[index, js]
        if unsized_after:
            # the largest size each later set could get (>= 0: size 1 exists)
            limits = np.searchsorted(self.sizes, left - self.size_array[js] - (unsized_after - 1), side="right") - 1
            apart = self._apart_unsized(prefix, self.size_array[js])
            for i in range(index + 1, self.k):
                rows += self.best_rows[i, limits]
                switches += np.where(apart, self.best_apart[i, limits], self.best_switch[i, limits]) \
                    if i == self.gen_set else self.best_switch[i, limits]
        rows[~self.feasible[index, js]] = np.inf
        if self.gen_set is not None and self.gen_set <= index:
            g = self.gen_set  # sized: its switch across nodes where it cannot share one with the actor's set
            switches += self._gen_switch(prefix, js) - (self.switch[g, js] if g == index
                                                        else self.switch[g, self.index_of[prefix[g]]])
        bounds = self._makespans(rows.copy(), switches)
        if self.gen_set is not None and self.gen_set <= index:
            low = np.flatnonzero(bounds < threshold)
            if len(low):
                bounds[low] = self._by_generator_option(prefix, [js[i] for i in low], rows[low], switches[low])
        low = np.flatnonzero(bounds < threshold)
        if len(low):
            bounds[low] = np.maximum(bounds[low], self._by_role_option(prefix, [js[i] for i in low], rows[low],
                                                                          switches[low]))
        return ChildBounds(np.array(js), bounds)

    def padded_children(self, prefix: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
        """The children that children() leaves out as padded (Floors.padded_sizes), each with the smaller size
        whose child is no worse."""
        index = len(prefix)
        room = self.gpus - sum(prefix) - (self.k - index - 1)
        return [(prefix + (size,), cover) for size, cover in self.padded[index].items() if size <= room]

    def _makespans(self, rows: np.ndarray, switches: np.ndarray) -> np.ndarray:
        if self.pipelined is not None:
            return self.pipelined.window_many(rows, switches)
        if self.switch_ids:
            rows[:, self.switch_ids] += switches[:, None]
        return self.precedence.makespan_many(rows)  # an infinite floor anywhere makes its bound infinite

    def _by_generator_option(self, prefix: tuple[int, ...], js: list[int], rows: np.ndarray, switches: np.ndarray
                             ) -> np.ndarray:
        """children's bounds once the set holding the generating role is sized: the least over that role's options
        (Floors.generator_rows) of the schedule with the set's calls as the option makes them, a rollout set's
        weight sync across nodes where it cannot share one with the actor's set (_apart)."""
        g, index = self.gen_set, len(prefix)
        child = self.size_array[js]
        gen_js = np.array(js) if g == index else np.full(len(js), self.index_of[prefix[g]])
        apart = self._apart(prefix, self.size_array[gen_js], child)
        table = self._generator_table
        counts = np.where(np.isfinite(rows).all(axis=1), table.count[gen_js], 0)  # nothing fits: rows infinite already
        out = np.full(len(js), np.inf)
        if not counts.any():
            return out
        # every (child, option of the generating set's size) row, in one schedule
        owner = np.repeat(np.arange(len(js)), counts)
        option = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(
            table.start[gen_js], counts)
        grid = rows[owner]
        grid[:, self.gen_cols] = table.rows[option]
        own = np.where(apart[owner], table.apart[option], table.switch[option])
        spans = self._makespans(grid, switches[owner] - self._gen_switch(prefix, js)[owner] + own)
        np.minimum.at(out, owner, spans)
        return out

    def _by_role_option(self, prefix: tuple[int, ...], js: list[int], rows: np.ndarray, switches: np.ndarray
                        ) -> np.ndarray:
        """children's bounds by the options of each role of a sized set but the generating one: for each such role,
        the least over its options (Floors.option_seconds) of the schedule with its own calls as the option makes
        them and every other call at its floor; the largest of these over the roles (-inf where none applies).

        Proof. Take any allocation under a child and any strategy choice of it. The role's option is one of its
        choices on its set's size (_PairSearch chooses among them, or among joint options made of them), and its own
        calls take that option's seconds whatever shares its GPUs (only generate calls depend on the room left),
        which are at or above one of the rows kept. Every other call takes at least its floor (the row given: a
        sized set's on its size, an unsized one's over every size it can still get), every transfer at least its
        least cost and each switch at least the least switch. The longest path never shortens when a duration
        lengthens, so the plan's time is at least that row's schedule, so at least the least over the rows. This
        holds for each role, so for the largest over them. It never takes a call at its fastest over options
        of which no single one is that fast on every call of the role (a trained role's update and its
        inference calls come from one layout), which the floors alone do."""
        index, f = len(prefix), self.facts
        out = np.full(len(js), -np.inf)
        for i in range(index + 1):
            set_js = js if i == index else [self.index_of[prefix[i]]] * len(js)
            for role in self.placement[i]:
                cols = [n.id for n in f.own_nodes(role)]
                if role == f.generator or not cols:
                    continue
                tables = [self.floors.option_seconds(role, self.sizes[j]) for j in set_js]
                counts = np.array([0 if t is None else len(t) for t in tables])
                if not counts.any():
                    continue
                owner = np.repeat(np.arange(len(js)), counts)
                grid = rows[owner]
                grid[:, cols] = np.concatenate([t for t in tables if t is not None])
                best = np.full(len(js), np.inf)
                np.minimum.at(best, owner, self._makespans(grid, switches[owner]))
                best[counts == 0] = -np.inf  # no option to bound by (the set cannot fit: its rows are infinite)
                out = np.maximum(out, best)
        return out

    def _gen_switch(self, prefix: tuple[int, ...], js: list[int]) -> np.ndarray:
        """For each child (the next set at size index in `js`), once the set holding the generating role is sized:
        its least switch, across nodes where it cannot share a node with the actor's set (_apart)."""
        g, index = self.gen_set, len(prefix)
        gen_js = np.array(js) if g == index else np.full(len(js), self.index_of[prefix[g]])
        apart = self._apart(prefix, self.size_array[gen_js], self.size_array[js])
        return np.where(apart, self.apart_switch[g, gen_js], self.switch[g, gen_js])

    @cached_property
    def _generator_table(self) -> _GeneratorTable:
        """Floors.generator_rows of the set holding the generating role at every size, stacked."""
        parts = [self.floors.generator_rows(self.placement[self.gen_set], size) if self.feasible[self.gen_set, j]
                 else None for j, size in enumerate(self.sizes)]
        count = np.array([0 if p is None else len(p.switch) for p in parts])
        kept = [p for p in parts if p is not None]
        width = len(self.gen_cols)
        return _GeneratorTable(
            np.concatenate([p.rows[:, self.gen_cols] for p in kept]) if kept else np.zeros((0, width)),
            np.concatenate([p.switch for p in kept]) if kept else np.zeros(0),
            np.concatenate([p.apart for p in kept]) if kept else np.zeros(0),
            np.cumsum(count) - count, count)

    def _apart(self, prefix: tuple[int, ...], gen_sizes: np.ndarray, child: np.ndarray) -> np.ndarray:
        """For each child (the next set at `child` GPUs, the generating set's at `gen_sizes`): whether the set
        holding the generating role shares no node with the actor's, whatever the rest. Sets lie on consecutive
        GPUs, so two share one node only if their GPUs together fit on it, and a set holding both (a rollout engine
        beside the actor) is on one node only if its GPUs fit on one (PlanCosts.same_node: its first and last GPU on
        one node). False while the actor's set is not sized."""
        a, index = self.actor_set, len(prefix)
        if a is not None and a == self.gen_set:
            return gen_sizes > self.facts.gpus_per_node
        if a is None or a > index:
            return np.zeros(len(child), dtype=bool)
        actor = child if a == index else np.full(len(child), prefix[a])
        return gen_sizes + actor > self.facts.gpus_per_node

    def _apart_unsized(self, prefix: tuple[int, ...], child: np.ndarray) -> np.ndarray:
        """For each child (the next set at `child` GPUs) of `prefix`: whether the set holding the generating role, not
        sized yet, shares no node with the actor's whatever size it gets. The actor's set sized at a node or more
        does: two sets share a node only if their GPUs together fit on it (_apart), and the other takes one GPU
        at least. False where the actor's set is not sized, or holds the generating role."""
        a, index = self.actor_set, len(prefix)
        if a is None or a > index or a == self.gen_set or self.gen_set is None or self.gen_set <= index:
            return np.zeros(len(child), dtype=bool)
        actor = child if a == index else np.full(len(child), prefix[a])
        return actor >= self.facts.gpus_per_node

    def completions(self, prefix: tuple[int, ...]) -> int:
        """How many complete allocations start with `prefix`."""
        return self._counts[self.k - len(prefix)][self.gpus - sum(prefix)]

    def child_completions(self, prefix: tuple[int, ...], js: np.ndarray) -> int:
        """completions() of the children of `prefix` at size indices `js`, added up."""
        table, left = self._counts[self.k - len(prefix) - 1], self.gpus - sum(prefix)
        return sum(table[left - size] for size in self.size_array[js].tolist())

    @cached_property
    def _counts(self) -> list[list[int]]:
        return _counts(tuple(self.sizes), self.gpus, self.facts.rules.idle_gpus, self.k)


@cache
def _counts(sizes: tuple[int, ...], gpus: int, idle: bool, sets: int) -> list[list[int]]:
    """table[m][g]: ways to give m sets sizes from `sizes` (ascending) using all g GPUs (with `idle`, at most g),
    for every m <= sets and g <= gpus: table[m][g] = sum over sizes s <= g of table[m - 1][g - s]. The largest
    sizes are whole nodes d, 2d, ..., kd, whose part of that sum runs along g in steps of d (run[g] = prev[g - d] +
    run[g - d] - prev[g - (k + 1) d]), so a table costs sets x gpus x (the other sizes), not x (every size)."""
    d, k = _progression(sizes)
    others = sizes[:len(sizes) - k]
    table = [[1] * (gpus + 1) if idle else [1] + [0] * gpus]
    for _ in range(sets):
        prev, cur, run = table[-1], [0] * (gpus + 1), [0] * (gpus + 1)
        for g in range(gpus + 1):
            if k and g >= d:
                run[g] = prev[g - d] + run[g - d] - (prev[g - d * (k + 1)] if g >= d * (k + 1) else 0)
            cur[g] = run[g] + sum(prev[g - s] for s in others if s <= g)
        table.append(cur)
    return table


def _progression(sizes: tuple[int, ...]) -> tuple[int, int]:
    """(d, k) of the longest run of largest sizes that are d, 2d, ..., kd; k = 0 when there is none."""
    n = len(sizes)
    for k in range(n, 0, -1):
        d = sizes[n - k]
        if all(sizes[n - k + i] == d * (i + 1) for i in range(k)):
            return d, k
    return 0, 0
