"""The dataflow contract: what a program may call on a role and on the controller, and what each call
writes. The tracer implements it (simulator), the executor implements it (Ray worker groups), and a
single-process numpy backend in the tests implements it; the algorithms stay the same.

Every call takes a Batch of the fields it reads and returns a Batch of the fields it writes. Its values
may be futures (hfplan.dataflow.batch.Future): a call returns once it is dispatched, so independent
calls on disjoint sets overlap, updates included (programs merge their metrics without waiting).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.ops import GENERATE_WRITES, ROLE_OPS


@dataclass(frozen=True)
class RoleFacts:
    """What a role is, independent of its name."""

    output: str  # the field its forward call (log_prob, values or score) writes
    trains: bool = False  # it has an optimizer: `update` calls and a training layout
    generates: bool = False  # it samples responses (`generate` calls)
    head: Literal["lm", "scalar"] = "lm"  # language-model head, or a scalar (value or score) head
    may_be_rule: bool = False  # a workload may make it a registered `rule:` computed on the controller


def update_field(role: str) -> str:
    """The field an update of `role` writes: its training metrics."""
    return f"{role}_metrics"


# The facts of the usual RLHF roles; an algorithm maps its role names to these or to its own.
ACTOR = RoleFacts(output="old_log_probs", trains=True, generates=True)
CRITIC = RoleFacts(output="values", trains=True, head="scalar")
REFERENCE = RoleFacts(output="ref_log_probs")
REWARD = RoleFacts(output="rewards", head="scalar", may_be_rule=True)
COST = RoleFacts(output="costs", head="scalar", may_be_rule=True)
COST_CRITIC = RoleFacts(output="cost_values", trains=True, head="scalar")


class Role(Protocol):
    """One model role of a program (actor, critic, reference, reward, ...)."""

    def generate(self, batch: Batch, n: int = 1, greedy: bool = False) -> Batch:
        """Reads prompts; writes prompts (each repeated n times, consecutively), responses, response_mask and
        behaviour_log_probs (each response token's log-prob under the sampling policy). greedy: argmax decoding
        instead of sampling."""
        ...

    def log_prob(self, batch: Batch) -> Batch:
        """Reads the sequences; writes the role's output field (per response token)."""
        ...

    def values(self, batch: Batch) -> Batch:
        """Reads the sequences; writes the role's output field (per response token)."""
        ...

    def score(self, batch: Batch) -> Batch:
        """Reads the sequences; writes the role's output field (one value per sequence)."""
        ...

    def update(self, batch: Batch) -> Batch:
        """The optimizer steps over the batch (epochs x mini-batches); writes update_field(role): metrics."""
        ...


class Controller(Protocol):
    """The single controller's own work between calls: registered steps (dataflow.controller.STEPS)."""

    samples_per_prompt: int
    reuse_policy_log_probs: bool  # the workload's option: the actor's loss reuses the current policy's log-probs
    staleness: int  # Workload.staleness: > 0, the responses come from older weights (an off-policy update)

    def step(self, name: str, batch: Batch) -> Batch:
        """Runs step `name` on the fields it reads (taken from `batch`); returns the fields it writes."""
        ...


Roles = Mapping[str, Role]


class CallingRole:
    """The Role protocol over one method, `call(op, batch, greedy, n)`: what a backend whose calls all
    take the same path implements (the executor's worker groups, its single-process roles)."""

    def call(self, op: str, batch: Batch, greedy: bool = False, n: int = 1) -> Batch:
        raise NotImplementedError

    def generate(self, batch: Batch, n: int = 1, greedy: bool = False) -> Batch:
        return self.call("generate", batch.select("prompts"), greedy=greedy, n=n)

    def log_prob(self, batch: Batch) -> Batch:
        return self.call("log_prob", batch)

    def values(self, batch: Batch) -> Batch:
        return self.call("values", batch)

    def score(self, batch: Batch) -> Batch:
        return self.call("score", batch)

    def update(self, batch: Batch) -> Batch:
        return self.call("update", batch)


def call_problem(role: str, facts: RoleFacts, op: str) -> str | None:
    """Why `role` cannot offer `op` (None when it can): generate needs a generating role, update a
    trained one, log_prob a language-model head, values and score a scalar head."""
    if op not in ROLE_OPS:
        return f"{role}.{op}: no such operation (roles offer {', '.join(ROLE_OPS)})"
    head = ROLE_OPS[op].head
    if head is not None and head != facts.head:
        return f"{role}.{op}: {op} needs a model with a {head} head; {role} has a {facts.head} head"
    if op == "generate" and not facts.generates:
        return f"{role}.generate: role {role!r} does not generate"
    if op == "update" and not facts.trains:
        return f"{role}.update: role {role!r} is not trained"
    return None


def call_writes(role: str, facts: RoleFacts, op: str) -> tuple[str, ...]:
    """The fields `role.op` writes: they follow from the call and the role's facts, not its name."""
    problem = call_problem(role, facts, op)
    if problem:
        raise ValueError(problem)
    if op == "generate":
        return GENERATE_WRITES
    if op == "update":
        return (update_field(role),)
    return (facts.output,)
