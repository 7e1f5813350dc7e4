"""Plan: the one contract between the planner and the executor. Versioned JSON.

A plan says where each role's model lives (placement: colocated sets with a GPU count each), how
each role is parallelised for training, inference and generation, and what the simulator expects
of it (estimate). `hfplan search` writes one; `hfplan simulate` and `hfplan execute` read one; a
user may write one by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hfplan.errors import HfplanError, describe_validation_error
from hfplan.files import read_mapping
from hfplan.layout import ROLLOUT, call_set, generation_role, layouts_of, nesting_problem, set_index
from hfplan.spec import Cluster, Workload

# ROLLOUT (re-exported): the pseudo-role of a separate generation engine (weights synced from the actor
# each iteration, as OpenRLHF does). Without it the actor generates on its own GPUs (hybrid engine).

PLAN_VERSION = 1


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


class TrainConfig(Layout):
    micro_batch: int = Field(default=1, ge=1, description="sequences per micro-batch per data-parallel rank")
    shard: bool = Field(default=True, description="shard parameters, gradients and optimizer states across "
                                                  "data-parallel ranks (FSDP / ZeRO-3); false keeps them "
                                                  "replicated (DDP)")
    recompute: bool = Field(default=False, description="recompute activations in the backward pass")


class InferConfig(Layout):
    micro_batch: int = Field(default=1, ge=1, description="sequences per forward pass per data-parallel rank")


class GenConfig(Layout):
    """Generation layout of the actor; dp is the number of engine replicas."""


class RoleParallelism(_Strict):
    train: TrainConfig | None = None
    infer: InferConfig | None = None
    gen: GenConfig | None = None


class PlacementSet(_Strict):
    models: list[str] = Field(min_length=1)
    gpus: int = Field(ge=1)


class Span(_Strict):
    """One call on the timeline (simulated or measured)."""

    role: str
    op: str
    phase: str
    set: int = Field(description="index of the placement set it ran on; -1 for the controller")
    start: float
    end: float
    kind: Literal["compute", "transfer", "transition"] = "compute"


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
    version: Literal[1] = PLAN_VERSION
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


def plan_from_dict(data: object, source: str) -> Plan:
    if not isinstance(data, dict):
        raise HfplanError(f"plan {source}: expected a JSON object")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise HfplanError(f"plan {source}: unsupported version {version!r}; this hfplan reads version "
                          f"{PLAN_VERSION}")
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
