"""The operations of RLHF roles: which stage each belongs to, which layout it runs in, what it writes.

Shared by both backends: the tracer records a node per call from this table, the executor dispatches
the same method names to its workers.
"""

from __future__ import annotations

from dataclasses import dataclass

GENERATION, PREPARATION, TRAINING = "generation", "preparation", "training"
PHASES = (GENERATION, PREPARATION, TRAINING)


@dataclass(frozen=True)
class RoleOp:
    phase: str
    layout: str  # "gen", "infer" or "train": which of the role's layouts the call runs in
    kind: str  # cost-model kind: generate | forward | update


ROLE_OPS: dict[str, RoleOp] = {
    "generate": RoleOp(GENERATION, "gen", "generate"),
    "log_prob": RoleOp(PREPARATION, "infer", "forward"),
    "values": RoleOp(PREPARATION, "infer", "forward"),
    "score": RoleOp(PREPARATION, "infer", "forward"),
    "update": RoleOp(TRAINING, "train", "update"),
}

# The field a forward call writes, by (role, op).
OUTPUT_FIELD: dict[tuple[str, str], str] = {
    ("actor", "log_prob"): "old_log_probs",
    ("reference", "log_prob"): "ref_log_probs",
    ("critic", "values"): "values",
    ("cost_critic", "values"): "cost_values",
    ("reward", "score"): "rewards",
    ("cost", "score"): "costs",
}

# Field shapes, for the bytes an edge carries: token ids (int64), one fp32 per response token, one
# fp32 per sequence. Anything else a controller step writes is per-token unless listed.
FIELD_KIND: dict[str, str] = {
    "prompts": "prompt_tokens",
    "responses": "response_tokens",
    "rewards": "per_sequence",
    "costs": "per_sequence",
    "baseline_rewards": "per_sequence",
}


def output_field(role: str, op: str) -> str:
    try:
        return OUTPUT_FIELD[(role, op)]
    except KeyError:
        raise ValueError(f"role {role!r} has no operation {op!r}") from None
