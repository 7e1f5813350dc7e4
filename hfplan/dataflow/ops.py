"""The operations of RLHF roles: which stage each belongs to and which of its role's layouts it runs in.

Shared by every backend: the tracer records a node per call, the executor dispatches the same method
names to its workers in the layout named here. What a call writes follows from its role's facts
(hfplan.dataflow.registry), never from the role's name.
"""

from __future__ import annotations

from dataclasses import dataclass

GENERATION, PREPARATION, TRAINING = "generation", "preparation", "training"
PHASES = (GENERATION, PREPARATION, TRAINING)


@dataclass(frozen=True)
class RoleOp:
    phase: str
    layout: str  # "gen", "infer" or "train": which of the role's layouts the call runs in
    head: str | None = None  # the head the role's model needs for this call (None: any)


ROLE_OPS: dict[str, RoleOp] = {
    "generate": RoleOp(GENERATION, "gen", "lm"),
    "log_prob": RoleOp(PREPARATION, "infer", "lm"),
    "values": RoleOp(PREPARATION, "infer", "scalar"),
    "score": RoleOp(PREPARATION, "infer", "scalar"),
    "update": RoleOp(TRAINING, "train"),
}
# The sequences a generate call writes: the prompts repeated n times, the responses and their mask.
GENERATED = ("prompts", "responses", "response_mask")
# Beside them, each response token's log-prob under the policy that sampled it (the behaviour policy): what an
# off-policy (asynchronous, Workload.staleness > 0) update weighs its tokens by. Read by no call unless selected.
BEHAVIOUR = "behaviour_log_probs"
GENERATE_WRITES = (*GENERATED, BEHAVIOUR)
