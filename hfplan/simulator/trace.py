"""Run a dataflow program on tracing roles and record its DAG: one node per call, edges with bytes.

Nothing here knows any algorithm: the DAG is whatever the program calls, in program order.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.controller import STEPS
from hfplan.dataflow.ops import PREPARATION, ROLE_OPS
from hfplan.dataflow.registry import get_algorithm
from hfplan.dataflow.roles import RoleFacts, call_writes
from hfplan.layout import CONTROLLER, runs_on_controller
from hfplan.plan import GREEDY_MARK
from hfplan.spec import Workload

TOKEN_ID_BYTES = 8  # int64 token ids
VALUE_BYTES = 4  # fp32 per-token and per-sequence values
# Cost-model kind of each role operation.
COST_KIND = {"generate": "generate", "log_prob": "forward", "values": "forward", "score": "forward",
             "update": "update"}
# Field shapes, for the bytes an edge carries: token ids (int64), one fp32 per response token, one
# fp32 per sequence. Anything else is per-token unless listed.
FIELD_KIND: dict[str, str] = {
    "prompts": "prompt_tokens",
    "responses": "response_tokens",
    "rewards": "per_sequence",
    "costs": "per_sequence",
    "baseline_rewards": "per_sequence",
}


@dataclass(frozen=True)
class Sym:
    """A symbolic field: which node wrote it (None: an input of the iteration), over how many sequences."""

    producer: int | None
    name: str
    sequences: int


@dataclass(frozen=True)
class Edge:
    src: int
    nbytes: float
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Node:
    id: int
    role: str  # a workload role, or "controller"
    op: str
    phase: str
    sequences: int
    deps: tuple[Edge, ...]
    writes: tuple[str, ...]
    greedy: bool = False
    reads: tuple[str, ...] = ()  # every field the call received, inputs of the iteration included

    @property
    def kind(self) -> str:
        return COST_KIND[self.op] if self.role != CONTROLLER else "controller"

    @property
    def layout(self) -> str:
        return ROLE_OPS[self.op].layout if self.role != CONTROLLER else "host"

    @property
    def label(self) -> str:
        return f"{self.role}.{self.op}" + (GREEDY_MARK if self.greedy else "")


@dataclass(frozen=True)
class Dag:
    algorithm: str
    nodes: tuple[Node, ...]

    def signature(self) -> list[str]:
        """Node labels in program order: what tests pin per algorithm."""
        return [n.label for n in self.nodes]


def field_bytes(name: str, sequences: int, workload: Workload) -> float:
    kind = FIELD_KIND.get(name, "per_token")
    if kind == "prompt_tokens":
        return sequences * workload.prompt_len * TOKEN_ID_BYTES
    if kind == "response_tokens":
        return sequences * workload.response_len * TOKEN_ID_BYTES
    if kind == "per_sequence":
        return sequences * VALUE_BYTES
    return sequences * workload.response_len * VALUE_BYTES


class Tracer:
    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.nodes: list[Node] = []
        self.last_on_controller: int | None = None  # the controller's latest step or rule, in program order

    def record(self, role: str, op: str, phase: str, batch: Batch, writes: tuple[str, ...], sequences: int,
               greedy: bool = False) -> Batch:
        by_producer: dict[int, list[Sym]] = {}
        for value in batch.values():
            if value.producer is not None:
                by_producer.setdefault(value.producer, []).append(value)
        # The controller runs the program in order, its own steps and rules included: a call made after one is
        # made once the controller has run it (an edge of no bytes, where no field of it is read).
        if (self.last_on_controller is not None and self.last_on_controller not in by_producer
                and not runs_on_controller(self.workload, role)):
            by_producer[self.last_on_controller] = []
        deps = tuple(
            Edge(src, sum(field_bytes(s.name, s.sequences, self.workload) for s in syms),
                 tuple(s.name for s in syms))
            for src, syms in sorted(by_producer.items())
        )
        node = Node(len(self.nodes), role, op, phase, sequences, deps, writes, greedy, tuple(batch))
        self.nodes.append(node)
        if runs_on_controller(self.workload, role):
            self.last_on_controller = node.id
        return Batch({name: Sym(node.id, name, sequences) for name in writes})


def _sequences_of(batch: Batch, call: str) -> int:
    if not batch:
        raise ValueError(f"{call} received an empty batch")
    for name, value in batch.items():
        if not isinstance(value, Sym):
            raise TypeError(f"{call}: batch field {name!r} holds {type(value).__name__}, not a traced value")
    return max(v.sequences for v in batch.values())


class TracingRole:
    """The dataflow Role protocol (hfplan.dataflow.roles) over a tracer: each call records a node."""

    def __init__(self, name: str, facts: RoleFacts, tracer: Tracer) -> None:
        self.name = name
        self.facts = facts
        self.tracer = tracer

    def generate(self, batch: Batch, n: int = 1, greedy: bool = False) -> Batch:
        writes = call_writes(self.name, self.facts, "generate")
        sequences = _sequences_of(batch, f"{self.name}.generate") * n
        return self.tracer.record(self.name, "generate", ROLE_OPS["generate"].phase, batch.select("prompts"),
                                  writes, sequences, greedy)

    def _forward(self, op: str, batch: Batch) -> Batch:
        return self.tracer.record(self.name, op, ROLE_OPS[op].phase, batch, call_writes(self.name, self.facts, op),
                                  _sequences_of(batch, f"{self.name}.{op}"))

    def log_prob(self, batch: Batch) -> Batch:
        return self._forward("log_prob", batch)

    def values(self, batch: Batch) -> Batch:
        return self._forward("values", batch)

    def score(self, batch: Batch) -> Batch:
        return self._forward("score", batch)

    def update(self, batch: Batch) -> Batch:
        return self.tracer.record(self.name, "update", ROLE_OPS["update"].phase, batch,
                                  call_writes(self.name, self.facts, "update"),
                                  _sequences_of(batch, f"{self.name}.update"))


class TracingController:
    def __init__(self, tracer: Tracer, samples_per_prompt: int, reuse_policy_log_probs: bool,
                 staleness: int = 0) -> None:
        self.tracer = tracer
        self.samples_per_prompt = samples_per_prompt
        self.reuse_policy_log_probs = reuse_policy_log_probs
        self.staleness = staleness

    def step(self, name: str, batch: Batch) -> Batch:
        step = STEPS[name]
        inputs = batch.select(*step.reads)
        return self.tracer.record(CONTROLLER, name, PREPARATION, inputs, step.writes,
                                  _sequences_of(inputs, f"controller.{name}"))


def trace(workload: Workload) -> Dag:
    tracer = Tracer(workload)
    algorithm = get_algorithm(workload.algorithm)
    roles = {role: TracingRole(role, facts, tracer) for role, facts in algorithm.roles.items()}
    prompts = Batch(prompts=Sym(None, "prompts", workload.batch_prompts))
    algorithm.program(roles, prompts, TracingController(tracer, workload.samples_per_prompt,
                                                            workload.reuse_policy_log_probs, workload.staleness))
    return Dag(workload.algorithm, tuple(tracer.nodes))
