"""Parallel strategies of one role on A GPUs, kept only where not dominated, with the fastest each call
can be (its floor), for bounding.

The iteration time never decreases when a call gets longer (each set runs its calls in program order,
so the schedule is a longest path), and a set that fits keeps fitting when a role needs less memory.
So a strategy that is no faster on any call and needs no less memory than another can never be
needed: dropping it cannot lose the optimum. Everything else is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hfplan.layout import ROLLOUT, call_role, facts_of, generating_role, generation_role, model_role
from hfplan.plan import GenConfig, InferConfig, Recompute, RoleParallelism, TrainConfig
from hfplan.planner import space
from hfplan.profiles.hardware import HardwareProfile
from hfplan.profiles.models import ModelArch
from hfplan.simulator.costs import CostMemo, SetShape, batching_never_slower
from hfplan.simulator.mapping import (
    RoleMemory,
    call_seconds,
    gen_memory,
    infer_transient,
    role_memory,
    switch_seconds,
    train_resident,
    train_transient,
)
from hfplan.simulator.memory import NO_KV, KvSequence
from hfplan.simulator.schedule import switch_points
from hfplan.simulator.sharding import backward_hides_at_most_once_per_micro_batch
from hfplan.simulator.trace import Dag, Node
from hfplan.spec import Workload


@dataclass(frozen=True)
class RoleOption:
    role: str
    par: RoleParallelism
    seconds: tuple[float, ...]  # each of the role's own calls (generation excluded), in program order
    switch: float  # layout switch before generating (generating role only)
    memory: RoleMemory
    gen_key: tuple[int, int, int, str] | None  # generation layout and batching, for the generating role
    alone_gen: tuple[float, ...] = ()  # generate calls with all memory not held by this role for the KV cache

    @property
    def own_seconds(self) -> float:
        return sum(self.seconds) + self.switch

    @property
    def parts(self) -> dict[str, RoleOption]:
        """The option of each role this option chooses for."""
        return {self.role: self}


@dataclass(frozen=True)
class JointOption(RoleOption):
    """One choice for every role of a colocated set that does not generate, as one option: its seconds
    are the roles' own calls one role after another, its memory their sum (resident) and largest call."""

    members: tuple[RoleOption, ...] = ()

    @property
    def parts(self) -> dict[str, RoleOption]:
        return {o.role: o for o in self.members}


def pareto(vectors: np.ndarray, keys: Sequence[object] | None = None) -> list[int]:
    """Indices of rows not dominated by another row with the same key (<= everywhere, < somewhere).
    Exact duplicates keep their first occurrence."""
    n = len(vectors)
    if n <= 1:
        return list(range(n))
    groups: dict[object, list[int]] = {None: list(range(n))} if keys is None else {}
    if keys is not None:
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
    keep: list[int] = []
    for members in groups.values():
        if len(members) == 1:
            keep.extend(members)
            continue
        sub = vectors[members]
        rest = _not_below_minima(sub)
        sub = sub[rest]
        order = np.lexsort(sub.T[::-1])
        keep.extend(members[k] for k in rest[order[_first_undominated(sub[order])]].tolist())
    return sorted(keep)


def _not_below_minima(rows: np.ndarray) -> np.ndarray:
    """Positions of the rows that no minimum row (the first holding a column's least value) is <= everywhere
    while differing from or coming before it. The others are off the front, often nearly all rows, and dropping
    them before the sort changes no other row's fate: whatever they are below, the minimum row is below too."""
    firsts = np.unique(rows.argmin(axis=0))
    below = np.ones((len(firsts), len(rows)), dtype=bool)
    equal = np.ones((len(firsts), len(rows)), dtype=bool)
    for c in range(rows.shape[1]):
        below &= rows[firsts, c, None] <= rows[None, :, c]
        equal &= rows[firsts, c, None] == rows[None, :, c]
    return np.flatnonzero(~(below & (~equal | (firsts[:, None] < np.arange(len(rows))[None, :]))).any(axis=0))


def _first_undominated(rows: np.ndarray, block: int = 256) -> np.ndarray:
    """Positions of the lexicographically sorted rows that no earlier row is <= everywhere. A row <= another
    everywhere, and not equal, sorts before it, so these are the undominated rows (a duplicate's first copy).
    A block of rows at a time, column by column: within the block (a row below a dropped one is below what
    dropped it, so any earlier row of the block may drop it), then every later row against the block's kept."""
    columns = range(rows.shape[1])
    at = np.arange(len(rows))
    out = []
    while len(rows):
        here = rows[:block]
        below = np.ones((len(here), len(here)), dtype=bool)  # below[i, j]: row i <= row j everywhere
        for c in columns:
            below &= here[:, None, c] <= here[None, :, c]
        alive = ~np.triu(below, 1).any(axis=0)
        kept, rows = here[alive], rows[block:]
        out.append(at[:block][alive])
        at = at[block:]
        if len(rows):
            dropped = np.ones((len(rows), len(kept)), dtype=bool)  # dropped[j, i]: kept row i <= row j
            for c in columns:
                dropped &= kept[None, :, c] <= rows[:, c, None]
            alive = ~dropped.any(axis=1)
            rows, at = rows[alive], at[alive]
    return np.concatenate(out)


Facets = tuple[tuple[str, object], ...]  # (name, value) pairs that must agree across every role naming them


@dataclass(frozen=True)
class Rules:
    """Limits on the strategy space. hfplan's own search has none but its executor's; the fixed mappings
    of other RLHF systems and the target frameworks are expressed as rules (planner/baselines.py,
    planner/targets.py)."""

    name: str = "hfplan"
    placements: tuple[tuple[tuple[str, ...], ...], ...] | None = None  # None: every set partition
    rollout: bool = False  # a separate generation engine with weight sync, instead of the hybrid engine
    power_of_two_sets: bool = False  # every colocated set gets a power-of-two GPU count
    idle_gpus: bool = False  # plans may leave GPUs unused (hfplan's own search: more GPUs never give a worse plan)
    train: Callable[[str, TrainConfig], bool] | None = None
    gen: Callable[[TrainConfig | None, GenConfig], bool] | None = None
    infer: Callable[[str, InferConfig], bool] | None = None  # inference layouts (trained roles: micro-batch)
    # Settings one flag sets for several roles (e.g. one ZeRO stage for all): a role's facets, from any of
    # its layouts; a choice of strategies is allowed only when every facet name has one value.
    agree: Callable[[str, RoleParallelism], Facets] | None = None
    executable: bool = True  # only layouts hfplan's executor runs (False: the plan runs on another framework)

    def train_ok(self, role: str, train: TrainConfig) -> bool:
        return self.train is None or self.train(role, train)

    def gen_ok(self, train: TrainConfig | None, gen: GenConfig) -> bool:
        return self.gen is None or self.gen(train, gen)

    def infer_ok(self, role: str, infer: InferConfig) -> bool:
        return self.infer is None or self.infer(role, infer)

    def facets(self, role: str, par: RoleParallelism) -> Facets:
        return () if self.agree is None else self.agree(role, par)


def agrees(facets: Facets, chosen: dict[str, object]) -> bool:
    """Whether `facets` agree among themselves and with the facet values already chosen."""
    values = dict(chosen)
    return all(values.setdefault(name, value) == value for name, value in facets)


@dataclass(frozen=True)
class TrainPart:
    config: TrainConfig
    seconds: tuple[float, ...]  # the role's update calls
    transient: float  # bytes per GPU of one optimizer step


@dataclass(frozen=True)
class InferPart:
    config: InferConfig
    seconds: tuple[float, ...]  # the role's forward calls
    transient: float  # bytes per GPU of one forward micro-batch


@dataclass(frozen=True)
class GenPart:
    config: GenConfig | None  # None: the role does not generate
    extra: float  # bytes per GPU generation needs beyond the training states
    kv: KvSequence  # KV-cache bytes per GPU of one sequence
    switch: float  # seconds of the switch into this layout
    alone: tuple[float, ...]  # generate calls with all memory the role does not hold for the KV cache


NO_GENERATION = GenPart(None, 0.0, NO_KV, 0.0, ())


@dataclass(frozen=True)
class Family:
    """A trained role's strategies sharing one (tp, pp, dp, shard) layout: the same resident memory,
    and the same inference and generation choices. Each part is pruned on its own calls and memory."""

    resident: float
    trains: list[TrainPart]
    infers: list[InferPart]
    gens: list[GenPart]


class RoleChoices:
    """The non-dominated options of one role on A GPUs, best-looking first, as arrays for bounding."""

    def __init__(self, options: list[RoleOption]) -> None:
        self.options = sorted(options, key=lambda o: o.own_seconds + sum(o.alone_gen))
        n = len(self.options)
        width = (len(self.options[0].seconds), len(self.options[0].alone_gen)) if self.options else (0, 0)
        self.seconds = np.array([o.seconds for o in self.options], dtype=float).reshape(n, width[0])
        self.alone_gen = np.array([o.alone_gen for o in self.options], dtype=float).reshape(n, width[1])
        self.switch = np.array([o.switch for o in self.options], dtype=float)
        self.resident = np.array([o.memory.resident for o in self.options], dtype=float)
        self.transient = np.array([o.memory.transient for o in self.options], dtype=float)
        # bytes generation needs beside the held states: its extra weights and one sequence's KV cache
        self.gen_need = np.array([o.memory.gen_extra + o.memory.kv_per_sequence for o in self.options], dtype=float)


@dataclass(frozen=True)
class Floor:
    """The fastest each call of a role can be on A GPUs (over every strategy that fits alone), and its
    least switch and resident memory: lower bounds, whatever it is colocated with."""

    seconds: tuple[float, ...]  # own calls, as in own_nodes
    gen: tuple[float, ...]  # generate calls (generating role)
    switch: float
    resident: float


class SearchContext:
    """Everything fixed during one search, with caches of role strategies by GPU count."""

    def __init__(self, workload: Workload, hw: HardwareProfile, gpus_per_node: int, dag: Dag,
                 rules: Rules | None = None, shared: SearchContext | None = None) -> None:
        """shared: a context of the same search with the other generation engine (same rules otherwise),
        whose cost tables and role caches this one uses too: only the generating role's strategies and
        the sets holding it depend on the engine, and their keys say which."""
        self.workload = workload
        self.hw = hw
        self.gpus_per_node = gpus_per_node
        self.dag = dag
        self.rules = rules or Rules()
        self.generator = generation_role(workload, (ROLLOUT,) if self.rules.rollout else ())
        self.trained_generator = generating_role(workload)
        self.usable = hw.memory.usable_bytes
        self.value_bytes = hw.compute.value_bytes
        self.attention = hw.compute.attention
        self._own: dict[str, list[Node]] = {}
        if shared is None:
            self.memo = CostMemo()
            self.clear()
        else:
            self.memo = shared.memo
            self._parts, self._choices, self._floors = shared._parts, shared._choices, shared._floors
            self._fits, self._set_floors, self._fronts = shared._fits, shared._set_floors, shared._fronts
            self._train_space = shared._train_space

    def clear(self) -> None:
        """Drop every cached cost, strategy, floor and fit of this search."""
        self.memo.clear()
        self._parts: dict[tuple, list[Family]] = {}
        self._choices: dict[tuple, RoleChoices] = {}
        self._floors: dict[tuple, Floor | None] = {}
        self._fits: dict[tuple, bool] = {}
        self._set_floors: dict[tuple, object] = {}  # set floors, joint choices and bound rows, by kind
        self._fronts: dict[tuple, np.ndarray] = {}
        self._train_space: dict[tuple, list[TrainConfig]] = {}

    def _role_key(self, role: str, gpus: int) -> tuple:
        """Cache key of one role's strategies: the generating role's depend on the engine."""
        return (role, gpus, self.generator) if role == self.trained_generator else (role, gpus)

    def _set_key(self, roles: tuple[str, ...], gpus: int) -> tuple:
        return (roles, gpus, self.generator) if self.trained_generator in roles else (roles, gpus)

    def costed(self, role: str, gpus: int) -> tuple[list[Family] | None, RoleChoices | None, Floor | None]:
        """Cost one (role, GPU count) and return what it cached, for a worker process to hand back."""
        floor = self.floor(role, gpus)
        key = self._role_key(role, gpus)
        return self._parts.get(key), self._choices.get(key), floor

    def adopt(self, role: str, gpus: int, parts: list[Family] | None, choices: RoleChoices | None,
              floor: Floor | None) -> None:
        """Take what `costed` computed in another process."""
        key = self._role_key(role, gpus)
        if parts is not None:
            self._parts[key] = parts
        if choices is not None:
            self._choices[key] = choices
        self._floors[key] = floor

    @cached_property
    def gpu_roles(self) -> tuple[str, ...]:
        return tuple(self.workload.model_roles) + ((ROLLOUT,) if self.generator == ROLLOUT else ())

    @cached_property
    def placements(self) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """The rules' placements, or every set partition of the roles on GPUs (the rollout set included)."""
        return tuple(self.rules.placements or space.set_partitions(self.gpu_roles))

    def runs_on(self, node: Node) -> str | None:
        """The role whose GPUs run a call (None: the controller or a rule)."""
        return call_role(self.workload, self.generator, node.role, node.op)

    @cached_property
    def runners(self) -> tuple[str | None, ...]:
        """runs_on of every call, in node order."""
        return tuple(self.runs_on(n) for n in self.dag.nodes)

    def trains(self, role: str) -> bool:
        return facts_of(self.workload, role).trains

    def own_nodes(self, role: str) -> list[Node]:
        if role not in self._own:
            self._own[role] = [n for n in self.dag.nodes if self.runs_on(n) == role and n.op != "generate"]
        return self._own[role]

    @cached_property
    def generate_nodes(self) -> list[Node]:
        return [n for n in self.dag.nodes if n.op == "generate"]

    @cached_property
    def switch_ids(self) -> list[int]:
        """The calls before which the generating role switches into its generation layout (the schedule
        rule's switch points; only the role that generates has a generation layout)."""
        return list(switch_points(self.dag, self.runs_on, generating_role(self.workload)))

    def _seconds(self, node: Node, role: str, par: RoleParallelism, gpus: int, kv_budget: float = 0.0) -> float:
        return call_seconds(self.workload, self.hw, self.gpus_per_node, node, role, par, gpus, kv_budget, self.memo)

    def _fits_alone(self, resident: float | np.ndarray, transient: float | np.ndarray,
                    gen_need: float | np.ndarray) -> bool | np.ndarray:
        """Whether a role fits alone on its GPUs (arrays: each option): its resident states and the larger of its
        largest call and what generating needs beside them (extra weights, one sequence's KV cache)."""
        return resident + np.maximum(transient, gen_need) <= self.usable

    def _alone_gen(self, role: str, par: RoleParallelism, gpus: int, resident: float, extra: float) -> tuple:
        budget = self.usable - resident - extra
        return tuple(self._seconds(n, role, par, gpus, budget) for n in self.generate_nodes)

    def _fastest_batching(self, role: str, rooms: dict[GenConfig, tuple[float, KvSequence]], gpus: int
                          ) -> list[GenConfig]:
        """Per generation layout and KV-cache allocation, the batchings that can be the fastest: one never slower
        than another at any KV-cache room up to the most the GPU can have (rooms: each config's bytes left for the
        KV cache with the role alone on its GPUs, and the KV cache of one sequence), on every generate call,
        replaces it (ties keep the first), so the engine is a local choice and multiplies the options only where
        neither wins everywhere. Colocated roles only take room away, so this holds in every set."""
        by_layout: dict[tuple[int, int, int, str], list[GenConfig]] = {}
        for gen in rooms:
            by_layout.setdefault((gen.tp, gen.pp, gen.dp, gen.kv_cache), []).append(gen)
        out = []
        for group in by_layout.values():
            room, kv = rooms[group[0]]  # batching changes neither
            most = kv.most(room) if kv.slot > 0 else 1 << 30
            kept: list[GenConfig] = []
            for gen in group:
                if any(self._never_slower(k, gen, role, gpus, most) for k in kept):
                    continue
                kept = [k for k in kept if not self._never_slower(gen, k, role, gpus, most)] + [gen]
            out += kept
        return out

    def _never_slower(self, first: GenConfig, second: GenConfig, role: str, gpus: int, most: int) -> bool:
        """Whether `first` generates every call at most as slowly as `second` with room for at most `most`
        sequences per GPU (KV-cache bytes of one sequence are the same for both)."""
        w = self.workload
        arch, where = w.arch(model_role(w, role)), SetShape(gpus, self.gpus_per_node)
        return all(batching_never_slower(self.hw, arch, first.tp, first.pp, where, -(-n.sequences // first.dp),
                                         most, w.prompt_len, w.response_len, w.response_lengths, first.batching,
                                         second.batching, memo=self.memo)
                   for n in self.generate_nodes)

    # -- options --------------------------------------------------------------------------------------
    def choices(self, role: str, gpus: int) -> RoleChoices:
        key = self._role_key(role, gpus)
        if key not in self._choices:
            self._choices[key] = RoleChoices(self._options(role, gpus))
        return self._choices[key]

    def _options(self, role: str, gpus: int) -> list[RoleOption]:
        if self.trains(role):
            return self._trained_options(role, gpus)
        options = self._untrained_options(role, gpus)
        if not options:
            return options
        kept = _undominated(np.array([o.seconds for o in options], dtype=float).reshape(len(options), -1),
                            [(o.switch, o.memory.resident, o.memory.transient, o.memory.gen_extra) for o in options],
                            [(o.gen_key, self.rules.facets(o.role, o.par)) for o in options])
        return [options[i] for i in kept]

    def _untrained_options(self, role: str, gpus: int) -> list[RoleOption]:
        w, g = self.workload, self.gpus_per_node
        nodes = self.own_nodes(role)
        if role == ROLLOUT:
            rooms = {}
            for gen in space.gen_configs(w.arch(model_role(w, role)), gpus, g, prompts=w.batch_prompts,
                                         executable=self.rules.executable):
                if self.rules.gen_ok(None, gen):
                    mem = role_memory(w, role, RoleParallelism(gen=gen), self.value_bytes, self.attention)
                    rooms[gen] = (self.usable - mem.resident - mem.gen_extra, mem.kv)
            pars = [RoleParallelism(gen=gen) for gen in self._fastest_batching(role, rooms, gpus)]
        else:
            pars = [RoleParallelism(infer=infer) for infer in space.infer_configs(w.arch(role), gpus, g, w.sequences)
                    if self.rules.infer_ok(role, infer)]
        out = []
        for par in pars:
            mem = role_memory(w, role, par, self.value_bytes, self.attention)
            if not self._fits_alone(mem.resident, mem.transient, mem.gen_extra + mem.kv_per_sequence):
                continue
            seconds = tuple(self._seconds(n, role, par, gpus) for n in nodes)
            if role == self.generator:
                # A rollout engine's weight sync depends on whether it shares a node with the actor: the
                # option carries the cheaper case; the search re-costs it for each placement.
                switch = min(switch_seconds(w, self.hw, g, role, par, gpus, same, self.memo)
                             for same in (False, True)) if role == ROLLOUT else 0.0
                alone = self._alone_gen(role, par, gpus, mem.resident, mem.gen_extra)
                out.append(RoleOption(role, par, seconds, switch, mem, _gen_key(par.gen), alone))
            else:
                out.append(RoleOption(role, par, seconds, 0.0, mem, None))
        return out

    def _train_configs(self, arch: ModelArch, gpus: int) -> list[TrainConfig]:
        """space.train_configs of a step's sequences, once per architecture (roles holding one model share them)."""
        key = (arch, gpus)
        if key not in self._train_space:
            per_step = self.workload.sequences // self.workload.mini_batches
            self._train_space[key] = space.train_configs(arch, gpus, self.gpus_per_node, per_step,
                                                           self.rules.executable)
        return self._train_space[key]

    def parts(self, role: str, gpus: int) -> list[Family]:
        """The layout families of a trained role on `gpus` GPUs, each with its pruned parts."""
        key = self._role_key(role, gpus)
        if key not in self._parts:
            self._parts[key] = self._families(role, gpus)
        return self._parts[key]

    def _layouts(self, role: str, gpus: int) -> list[tuple[float, list[TrainPart], list[InferPart]]]:
        """(resident bytes, pruned training parts, pruned inference parts) of each (tp, pp, dp, shard) layout
        of a trained role that fits: the same whichever engine generates, so cached once for both."""
        key = ("layouts", role, gpus)
        if key in self._parts:
            return self._parts[key]
        w, g = self.workload, self.gpus_per_node
        arch = w.arch(role)
        nodes = self.own_nodes(role)
        updates = [n for n in nodes if n.kind == "update"]
        forwards = [n for n in nodes if n.kind == "forward"]
        grouped: dict[tuple, list[TrainPart]] = {}
        residents: dict[tuple, float] = {}
        variants: dict[tuple, list[TrainConfig]] = {}  # configs differing only in recompute and virtual stages
        for train in self._train_configs(arch, gpus):
            if self.rules.train_ok(role, train):
                variants.setdefault((train.tp, train.pp, train.dp, train.shard, train.shard_group,
                                     train.micro_batch), []).append(train)
        for configs in variants.values():
            for train, resident, part in self._variant_parts(role, configs, updates, gpus):
                key_ = (train.tp, train.pp, train.dp, train.shard, train.shard_group)  # what resident depends on
                grouped.setdefault(key_, []).append(part)
                residents[key_] = resident
        out = []
        for key_, members in grouped.items():
            kept = _pareto_parts(members, [self.rules.facets(role, RoleParallelism(train=m.config))
                                           for m in members])
            layout, resident = kept[0].config, residents[key_]
            infers = []
            for infer in space.infer_configs(arch, gpus, g, w.sequences, layout):
                if not self.rules.infer_ok(role, infer):
                    continue
                par = RoleParallelism(train=layout, infer=infer)
                transient = infer_transient(w, role, infer, layout, self.value_bytes, self.attention)
                if resident + transient <= self.usable:
                    infers.append(InferPart(infer, tuple(self._seconds(n, role, par, gpus) for n in forwards),
                                            transient))
            if infers:
                facets = [self.rules.facets(role, RoleParallelism(train=layout, infer=i.config)) for i in infers]
                out.append((resident, kept, _pareto_parts(infers, facets)))
        self._parts[key] = out
        return out

    def _variant_parts(self, role: str, configs: list[TrainConfig], updates: list[Node], gpus: int
                       ) -> list[tuple[TrainConfig, float, TrainPart]]:
        """(config, resident, part) of one layout and micro-batch's recomputation modes and virtual-stage counts
        that fit and are not dominated by another of them with the same facets (Rules.agree). Two facts of the
        cost model spare costing the dominated ones:
        - recomputation none, selective, full repeats 0, attention's, then every layer's forward work, so at one
          virtual-stage count each is no faster than the one before on every call (where more backward work
          never shortens a step: sharding.backward_hides_at_most_once_per_micro_batch): one needing no less
          memory than a faster one kept is dominated;
        - more chunks (v > 1) take more activation memory than plain 1F1B (in_flight_micro_batches), and a step
          costs (n + (pp - 1) / v)(B + v c) + const (costs.train_step_parts: a bubble of (pp - 1) / v slots, c of
          point-to-point and pass overhead per chunk), convex in v: once some v is no faster on a call than
          v = 1, no larger v is either, so when that holds for every call the larger counts are dominated."""
        w = self.workload
        resident = train_resident(w, role, configs[0], self.value_bytes)  # one layout: the same for every config
        out: list[tuple[TrainConfig, float, TrainPart]] = []
        plain: dict[str, tuple[TrainPart, Facets]] = {}  # v = 1, by recompute mode
        slower: dict[str, list[bool]] = {}  # by mode: the calls on which some v > 1 was no faster than v = 1
        for v in sorted({c.virtual_stages for c in configs}):
            kept: list[tuple[TrainPart, Facets]] = []  # at this v, faster recomputation first
            at_v = sorted((c for c in configs if c.virtual_stages == v), key=lambda c: _RECOMPUTE_ORDER[c.recompute])
            for train in at_v:
                mode = train.recompute
                if mode in slower and all(slower[mode]):
                    continue
                transient = train_transient(w, role, train, self.value_bytes, self.attention)
                if resident + transient > self.usable:
                    continue
                par = RoleParallelism(train=train)
                facets = self.rules.facets(role, par)
                if backward_hides_at_most_once_per_micro_batch(train) and any(
                        p.transient <= transient and f == facets for p, f in kept):
                    continue
                part = TrainPart(train, tuple(self._seconds(n, role, par, gpus) for n in updates), transient)
                kept.append((part, facets))
                if v == 1:
                    plain[mode] = (part, facets)
                elif mode in plain and plain[mode][1] == facets:
                    base = plain[mode][0].seconds
                    slower[mode] = [was or secs >= b for was, secs, b in
                                    zip(slower.get(mode, [False] * len(base)), part.seconds, base, strict=True)]
                    if all(slower[mode]):
                        continue  # dominated by v = 1, as every larger count is
                out.append((train, resident, part))
        return out

    def _families(self, role: str, gpus: int) -> list[Family]:
        w, g = self.workload, self.gpus_per_node
        arch = w.arch(role)
        families = []
        for resident, kept, infers in self._layouts(role, gpus):
            layout = kept[0].config
            gens = [NO_GENERATION]
            if role == self.generator:
                gens = []
                memories = {}
                for gen in space.gen_configs(arch, gpus, g, layout, prompts=w.batch_prompts,
                                             executable=self.rules.executable):
                    if self.rules.gen_ok(layout, gen):
                        extra, kv = gen_memory(w, gen, layout, self.value_bytes, self.attention)
                        if resident + extra + kv.longest <= self.usable:
                            memories[gen] = (extra, kv)
                rooms = {gen: (self.usable - resident - extra, kv) for gen, (extra, kv) in memories.items()}
                for gen in self._fastest_batching(role, rooms, gpus):
                    extra, kv = memories[gen]
                    par = RoleParallelism(train=layout, gen=gen)
                    switch = switch_seconds(w, self.hw, g, role, par, gpus, memo=self.memo)
                    gens.append(GenPart(gen, extra, kv, switch, self._alone_gen(role, par, gpus, resident, extra)))
                if not gens:
                    continue
            families.append(Family(resident, kept, infers, gens))
        return families

    def _trained_options(self, role: str, gpus: int) -> list[RoleOption]:
        """Each family's (train, infer, gen) parts that fit alone, combined, undominated: pruned on arrays
        before any option is built, since most combinations are dominated."""
        nodes = self.own_nodes(role)
        update_at = [k for k, n in enumerate(nodes) if n.kind == "update"]
        forward_at = [k for k, n in enumerate(nodes) if n.kind == "forward"]
        combos: list[tuple[Family, TrainPart, InferPart, GenPart]] = []
        blocks: list[np.ndarray] = []
        memories: list[np.ndarray] = []
        for family in self.parts(role, gpus):
            trains, infers, gens = family.trains, family.infers, family.gens
            transient = np.maximum.outer([t.transient for t in trains], [i.transient for i in infers])
            gen_need = np.array([g.extra + g.kv.longest for g in gens])
            fits = self._fits_alone(family.resident, transient[:, :, None], gen_need)
            t, i, g = np.nonzero(fits)  # in itertools.product order
            if not len(t):
                continue
            combos.extend((family, trains[a], infers[b], gens[c]) for a, b, c in zip(t, i, g, strict=True))
            seconds = np.zeros((len(t), len(nodes)))
            seconds[:, update_at] = np.array([p.seconds for p in trains], dtype=float).reshape(len(trains), -1)[t]
            seconds[:, forward_at] = np.array([p.seconds for p in infers], dtype=float).reshape(len(infers), -1)[i]
            blocks.append(seconds)
            memories.append(np.column_stack([[gens[c].switch for c in g], np.full(len(t), family.resident),
                                             transient[t, i], [gens[c].extra for c in g]]))
        if not combos:
            return []

        def par(k: int) -> RoleParallelism:
            _, train, infer, gen = combos[k]
            return RoleParallelism(train=train.config, infer=infer.config, gen=gen.config)

        # Facets (Rules.agree) need each combination's strategy; without them none is built until it is kept.
        facets = [self.rules.facets(role, par(k)) for k in range(len(combos))] if self.rules.agree is not None else None
        seconds = np.concatenate(blocks)
        keys = [(_gen_key(gen.config), facets[k] if facets is not None else ()) for k, (*_, gen) in enumerate(combos)]
        kept = _undominated(seconds, np.concatenate(memories), keys)
        out = []
        for k, secs in zip(kept, seconds[kept].tolist(), strict=True):
            family, train, infer, gen = combos[k]
            replicas = gen.config.dp if gen.config is not None else 1
            mem = RoleMemory(family.resident, max(train.transient, infer.transient), gen.extra, gen.kv, replicas)
            out.append(RoleOption(role, par(k), tuple(secs), gen.switch, mem, _gen_key(gen.config), gen.alone))
        return out

    # -- memory of a colocated set ------------------------------------------------------------------
    def set_fits(self, roles: tuple[str, ...], gpus: int) -> bool:
        """Whether some choice of strategies for these colocated roles fits one GPU's memory (their
        resident states, the largest call, and for the generating role one sequence's KV cache)."""
        key = self._set_key(roles, gpus)
        if key not in self._fits:
            choices = [self.choices(r, gpus) for r in roles]
            self._fits[key] = all(c.options for c in choices) and self._fits_from(roles, choices, 0, 0.0, 0.0, None)
        return self._fits[key]

    def _fits_from(self, roles: tuple[str, ...], choices: list[RoleChoices], depth: int, held: float,
                   transient: float, gen: RoleOption | None) -> bool:
        if depth == len(roles):
            return gen is None or self.usable - held - gen.memory.gen_extra >= gen.memory.kv_per_sequence
        rest = choices[depth + 1:]
        rest_resident = sum(float(c.resident.min()) for c in rest)
        rest_transient = max((float(c.transient.min()) for c in rest), default=0.0)
        here = choices[depth]
        total = held + here.resident + rest_resident
        fits = total + np.maximum(np.maximum(transient, here.transient), rest_transient) <= self.usable
        is_gen = roles[depth] == self.generator
        for k in np.flatnonzero(fits):
            option = here.options[k]
            chosen_gen = option if is_gen else gen
            if chosen_gen is not None and (self.usable - total[k] - chosen_gen.memory.gen_extra
                                           < chosen_gen.memory.kv_per_sequence):
                continue
            if self._fits_from(roles, choices, depth + 1, held + option.memory.resident,
                               max(transient, option.memory.transient), chosen_gen):
                return True
        return False

    def memory_front(self, roles: tuple[str, ...], gpus: int) -> np.ndarray:
        """The least memory these colocated roles can take together: rows (resident bytes summed, largest
        transient) of their joint choices, none needing more of both than another, none over a GPU.
        No roles: one row of zeros. A partial choice whose held bytes leave room for no row cannot be
        completed, so the search drops it (an exact cut: it prunes only choices that cannot fit)."""
        key = self._set_key(roles, gpus)
        if key not in self._fronts:
            front = np.zeros((1, 2))
            for role in roles:
                c = self.choices(role, gpus)
                resident = (c.resident[:, None] + front[None, :, 0]).ravel()
                transient = np.maximum(c.transient[:, None], front[None, :, 1]).ravel()
                keep = resident + transient <= self.usable
                front = _front_2d(resident[keep], transient[keep])
            self._fronts[key] = front
        return self._fronts[key]

    def joint_choices(self, roles: tuple[str, ...], gpus: int, limit: int = 200_000) -> RoleChoices | None:
        """The choices of colocated roles that do not generate, taken together: every combination that fits
        one GPU, none slower on every call than another (their memory no longer matters once they fit,
        since nothing else shares their GPUs). None when the combinations are more than `limit`."""
        key = ("joint", *self._set_key(roles, gpus))
        if key not in self._set_floors:
            choices = [self.choices(r, gpus) for r in roles]
            sizes = [len(c.options) for c in choices]
            result = None
            if self.generator not in roles and math.prod(sizes) <= limit:
                grid = np.indices(sizes).reshape(len(roles), -1)
                held = sum(c.resident[g] for c, g in zip(choices, grid, strict=True))
                transient = np.max([c.transient[g] for c, g in zip(choices, grid, strict=True)], axis=0)
                fits = np.flatnonzero(held + transient <= self.usable)
                seconds = np.concatenate([c.seconds[g[fits]] for c, g in zip(choices, grid, strict=True)], axis=1)
                options = []
                for i in pareto(seconds):
                    k = fits[i]
                    members = tuple(c.options[g[k]] for c, g in zip(choices, grid, strict=True))
                    options.append(JointOption("+".join(roles), members[0].par, tuple(seconds[i]), 0.0,
                                               RoleMemory(float(held[k]), float(transient[k])), None,
                                               members=members))
                result = RoleChoices(options)
            self._set_floors[key] = result
        return self._set_floors[key]

    def set_floor(self, roles: tuple[str, ...], gpus: int, limit: int = 200_000) -> dict[int, float] | None:
        """For colocated roles that do not generate: the fastest each call can be over the choices that fit
        together (tighter than each role alone, since colocation takes memory away). None when the
        choices are too many to enumerate (`limit`) or nothing fits."""
        key = self._set_key(roles, gpus)
        if key in self._set_floors:
            return self._set_floors[key]
        choices = [self.choices(r, gpus) for r in roles]
        sizes = [len(c.options) for c in choices]
        result = None
        if self.generator not in roles and all(sizes) and math.prod(sizes) <= limit:
            grid = np.indices(sizes).reshape(len(roles), -1)
            held = sum(c.resident[g] for c, g in zip(choices, grid, strict=True))
            transient = np.max([c.transient[g] for c, g in zip(choices, grid, strict=True)], axis=0)
            fits = held + transient <= self.usable
            if fits.any():
                result = {}
                for role, c, g in zip(roles, choices, grid, strict=True):
                    chosen = g[fits]
                    for k, node in enumerate(self.own_nodes(role)):
                        result[node.id] = float(c.seconds[chosen, k].min())
        self._set_floors[key] = result
        return result

    # -- floors ---------------------------------------------------------------------------------------
    def set_bound(self, roles: tuple[str, ...], gpus: int) -> tuple[np.ndarray, float, str]:
        """A set's part of an allocation bound: the floor of every call it runs (0 for the others), the
        generating role's least switch if it holds it, and why it cannot fit ('' when each role can alone)."""
        key = ("bound", *self._set_key(roles, gpus))
        if key not in self._set_floors:
            row, switch, why = np.zeros(len(self.dag.nodes)), 0.0, ""
            for role in roles:
                floor = self.floor(role, gpus)
                if floor is None:
                    why = f"{role} alone does not fit on {gpus} GPUs with any parallel layout"
                    break
                for node, secs in zip(self.own_nodes(role), floor.seconds, strict=True):
                    row[node.id] = secs
                if role == self.generator:
                    for node, secs in zip(self.generate_nodes, floor.gen, strict=True):
                        row[node.id] = secs
                    switch = floor.switch
            self._set_floors[key] = (row, switch, why)
        return self._set_floors[key]

    def has_floor(self, role: str, gpus: int) -> bool:
        """Whether floor(role, gpus) is cached already."""
        return self._role_key(role, gpus) in self._floors

    def floor(self, role: str, gpus: int) -> Floor | None:
        """Lower bounds of the role's calls on `gpus` GPUs; None when no strategy fits. For trained roles
        it comes from the parts (the minimum of each part), without building every combination."""
        key = self._role_key(role, gpus)
        if key not in self._floors:
            self._floors[key] = self._floor(role, gpus)
        return self._floors[key]

    def _floor(self, role: str, gpus: int) -> Floor | None:
        nodes = self.own_nodes(role)
        if not self.trains(role):
            opts = self.choices(role, gpus)
            if not opts.options:
                return None
            return Floor(tuple(opts.seconds.min(axis=0)) if nodes else (),
                         tuple(opts.alone_gen.min(axis=0)) if opts.alone_gen.size else (),
                         float(opts.switch.min()), float(opts.resident.min()))
        families = self.parts(role, gpus)
        if not families:
            return None
        update_at = [k for k, n in enumerate(nodes) if n.kind == "update"]
        forward_at = [k for k, n in enumerate(nodes) if n.kind == "forward"]
        seconds = [math.inf] * len(nodes)
        gen = [math.inf] * len(self.generate_nodes) if role == self.generator else []
        for family in families:
            for parts, at in ((family.trains, update_at), (family.infers, forward_at)):
                for part in parts:
                    for k, value in zip(at, part.seconds, strict=True):
                        seconds[k] = min(seconds[k], value)
            for part in family.gens:
                gen = [min(a, b) for a, b in zip(gen, part.alone, strict=True)]
        switch = min(part.switch for family in families for part in family.gens)
        return Floor(tuple(seconds), tuple(gen), switch, min(f.resident for f in families))


def _pareto_parts(parts: list, facets: list[Facets]):
    """The train or infer parts not dominated on (seconds of each call, transient bytes) by one with the
    same facets (a dominated part may be the only one that agrees with another role's choice)."""
    return [parts[i] for i in pareto(np.array([[*p.seconds, p.transient] for p in parts]), facets)]


def _front_2d(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The rows of (first, second) no other row beats on both (ties: one kept), sorted by `first`."""
    order = np.lexsort((second, first))
    first, second = first[order], second[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], second)))[:-1]
    keep = second < best_before
    return np.stack([first[keep], second[keep]], axis=1)


_RECOMPUTE_ORDER = {mode: k for k, mode in enumerate(Recompute)}  # none, selective, full: ever more repeated work


def _gen_key(gen: GenConfig | None) -> tuple[int, int, int, str, str] | None:
    return (gen.tp, gen.pp, gen.dp, gen.batching, gen.kv_cache) if gen is not None else None


def _undominated(seconds: np.ndarray, memory: np.ndarray | Sequence[tuple[float, ...]], keys: Sequence[object]
                 ) -> list[int]:
    """Indices of the options that no option with the same key dominates (pareto) on the seconds of each own
    call (rows of `seconds`), the switch seconds and the resident, transient and generation-extra bytes (the
    columns of `memory`): a dominated option can never be needed (module docstring)."""
    return pareto(np.concatenate([seconds, np.asarray(memory, dtype=float).reshape(len(seconds), 4)], axis=1), keys)
