"""Plan: the one contract between the planner and the executor. Versioned JSON.

A plan says where each role's model lives (placement: colocated sets with a GPU count each), how
each role is parallelised for training, inference and generation, and what the simulator expects
of it (estimate). `hfplan search` writes one; `hfplan simulate` and `hfplan execute` read one; a
user may write one by hand.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hfplan.errors import HfplanError, describe_validation_error
from hfplan.files import read_mapping
from hfplan.layout import (
    ROLLOUT,
    call_set,
    generating_role,
    generation_role,
    layouts_of,
    nesting_problem,
    set_index,
    staleness_problem,
)
from hfplan.spec import Cluster, Workload, make_cluster

# ROLLOUT (re-exported): the pseudo-role of a separate generation engine (weights synced from the actor
# each iteration, as OpenRLHF does). Without it the actor generates on its own GPUs (hybrid engine).

PLAN_VERSION = 2
# Version 1 plans (recompute a bool; no virtual stages, batching, max_batch or response-length distributions) are
# migrated on read: every field they have keeps its meaning, and the new ones take their defaults.
READABLE_VERSIONS = (1, 2)


class _Strict(BaseModel):
    """Unknown fields are errors, and types are strict: `"yes"` is not a bool, `"4"` not an int."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Layout(_Strict):
    tp: int = Field(default=1, ge=1, description="tensor-parallel size")
    pp: int = Field(default=1, ge=1, description="pipeline-parallel size")
    dp: int = Field(default=1, ge=1, description="data-parallel size")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def __hash__(self) -> int:
        # Layouts key the cost caches: their fields are plain ints and bools, so hashing the values
        # directly is much cheaper than pydantic's generic hash.
        return hash(tuple(self.__dict__.values()))

    @property
    def model_shards(self) -> int:
        return self.tp * self.pp


Batching = Literal["static", "continuous"]  # how a rollout engine batches (GenConfig.batching)
KvCache = Literal["reserved", "paged"]  # how a rollout engine allocates its KV cache (GenConfig.kv_cache)
RolloutEngineName = Literal["torch", "vllm"]  # which rollout engine generates (GenConfig.engine)
# The KV cache each engine keeps: hfplan's torch engine reserves a sequence's longest, vLLM pages.
ENGINE_KV_CACHE: dict[str, str] = {"torch": "reserved", "vllm": "paged"}


def engine_problem(batching: str, kv_cache: str, engine: str | None = None) -> str | None:
    """Why a rollout engine's batching and KV allocation do not go together (None when they do): a paged
    cache is costed as a scheduler that admits waiting sequences as finished ones free their blocks. Given the
    engine, its KV cache must be the one it keeps (ENGINE_KV_CACHE)."""
    if kv_cache == "paged" and batching != "continuous":
        return f"kv_cache=paged needs batching=continuous (got {batching}): a paged engine refills freed blocks"
    if engine is not None and ENGINE_KV_CACHE[engine] != kv_cache:
        return f"engine={engine} keeps a {ENGINE_KV_CACHE[engine]} KV cache (got kv_cache={kv_cache})"
    return None
ShardMode = Literal["replicated", "zero1", "zero2", "full", "hybrid"]

# The training states each mode splits over its shard group (the rest are replicated): ZeRO stages 1 to
# 3 (full = ZeRO-3 / FSDP FULL_SHARD), and hybrid sharding (FSDP HYBRID_SHARD, verl's fsdp_size): ZeRO-3
# within groups of `shard_group` data-parallel ranks, replicated across the groups.
SHARDED_STATES: dict[str, tuple[str, ...]] = {
    "replicated": (),
    "zero1": ("optimizer",),
    "zero2": ("grads", "optimizer"),
    "full": ("weights", "grads", "optimizer"),
    "hybrid": ("weights", "grads", "optimizer"),
}


class Recompute(StrEnum):
    """Activation recomputation in the backward pass. `selective`: only attention's score work (Korthikanti et
    al., "Reducing Activation Recomputation in Large Transformer Models", 2022), `full`: every layer from its
    input. False only for `none`, so `if cfg.recompute:` reads as before."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    def __bool__(self) -> bool:
        return self is not Recompute.NONE

    @classmethod
    def of(cls, value: object) -> Recompute:
        """The mode of a value as version 1 (a bool) or version 2 (a mode name) writes it."""
        if isinstance(value, bool):
            return cls.FULL if value else cls.NONE
        return cls(value)


class TrainConfig(Layout):
    micro_batch: int = Field(default=1, ge=1, description="sequences per micro-batch per data-parallel rank")
    shard: ShardMode = Field(default="full", description="which training states are split over the "
                                                         "data-parallel ranks: replicated (DDP), zero1 (optimizer "
                                                         "states), zero2 (and gradients), full (and weights: ZeRO-3 "
                                                         "/ FSDP), hybrid (full within groups of shard_group ranks)")
    shard_group: int | None = Field(default=None, description="hybrid only: data-parallel ranks per shard group")
    recompute: Recompute = Field(default=Recompute.NONE, description="recompute activations in the backward pass: "
                                                                     "none, selective (attention scores) or full "
                                                                     "(true and false, as version 1 wrote them, "
                                                                     "read as full and none)")
    virtual_stages: int = Field(default=1, ge=1, description="model chunks per pipeline stage (interleaved 1F1B); "
                                                             "1 is plain 1F1B")

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_mode(cls, value: object) -> object:
        if isinstance(value, bool) or (isinstance(value, str) and not isinstance(value, Recompute)):
            try:
                return Recompute.of(value)
            except ValueError:
                raise ValueError(f"must be one of {', '.join(m.value for m in Recompute)}, got {value!r}") from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _migrate_boolean_shard(cls, data: object) -> object:
        """Plans written before the modes said `shard: true` (ZeRO-3) or `false` (replicated)."""
        if isinstance(data, dict) and isinstance(data.get("shard"), bool):
            return {**data, "shard": "full" if data["shard"] else "replicated"}
        return data

    @model_validator(mode="after")
    def _check_group(self) -> TrainConfig:
        if self.shard != "hybrid":
            if self.shard_group is not None:
                raise ValueError(f"shard_group is for shard 'hybrid' only (shard is {self.shard!r})")
            return self
        g = self.shard_group
        if g is None:
            raise ValueError("shard 'hybrid' needs shard_group (data-parallel ranks per shard group)")
        if not 1 < g < self.dp or self.dp % g:
            raise ValueError(f"shard_group {g} must divide dp={self.dp} and lie strictly between 1 and dp "
                             "(1 is 'replicated', dp is 'full')")
        return self

    @property
    def shard_size(self) -> int:
        """Data-parallel ranks each sharded state is split over."""
        if self.shard == "replicated":
            return 1
        return self.shard_group if self.shard == "hybrid" else self.dp

    def shards(self, state: str) -> int:
        """Pieces `state` ("weights", "grads" or "optimizer") is split into across data-parallel ranks."""
        return self.shard_size if state in SHARDED_STATES[self.shard] else 1


class InferConfig(Layout):
    micro_batch: int = Field(default=1, ge=1, description="sequences per forward pass per data-parallel rank")


class GenConfig(Layout):
    """Generation layout of the actor; dp is the number of engine replicas."""

    batching: Batching = Field(
        default="static", description="static: a batch runs until its longest response ends; "
                                      "continuous: a finished sequence's slot takes the next waiting one")
    max_batch: int | None = Field(
        default=None, ge=1, description="sequences one engine replica runs at once: static, waves of at most that "
                                        "many (as equal as can be); continuous, that many slots; null: all of the "
                                        "replica's sequences (prompts x samples) at once")
    kv_cache: KvCache = Field(
        default="reserved", description="reserved: each sequence in the engine holds KV-cache room for its longest "
                                        "(prompt + maximum response; hfplan's torch engine); paged: blocks of "
                                        "tokens as they are generated, freed when a sequence ends (vLLM)")
    engine: RolloutEngineName = Field(
        default="torch", description="the rollout engine: torch (hfplan's own, reserved KV cache) or vllm (paged "
                                     "KV cache, continuous batching); left out, the one kv_cache names")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="vllm only: the fraction of each GPU's memory vLLM budgets for its "
                                              "copy of the weights, its activations and its KV cache (the search "
                                              "writes the one that gives the KV cache the room the plan was "
                                              "costed with); null: vLLM's default")

    @model_validator(mode="before")
    @classmethod
    def _engine_of_cache(cls, data: object) -> object:
        """Plans written before the field: the engine their KV cache names (a paged cache is vLLM's); an engine
        given alone brings its KV cache (and vLLM its continuous batching)."""
        if not isinstance(data, dict):
            return data
        if "engine" not in data:
            return {**data, "engine": "vllm" if data.get("kv_cache") == "paged" else "torch"}
        if "kv_cache" not in data and data["engine"] in ENGINE_KV_CACHE:
            data = {**data, "kv_cache": ENGINE_KV_CACHE[data["engine"]]}
            if data["engine"] == "vllm":
                data.setdefault("batching", "continuous")
        return data

    @model_validator(mode="after")
    def _engine(self) -> GenConfig:
        problem = engine_problem(self.batching, self.kv_cache, self.engine)
        if self.gpu_memory_utilization is not None and self.engine != "vllm":
            problem = f"gpu_memory_utilization is vLLM's (engine={self.engine})"
        if problem:
            raise ValueError(problem)
        return self


class RoleParallelism(_Strict):
    train: TrainConfig | None = None
    infer: InferConfig | None = None
    gen: GenConfig | None = None


class PlacementSet(_Strict):
    models: list[str] = Field(min_length=1)
    gpus: int = Field(ge=1)


RESHARD_OP = "reshard"  # a transition span: the hybrid engine's switch from training into its generation layout
RESHARD_BACK_OP = "reshard back"  # its way back (the simulator prices it at zero; the executor times it)
WEIGHT_SYNC_OP = "weight sync"  # a transition span: a separate rollout set taking the actor's new weights


def switch_op(role: str) -> str:
    """The op a timeline gives the layout switch before `role` generates (simulated and measured alike)."""
    return WEIGHT_SYNC_OP if role == ROLLOUT else RESHARD_OP


class Span(_Strict):
    """One call on the timeline (simulated or measured)."""

    role: str
    op: str
    phase: str
    set: int = Field(description="index of the placement set it ran on; -1 for the controller")
    start: float
    end: float
    kind: Literal["compute", "transfer", "transition", "dispatch"] = Field(
        default="compute", description="compute: the call's work; transfer: an input on its way; transition: a "
                                       "layout switch; dispatch (simulated only): what the call costs its worker "
                                       "beyond its work (Ray's start of it, arguments, outputs), before the call")


EDGE = "->"  # a simulated edge's span is named `source call->destination call`
GREEDY_MARK = "(greedy)"  # ends a greedy generation's op in the simulator's names (the executor's are plain)


def phase_seconds(spans: Sequence[Span]) -> dict[str, float]:
    """Wall seconds of each phase, from the start of its first call or switch to the last end of its spans: a
    run's `<phase>_s` metrics, and the rule `hfplan validate` applies to both timelines. Dispatch spans do not
    count (a measured timeline has none: there the dispatch is the gap before a call), and a transfer opens no
    window (the simulator moves a field as soon as it is made, the executor when the call it feeds starts: the
    transfer into a later phase's first call would open that phase early in one timeline only); a phase of
    transfers alone spans them."""
    windows: dict[str, tuple[float, float]] = {}
    opened: dict[str, float] = {}
    for span in spans:
        if span.kind == "dispatch":
            continue
        first, last = windows.get(span.phase, (span.start, span.end))
        windows[span.phase] = (min(first, span.start), max(last, span.end))
        if span.kind != "transfer":
            opened[span.phase] = min(opened.get(span.phase, span.start), span.start)
    return {phase: last - opened.get(phase, first) for phase, (first, last) in windows.items()}


class Estimate(_Strict):
    iteration_s: float
    tokens_per_s: float
    stages: dict[str, float] = Field(description="seconds of each phase along the critical path (each call's "
                                                 "phase covers it, its layout switch and the transfer it waited "
                                                 "for last): they add up to iteration_s")
    busy_s: list[float] = Field(default_factory=list, description="seconds each placement set computes (calls "
                                                                  "and layout switches), in set order")
    idle_gpus: int = Field(default=0, ge=0, description="GPUs of the cluster that no placement set uses")
    peak_memory_gib: list[float] = Field(description="peak memory per GPU of each placement set")
    timeline: list[Span] = Field(default_factory=list)


class Plan(_Strict):
    version: Literal[2] = PLAN_VERSION
    workload: Workload
    cluster: Cluster
    placement: list[PlacementSet] = Field(min_length=1)
    parallelism: dict[str, RoleParallelism]
    estimate: Estimate | None = None

    @model_validator(mode="after")
    def _check(self) -> Plan:
        placed = [role for group in self.placement for role in group.models]
        needed = list(self.workload.model_roles)
        for role in placed:
            if role not in needed and role != ROLLOUT:
                raise ValueError(f"placement names {role!r}, which is not a model role of this workload "
                                 f"({', '.join(needed)})")
        for role in set(placed):
            if placed.count(role) > 1:
                raise ValueError(f"placement lists {role!r} in more than one set")
        for role in needed:
            if role not in placed:
                raise ValueError(f"placement leaves out role {role!r}")
        problem = staleness_problem(self.workload, [group.models for group in self.placement])
        if problem:
            raise ValueError(problem)
        total = sum(group.gpus for group in self.placement)
        if total > self.cluster.gpus:
            raise ValueError(f"placement uses {total} GPUs but the cluster has {self.cluster.gpus}")
        for role in self.parallelism:
            if role not in placed:
                raise ValueError(f"parallelism given for {role!r}, which is not placed")
        for index, group in enumerate(self.placement):
            for role in group.models:
                self._check_role(role, group.gpus, f"parallelism.{role}", index)
        return self

    @model_validator(mode="after")
    def _check_micro_batches(self) -> Plan:
        for role, par in self.parallelism.items():
            if par.train is None:
                continue
            most = self.workload.train_sequences_per_rank(par.train.dp)
            if par.train.micro_batch > most:
                raise ValueError(f"parallelism.{role}.train.micro_batch: {par.train.micro_batch} is more than the "
                                 f"{most} sequences each of its {par.train.dp} data-parallel ranks gets per "
                                 "mini-batch")
        return self

    def _check_role(self, role: str, gpus: int, where: str, index: int) -> None:
        par = self.parallelism.get(role)
        if par is None:
            raise ValueError(f"{where}: missing (role placed in set {index})")
        wanted = layouts_of(self.workload, role, self.generation_role)
        for kind in ("train", "infer", "gen"):
            layout, needed = getattr(par, kind), kind in wanted
            if needed and layout is None:
                raise ValueError(f"{where}.{kind}: required for role {role!r}")
            if not needed and layout is not None:
                raise ValueError(f"{where}.{kind}: role {role!r} does not {kind}")
            if layout is not None and layout.gpus != gpus:
                raise ValueError(f"{where}.{kind}: tp*pp*dp = {layout.gpus} but its set has {gpus} GPUs")
        problem = nesting_problem(par.train, par.gen) if par.train is not None and par.gen is not None else None
        if problem:
            raise ValueError(f"{where}.gen: {problem}")
        trained = par.train is not None
        if trained and par.infer is not None and (par.infer.tp, par.infer.pp) != (par.train.tp, par.train.pp):
            raise ValueError(f"{where}.infer: a trained role runs inference in its training layout "
                             f"(tp={par.train.tp}, pp={par.train.pp})")

    @property
    def placed_roles(self) -> list[str]:
        return [role for group in self.placement for role in group.models]

    def set_of(self, role: str) -> int:
        return set_index([group.models for group in self.placement])[role]

    def call_set(self, role: str, op: str) -> int:
        """The set that runs `role.op`; layout.ON_CONTROLLER for controller steps and rules."""
        return call_set(self.workload, [group.models for group in self.placement], role, op)

    @property
    def generation_role(self) -> str:
        """The role whose GPUs run `generate`: the rollout engine if placed, else the generating role."""
        return generation_role(self.workload, self.placed_roles)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def with_rollout_engine(self, engine: str) -> Plan:
        """The plan with every generation layout on `engine` (hfplan execute --rollout): its KV cache with it, vLLM
        batching continuously (at its default gpu_memory_utilization); the estimate is dropped, as it costed the
        other engine."""
        if engine not in ENGINE_KV_CACHE:
            raise HfplanError(f"--rollout {engine}: use {' or '.join(ENGINE_KV_CACHE)}")
        data = self.model_dump(mode="json") | {"estimate": None}
        for par in data["parallelism"].values():
            gen = par.get("gen")
            if gen is not None:
                gen.update(engine=engine, kv_cache=ENGINE_KV_CACHE[engine], gpu_memory_utilization=None)
                if engine == "vllm":
                    gen["batching"] = "continuous"
        return plan_from_dict(data, f"with --rollout {engine}")


def migrate_plan(data: dict) -> dict:
    """A version-1 plan as version 2. Every version-1 field means the same; its booleans (`train.shard`,
    `train.recompute`) are read by those fields' own validators, and the new fields take their defaults."""
    return data | {"version": 2} if data.get("version") == 1 else data


def plan_from_dict(data: object, source: str) -> Plan:
    if not isinstance(data, dict):
        raise HfplanError(f"plan {source}: expected a JSON object")
    version = data.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise HfplanError(f"plan {source}: unsupported version {version!r}; this hfplan reads versions "
                          f"{', '.join(map(str, READABLE_VERSIONS))}")
    data = migrate_plan(data)
    try:
        plan = Plan.model_validate(data)
    except ValidationError as bad:
        raise HfplanError(f"plan {source}: {describe_validation_error(bad)}") from None
    try:
        plan.workload.check_models()
    except HfplanError as error:
        raise HfplanError(f"plan {source}: workload: {error}") from None
    plan.cluster.profile  # noqa: B018 - load the hardware profile now so a bad name fails here
    return plan


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise HfplanError(f"plan file not found: {path}")
    return plan_from_dict(read_mapping(path, "plan"), str(path))


def colocated_plan(workload: Workload, tp: int, pp: int, dp: int, hardware: str) -> Plan:
    """Every model role on one set of tp * pp * dp devices of `hardware`: training and inference in that layout
    (sharded ZeRO-3 where dp > 1, a pipeline's mini-batch in pp micro-batches), generation at tp in one stage of
    pp * dp replicas."""
    generator = generating_role(workload)
    per_rank = workload.sequences // workload.mini_batches // dp
    parallelism = {}
    for role in workload.model_roles:
        kinds = layouts_of(workload, role, generator)
        parallelism[role] = RoleParallelism(
            train=TrainConfig(tp=tp, pp=pp, dp=dp, micro_batch=per_rank // pp, shard=dp > 1)
            if "train" in kinds else None,
            infer=InferConfig(tp=tp, pp=pp, dp=dp, micro_batch=workload.sequences // dp // pp),
            gen=GenConfig(tp=tp, dp=pp * dp) if "gen" in kinds else None,
        )
    gpus = tp * pp * dp
    return Plan(workload=workload, cluster=make_cluster(gpus, hardware),
                placement=[PlacementSet(models=list(workload.model_roles), gpus=gpus)], parallelism=parallelism)
