"""Evaluation on held-out prompts: one more single-controller program over the roles, written once for every
backend. The generating role answers greedily (no sampling, so no random stream moves) and every scoring role
(untrained, with a scalar head: the reward, Safe-RLHF's cost) scores the answers; nothing is updated.
"""

from __future__ import annotations

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.ops import GENERATED as SEQUENCE
from hfplan.dataflow.registry import Algorithm
from hfplan.dataflow.roles import Roles


def scoring_roles(algorithm: Algorithm) -> list[str]:
    """The roles whose `score` an evaluation reports, in the algorithm's role order."""
    return [role for role, facts in algorithm.roles.items() if facts.head == "scalar" and not facts.trains]


def evaluate(roles: Roles, prompts: Batch, algorithm: Algorithm) -> Batch:
    """Greedy responses to `prompts` (the generated fields) and each scoring role's output field."""
    greedy = roles[algorithm.generator].generate(prompts, greedy=True)
    seqs = greedy.select(*SEQUENCE)
    batch = seqs
    for role in scoring_roles(algorithm):
        batch = batch | roles[role].score(seqs)
    return batch
