"""The options of one role on A GPUs, and of a colocated set's roles taken together, kept only where not dominated.

The iteration time never decreases when a call gets longer (each set runs its calls in program order,
so the schedule is a longest path), and a set that fits keeps fitting when a role needs less memory.
So a strategy that is no faster on any call and needs no less memory than another can never be
needed: dropping it cannot lose the optimum. Everything else is kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hfplan.layout import ROLLOUT, model_role
from hfplan.plan import GenConfig, Recompute, RoleParallelism, TrainConfig
from hfplan.planner import space
from hfplan.planner.facts import RoleKey, SearchFacts, SetKey
from hfplan.planner.pareto import pareto
from hfplan.planner.strategies import (
    NO_GENERATION,
    Facets,
    Family,
    GenKey,
    GenPart,
    InferPart,
    JointOption,
    RoleChoices,
    RoleOption,
    TrainedLayout,
    TrainPart,
)
from hfplan.profiles.models import ModelArch
from hfplan.simulator.costs import SetShape, batching_never_slower
from hfplan.simulator.mapping import (
    RoleMemory,
    gen_memory,
    infer_transient,
    role_memory,
    switch_seconds,
    train_resident,
    train_transient,
)
from hfplan.simulator.memory import KvSequence
from hfplan.simulator.sharding import backward_hides_at_most_once_per_micro_batch
from hfplan.simulator.trace import Node


class TrainSpaceKey(NamedTuple):
    """Cache key of a step's training configs: roles holding one model share them."""

    arch: ModelArch
    gpus: int


class KvRoom(NamedTuple):
    """A generation config's KV-cache room with its role alone on its GPUs, and one sequence's KV cache."""

    bytes: float
    kv: KvSequence


@dataclass
class OptionCaches:
    """What RoleOptions computed, by key; a search's two contexts (hybrid engine, rollout set) share one."""

    layouts: dict[RoleKey, list[TrainedLayout]] = field(default_factory=dict)  # engine: always None
    families: dict[RoleKey, list[Family]] = field(default_factory=dict)
    choices: dict[RoleKey, RoleChoices] = field(default_factory=dict)
    joint: dict[SetKey, RoleChoices | None] = field(default_factory=dict)
    train_space: dict[TrainSpaceKey, list[TrainConfig]] = field(default_factory=dict)


class _Combination(NamedTuple):
    """One (train, infer, gen) choice of a trained role's layout family."""

    family: Family
    train: TrainPart
    infer: InferPart
    gen: GenPart

    @property
    def par(self) -> RoleParallelism:
        return RoleParallelism(train=self.train.config, infer=self.infer.config, gen=self.gen.config)


class RoleOptions:
    """The non-dominated options of each role on A GPUs (choices), of a colocated set's roles together (joint),
    and a trained role's layout families they are combined from (families)."""

    def __init__(self, facts: SearchFacts, caches: OptionCaches | None = None) -> None:
        self.facts = facts
        self.caches = OptionCaches() if caches is None else caches

    # -- a role's options -----------------------------------------------------------------------------
    def choices(self, role: str, gpus: int) -> RoleChoices:
        key = self.facts.role_key(role, gpus)
        if key not in self.caches.choices:
            self.caches.choices[key] = RoleChoices(self._options(role, gpus))
        return self.caches.choices[key]

    def fits_alone(self, resident: float | np.ndarray, transient: float | np.ndarray,
                   gen_need: float | np.ndarray) -> bool | np.ndarray:
        """Whether a role fits alone on its GPUs (arrays: each option): its resident states and the larger of its
        largest call and what generating needs beside them (extra weights, one sequence's KV cache)."""
        return resident + np.maximum(transient, gen_need) <= self.facts.usable

    def _options(self, role: str, gpus: int) -> list[RoleOption]:
        if self.facts.trains(role):
            return self._trained_options(role, gpus)
        options = self._untrained_options(role, gpus)
        if not options:
            return options
        rules = self.facts.rules
        kept = _undominated(np.array([o.seconds for o in options], dtype=float).reshape(len(options), -1),
                            [(o.switch, o.memory.resident, o.memory.transient, o.memory.gen_extra) for o in options],
                            [(o.gen_key, rules.facets(o.role, o.par)) for o in options])
        return [options[i] for i in kept]

    def _untrained_options(self, role: str, gpus: int) -> list[RoleOption]:
        f = self.facts
        w, g = f.workload, f.gpus_per_node
        nodes = f.own_nodes(role)
        if role == ROLLOUT:
            rooms = {}
            for gen in space.gen_configs(w.arch(model_role(w, role)), gpus, g, prompts=w.batch_prompts,
                                         executable=f.rules.executable):
                if f.rules.gen_ok(None, gen):
                    mem = role_memory(w, role, RoleParallelism(gen=gen), f.value_bytes, f.attention,
                                      vllm_tokens=f.hw.runtime.vllm_batched_tokens)
                    rooms[gen] = KvRoom(f.usable - mem.resident - mem.gen_extra, mem.kv)
            pars = [RoleParallelism(gen=gen) for gen in self._fastest_batching(role, rooms, gpus)]
        else:
            pars = [RoleParallelism(infer=infer) for infer in space.infer_configs(w.arch(role), gpus, g, w.sequences)
                    if f.rules.infer_ok(role, infer)]
        out = []
        for par in pars:
            mem = role_memory(w, role, par, f.value_bytes, f.attention, vllm_tokens=f.hw.runtime.vllm_batched_tokens)
            if not self.fits_alone(mem.resident, mem.transient, mem.gen_extra + mem.kv_per_sequence):
                continue
            seconds = tuple(f.seconds(n, role, par, gpus) for n in nodes)
            if role == f.generator:
                # A rollout engine's weight sync depends on whether it shares a node with the actor: the
                # option carries the cheaper case; the search re-costs it for each placement.
                switch = min(switch_seconds(w, f.hw, g, role, par, gpus, same, f.memo)
                             for same in (False, True)) if role == ROLLOUT else 0.0
                alone = self._alone_gen(role, par, gpus, mem.resident, mem.gen_extra)
                out.append(RoleOption(role, par, seconds, switch, mem, GenKey.of(par.gen), alone))
            else:
                out.append(RoleOption(role, par, seconds, 0.0, mem, None))
        return out

    def _trained_options(self, role: str, gpus: int) -> list[RoleOption]:
        """Each family's (train, infer, gen) parts that fit alone, combined, undominated: pruned on arrays
        before any option is built, since most combinations are dominated."""
        nodes = self.facts.own_nodes(role)
        update_at = [k for k, n in enumerate(nodes) if n.kind == "update"]
        forward_at = [k for k, n in enumerate(nodes) if n.kind == "forward"]
        combos: list[_Combination] = []
        blocks: list[np.ndarray] = []
        memories: list[np.ndarray] = []
        for family in self.families(role, gpus):
            trains, infers, gens = family.trains, family.infers, family.gens
            transient = np.maximum.outer([t.transient for t in trains], [i.transient for i in infers])
            gen_need = np.array([g.extra + g.kv.longest for g in gens])
            fits = self.fits_alone(family.resident, transient[:, :, None], gen_need)
            t, i, g = np.nonzero(fits)  # in itertools.product order
            if not len(t):
                continue
            combos.extend(_Combination(family, trains[a], infers[b], gens[c]) for a, b, c in zip(t, i, g, strict=True))
            seconds = np.zeros((len(t), len(nodes)))
            seconds[:, update_at] = np.array([p.seconds for p in trains], dtype=float).reshape(len(trains), -1)[t]
            seconds[:, forward_at] = np.array([p.seconds for p in infers], dtype=float).reshape(len(infers), -1)[i]
            blocks.append(seconds)
            memories.append(np.column_stack([[gens[c].switch for c in g], np.full(len(t), family.resident),
                                             transient[t, i], [gens[c].extra for c in g]]))
        if not combos:
            return []
        rules = self.facts.rules
        # Facets (Rules.agree) need each combination's strategy; without them none is built until it is kept.
        facets = [rules.facets(role, c.par) for c in combos] if rules.agree is not None else None
        seconds = np.concatenate(blocks)
        keys = [(GenKey.of(c.gen.config), facets[k] if facets is not None else ()) for k, c in enumerate(combos)]
        kept = _undominated(seconds, np.concatenate(memories), keys)
        out = []
        for k, secs in zip(kept, seconds[kept].tolist(), strict=True):
            c = combos[k]
            replicas = c.gen.config.dp if c.gen.config is not None else 1
            mem = RoleMemory(c.family.resident, max(c.train.transient, c.infer.transient), c.gen.extra, c.gen.kv,
                             replicas)
            out.append(RoleOption(role, c.par, tuple(secs), c.gen.switch, mem, GenKey.of(c.gen.config), c.gen.alone))
        return out

    # -- a colocated set's options --------------------------------------------------------------------
    def joint(self, roles: tuple[str, ...], gpus: int, limit: int = 200_000) -> RoleChoices | None:
        """The choices of colocated roles that do not generate, taken together: every combination that fits
        one GPU, none slower on every call than another (their memory no longer matters once they fit,
        since nothing else shares their GPUs). None when the combinations are more than `limit`."""
        f = self.facts
        key = f.set_key(roles, gpus)
        if key not in self.caches.joint:
            choices = [self.choices(r, gpus) for r in roles]
            sizes = [len(c.options) for c in choices]
            result = None
            if f.generator not in roles and math.prod(sizes) <= limit:
                grid = np.indices(sizes).reshape(len(roles), -1)
                held = sum(c.resident[g] for c, g in zip(choices, grid, strict=True))
                transient = np.max([c.transient[g] for c, g in zip(choices, grid, strict=True)], axis=0)
                fits = np.flatnonzero(held + transient <= f.usable)
                seconds = np.concatenate([c.seconds[g[fits]] for c, g in zip(choices, grid, strict=True)], axis=1)
                options = []
                for i in pareto(seconds):
                    k = fits[i]
                    members = tuple(c.options[g[k]] for c, g in zip(choices, grid, strict=True))
                    options.append(JointOption("+".join(roles), members[0].par, tuple(seconds[i]), 0.0,
                                               RoleMemory(float(held[k]), float(transient[k])), None,
                                               members=members))
                result = RoleChoices(options)
            self.caches.joint[key] = result
        return self.caches.joint[key]

    # -- a trained role's layout families -------------------------------------------------------------
    def families(self, role: str, gpus: int) -> list[Family]:
        """The layout families of a trained role on `gpus` GPUs, each with its pruned parts."""
        key = self.facts.role_key(role, gpus)
        if key not in self.caches.families:
            self.caches.families[key] = self._families(role, gpus)
        return self.caches.families[key]

    def _families(self, role: str, gpus: int) -> list[Family]:
        f = self.facts
        w, g = f.workload, f.gpus_per_node
        arch = w.arch(role)
        families = []
        for layout_parts in self._layouts(role, gpus):
            resident, layout = layout_parts.resident, layout_parts.trains[0].config
            gens = [NO_GENERATION]
            if role == f.generator:
                gens = []
                memories: dict[GenConfig, tuple[float, KvSequence]] = {}  # generation's extra bytes, its KV cache
                for gen in space.gen_configs(arch, gpus, g, layout, prompts=w.batch_prompts,
                                             executable=f.rules.executable):
                    if f.rules.gen_ok(layout, gen):
                        extra, kv = gen_memory(w, gen, layout, f.value_bytes, f.attention,
                                               vllm_tokens=f.hw.runtime.vllm_batched_tokens)
                        if resident + extra + kv.longest <= f.usable:
                            memories[gen] = (extra, kv)
                rooms = {gen: KvRoom(f.usable - resident - extra, kv) for gen, (extra, kv) in memories.items()}
                for gen in self._fastest_batching(role, rooms, gpus):
                    extra, kv = memories[gen]
                    par = RoleParallelism(train=layout, gen=gen)
                    switch = switch_seconds(w, f.hw, g, role, par, gpus, memo=f.memo)
                    gens.append(GenPart(gen, extra, kv, switch, self._alone_gen(role, par, gpus, resident, extra)))
                if not gens:
                    continue
            families.append(Family(resident, layout_parts.trains, layout_parts.infers, gens))
        return families

    def _layouts(self, role: str, gpus: int) -> list[TrainedLayout]:
        """The pruned training and inference parts of each (tp, pp, dp, shard) layout of a trained role that
        fits: the same whichever engine generates, so cached once for both."""
        key = RoleKey(role, gpus, None)
        if key in self.caches.layouts:
            return self.caches.layouts[key]
        f = self.facts
        w, g, rules = f.workload, f.gpus_per_node, f.rules
        arch = w.arch(role)
        nodes = f.own_nodes(role)
        updates = [n for n in nodes if n.kind == "update"]
        forwards = [n for n in nodes if n.kind == "forward"]
        grouped: dict[tuple, list[TrainPart]] = {}
        residents: dict[tuple, float] = {}
        variants: dict[tuple, list[TrainConfig]] = {}  # configs differing only in recompute and virtual stages
        for train in self._train_configs(arch, gpus):
            if rules.train_ok(role, train):
                variants.setdefault((train.tp, train.pp, train.dp, train.shard, train.shard_group,
                                     train.micro_batch), []).append(train)
        for configs in variants.values():
            first = configs[0]
            resident = train_resident(w, role, first, f.value_bytes)  # one layout: the same for every config
            parts = self._variant_parts(role, configs, resident, updates, gpus)
            if parts:
                layout = (first.tp, first.pp, first.dp, first.shard, first.shard_group)  # what resident depends on
                grouped.setdefault(layout, []).extend(parts)
                residents[layout] = resident
        out = []
        for layout, members in grouped.items():
            kept = _pareto_parts(members, [rules.facets(role, RoleParallelism(train=m.config)) for m in members])
            train, resident = kept[0].config, residents[layout]
            infers = []
            for infer in space.infer_configs(arch, gpus, g, w.sequences, train):
                if not rules.infer_ok(role, infer):
                    continue
                par = RoleParallelism(train=train, infer=infer)
                transient = infer_transient(w, role, infer, train, f.value_bytes, f.attention)
                if resident + transient <= f.usable:
                    infers.append(InferPart(infer, tuple(f.seconds(n, role, par, gpus) for n in forwards), transient))
            if infers:
                facets = [rules.facets(role, RoleParallelism(train=train, infer=i.config)) for i in infers]
                out.append(TrainedLayout(resident, kept, _pareto_parts(infers, facets)))
        self.caches.layouts[key] = out
        return out

    def _train_configs(self, arch: ModelArch, gpus: int) -> list[TrainConfig]:
        """space.train_configs of a step's sequences, once per architecture (roles holding one model share them)."""
        key = TrainSpaceKey(arch, gpus)
        if key not in self.caches.train_space:
            f = self.facts
            per_step = f.workload.sequences // f.workload.mini_batches
            self.caches.train_space[key] = space.train_configs(arch, gpus, f.gpus_per_node, per_step,
                                                               f.rules.executable)
        return self.caches.train_space[key]

    def _variant_parts(self, role: str, configs: list[TrainConfig], resident: float, updates: list[Node], gpus: int
                       ) -> list[TrainPart]:
        """The parts of one layout and micro-batch's recomputation modes and virtual-stage counts (`resident`
        bytes of states) that fit and are not dominated by another of them with the same facets (Rules.agree).
        Two facts of the cost model spare costing the dominated ones:
        - recomputation none, selective, full repeats 0, attention's, then every layer's forward work, so at one
          virtual-stage count each is no faster than the one before on every call (where more backward work
          never shortens a step: sharding.backward_hides_at_most_once_per_micro_batch): one needing no less
          memory than a faster one kept is dominated;
        - more chunks (v > 1) take more activation memory than plain 1F1B (in_flight_micro_batches), and a step
          costs (n + (pp - 1) / v)(B + v c) + const (costs.train_step_parts: a bubble of (pp - 1) / v slots, c of
          point-to-point and pass overhead per chunk), convex in v: once some v is no faster on a call than
          v = 1, no larger v is either, so when that holds for every call the larger counts are dominated."""
        f = self.facts
        w = f.workload
        out: list[TrainPart] = []
        plain: dict[str, tuple[TrainPart, Facets]] = {}  # v = 1, by recompute mode
        slower: dict[str, list[bool]] = {}  # by mode: the calls on which some v > 1 was no faster than v = 1
        for v in sorted({c.virtual_stages for c in configs}):
            kept: list[tuple[TrainPart, Facets]] = []  # at this v, faster recomputation first
            at_v = sorted((c for c in configs if c.virtual_stages == v), key=lambda c: _RECOMPUTE_ORDER[c.recompute])
            for train in at_v:
                mode = train.recompute
                if mode in slower and all(slower[mode]):
                    continue
                transient = train_transient(w, role, train, f.value_bytes, f.attention)
                if resident + transient > f.usable:
                    continue
                par = RoleParallelism(train=train)
                facets = f.rules.facets(role, par)
                if backward_hides_at_most_once_per_micro_batch(train) and any(
                        p.transient <= transient and same == facets for p, same in kept):
                    continue
                part = TrainPart(train, tuple(f.seconds(n, role, par, gpus) for n in updates), transient)
                kept.append((part, facets))
                if v == 1:
                    plain[mode] = (part, facets)
                elif mode in plain and plain[mode][1] == facets:
                    base = plain[mode][0].seconds
                    slower[mode] = [was or secs >= b for was, secs, b in
                                    zip(slower.get(mode, [False] * len(base)), part.seconds, base, strict=True)]
                    if all(slower[mode]):
                        continue  # dominated by v = 1, as every larger count is
                out.append(part)
        return out

    # -- generation ------------------------------------------------------------------------------------
    def _alone_gen(self, role: str, par: RoleParallelism, gpus: int, resident: float, extra: float) -> tuple:
        f = self.facts
        budget = f.usable - resident - extra
        return tuple(f.seconds(n, role, par, gpus, budget) for n in f.generate_nodes)

    def _fastest_batching(self, role: str, rooms: dict[GenConfig, KvRoom], gpus: int) -> list[GenConfig]:
        """Per generation layout and KV-cache allocation, the batchings that can be the fastest: one never slower
        than another at any KV-cache room up to the most the GPU can have (rooms: each config's room with the
        role alone on its GPUs), on every generate call, replaces it (ties keep the first), so the engine is a
        local choice and multiplies the options only where neither wins everywhere. Colocated roles only take
        room away, so this holds in every set."""
        by_layout: dict[tuple[int, int, int, str], list[GenConfig]] = {}
        for gen in rooms:
            by_layout.setdefault((gen.tp, gen.pp, gen.dp, gen.kv_cache), []).append(gen)
        out = []
        for group in by_layout.values():
            room = rooms[group[0]]  # batching changes neither
            most = room.kv.most(room.bytes) if room.kv.slot > 0 else 1 << 30
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
        f = self.facts
        w = f.workload
        arch, where = w.arch(model_role(w, role)), SetShape(gpus, f.gpus_per_node)
        return all(batching_never_slower(f.hw, arch, first.tp, first.pp, where, -(-n.sequences // first.dp),
                                         most, w.prompt_len, w.response_len, w.response_lengths, first.batching,
                                         second.batching, memo=f.memo)
                   for n in f.generate_nodes)


_RECOMPUTE_ORDER = {mode: k for k, mode in enumerate(Recompute)}  # none, selective, full: ever more repeated work


def _pareto_parts(parts: list, facets: list[Facets]):
    """The train or infer parts not dominated on (seconds of each call, transient bytes) by one with the
    same facets (a dominated part may be the only one that agrees with another role's choice)."""
    return [parts[i] for i in pareto(np.array([[*p.seconds, p.transient] for p in parts]), facets)]


def _undominated(seconds: np.ndarray, memory: np.ndarray | Sequence[tuple[float, ...]], keys: Sequence[object]
                 ) -> list[int]:
    """Indices of the options that no option with the same key dominates (pareto) on the seconds of each own
    call (rows of `seconds`), the switch seconds and the resident, transient and generation-extra bytes (the
    columns of `memory`): a dominated option can never be needed (module docstring)."""
    return pareto(np.concatenate([seconds, np.asarray(memory, dtype=float).reshape(len(seconds), 4)], axis=1), keys)
