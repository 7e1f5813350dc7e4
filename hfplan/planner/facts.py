"""What stays fixed during one search: its workload, hardware, program and rules, which role's GPUs run each call,
and the keys the search's caches use (planner/context.py)."""

from __future__ import annotations

from functools import cached_property
from typing import NamedTuple

from hfplan.layout import ROLLOUT, call_role, facts_of, generating_role, generation_role
from hfplan.plan import RoleParallelism
from hfplan.planner import space
from hfplan.planner.strategies import Rules
from hfplan.profiles.hardware import HardwareProfile
from hfplan.simulator.costs import CostMemo
from hfplan.simulator.mapping import call_seconds
from hfplan.simulator.schedule import switch_points
from hfplan.simulator.trace import Dag, Node
from hfplan.spec import Workload


class RoleKey(NamedTuple):
    """Cache key of what one role can do on `gpus` GPUs. engine: the role that generates, for the trained role
    that may generate (its strategies depend on whether it does or a rollout set does); None for every other."""

    role: str
    gpus: int
    engine: str | None


class SetKey(NamedTuple):
    """Cache key of colocated `roles` on a set of `gpus` GPUs; engine as in RoleKey, for a set holding that role."""

    roles: tuple[str, ...]
    gpus: int
    engine: str | None


class SearchFacts:
    """Everything fixed during one search, with the cost tables (memo) its jobs share."""

    def __init__(self, workload: Workload, hw: HardwareProfile, gpus_per_node: int, dag: Dag, rules: Rules | None,
                 memo: CostMemo) -> None:
        self.workload = workload
        self.hw = hw
        self.gpus_per_node = gpus_per_node
        self.dag = dag
        self.rules = rules or Rules()
        self.memo = memo
        self.generator = generation_role(workload, (ROLLOUT,) if self.rules.rollout else ())
        self.trained_generator = generating_role(workload)
        self.usable = hw.memory.usable_bytes
        self.value_bytes = hw.compute.value_bytes
        self.attention = hw.compute.attention
        self._own: dict[str, list[Node]] = {}

    def role_key(self, role: str, gpus: int) -> RoleKey:
        """Cache key of one role's strategies: the generating role's depend on the engine."""
        return RoleKey(role, gpus, self.generator if role == self.trained_generator else None)

    def set_key(self, roles: tuple[str, ...], gpus: int) -> SetKey:
        """Cache key of a colocated set: one holding the generating role depends on the engine."""
        return SetKey(roles, gpus, self.generator if self.trained_generator in roles else None)

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

    @cached_property
    def controller_seconds(self) -> tuple[float, ...]:
        """Seconds of every call in node order that the controller runs itself (its steps, rules), 0 for the
        roles' calls: the row every strategy choice starts from."""
        step = self.hw.runtime.controller_step_s()
        return tuple(step if runner is None else 0.0 for runner in self.runners)

    def trains(self, role: str) -> bool:
        return facts_of(self.workload, role).trains

    def own_nodes(self, role: str) -> list[Node]:
        """The calls a role's GPUs run, generation excluded, in program order."""
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

    def seconds(self, node: Node, role: str, par: RoleParallelism, gpus: int, kv_budget: float = 0.0) -> float:
        """One call's seconds with `kv_budget` bytes per GPU for the KV cache (generate calls)."""
        return call_seconds(self.workload, self.hw, self.gpus_per_node, node, role, par, gpus, kv_budget, self.memo)
