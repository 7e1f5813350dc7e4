"""The strategy space's rules, and the options a search chooses among: one role's strategy with its seconds and
memory (RoleOption), the parts a trained role's options are combined from, and a role's options as arrays."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hfplan.plan import GenConfig, InferConfig, RoleParallelism, TrainConfig
from hfplan.simulator.mapping import RoleMemory
from hfplan.simulator.memory import NO_KV, KvSequence

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
    # The rollout engines an executable plan may generate with (hfplan search --rollout-engines): torch alone by
    # default, since a plan names vLLM only for a machine that has it installed.
    engines: tuple[str, ...] = ("torch",)

    def train_ok(self, role: str, train: TrainConfig) -> bool:
        return self.train is None or self.train(role, train)

    def gen_ok(self, train: TrainConfig | None, gen: GenConfig) -> bool:
        if self.executable and gen.engine not in self.engines:
            return False
        return self.gen is None or self.gen(train, gen)

    def infer_ok(self, role: str, infer: InferConfig) -> bool:
        return self.infer is None or self.infer(role, infer)

    def facets(self, role: str, par: RoleParallelism) -> Facets:
        return () if self.agree is None else self.agree(role, par)


def agrees(facets: Facets, chosen: dict[str, object]) -> bool:
    """Whether `facets` agree among themselves and with the facet values already chosen."""
    values = dict(chosen)
    return all(values.setdefault(name, value) == value for name, value in facets)


class GenKey(NamedTuple):
    """A generation layout and engine: what the generating role's generate calls depend on besides its KV room."""

    tp: int
    pp: int
    dp: int
    batching: str
    kv_cache: str

    @classmethod
    def of(cls, gen: GenConfig | None) -> GenKey | None:
        return None if gen is None else cls(gen.tp, gen.pp, gen.dp, gen.batching, gen.kv_cache)


@dataclass(frozen=True)
class RoleOption:
    role: str
    par: RoleParallelism
    seconds: tuple[float, ...]  # each of the role's own calls (generation excluded), in program order
    switch: float  # layout switch before generating (generating role only)
    memory: RoleMemory
    gen_key: GenKey | None  # generation layout and engine, for the generating role
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
class TrainedLayout:
    """A trained role's pruned training and inference parts on one (tp, pp, dp, shard) layout that fits, and
    the resident bytes they share: the same whichever engine generates."""

    resident: float
    trains: list[TrainPart]
    infers: list[InferPart]


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
