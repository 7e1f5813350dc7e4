"""The RLHF algorithms, each one iteration of a single-controller program over roles.

Written once, run by both backends: the executor passes Ray worker groups as roles, the simulator
passes tracing roles. A role offers generate / log_prob / values / score / update; `ctl.step(name,
batch)` runs a registered controller step. Each call gets only the fields it reads (`select`), which
is what makes its data dependencies explicit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hfplan.dataflow.batch import Batch

SEQUENCE = ("prompts", "responses", "response_mask")


class Controller(Protocol):
    samples_per_prompt: int

    def step(self, name: str, batch: Batch) -> Batch: ...


Roles = Mapping[str, Any]
Algorithm = Callable[[Roles, Batch, Controller], dict]


def ppo(roles: Roles, prompts: Batch, ctl: Controller) -> dict:
    actor, critic, reference, reward = (roles[r] for r in ("actor", "critic", "reference", "reward"))
    batch = actor.generate(prompts)
    seqs = batch.select(*SEQUENCE)
    batch = batch | actor.log_prob(seqs) | reference.log_prob(seqs) | critic.values(seqs) | reward.score(seqs)
    batch = batch | ctl.step("gae", batch.select("rewards", "values", "old_log_probs", "ref_log_probs",
                                                  "response_mask"))
    metrics = dict(critic.update(batch.select(*SEQUENCE, "values", "returns")))
    metrics |= actor.update(batch.select(*SEQUENCE, "old_log_probs", "advantages"))
    return metrics


def grpo(roles: Roles, prompts: Batch, ctl: Controller) -> dict:
    actor, reference, reward = (roles[r] for r in ("actor", "reference", "reward"))
    batch = actor.generate(prompts, n=ctl.samples_per_prompt)
    seqs = batch.select(*SEQUENCE)
    batch = batch | actor.log_prob(seqs) | reference.log_prob(seqs) | reward.score(seqs)
    batch = batch | ctl.step("group_norm", batch.select("rewards", "response_mask"))
    return dict(actor.update(batch.select(*SEQUENCE, "old_log_probs", "ref_log_probs", "advantages")))


def remax(roles: Roles, prompts: Batch, ctl: Controller) -> dict:
    actor, reference, reward = (roles[r] for r in ("actor", "reference", "reward"))
    batch = actor.generate(prompts)
    greedy = actor.generate(prompts, greedy=True)
    seqs = batch.select(*SEQUENCE)
    baseline = reward.score(greedy.select(*SEQUENCE)).rename(rewards="baseline_rewards")
    batch = batch | actor.log_prob(seqs) | reference.log_prob(seqs) | reward.score(seqs) | baseline
    batch = batch | ctl.step("greedy_baseline", batch.select("rewards", "baseline_rewards", "old_log_probs",
                                                              "ref_log_probs", "response_mask"))
    return dict(actor.update(batch.select(*SEQUENCE, "old_log_probs", "advantages")))


def safe_rlhf(roles: Roles, prompts: Batch, ctl: Controller) -> dict:
    actor, critic, reference, reward, cost, cost_critic = (
        roles[r] for r in ("actor", "critic", "reference", "reward", "cost", "cost_critic"))
    batch = actor.generate(prompts)
    seqs = batch.select(*SEQUENCE)
    batch = (batch | actor.log_prob(seqs) | reference.log_prob(seqs) | critic.values(seqs)
             | cost_critic.values(seqs) | reward.score(seqs) | cost.score(seqs))
    batch = batch | ctl.step("safe_gae", batch.select("rewards", "costs", "values", "cost_values",
                                                       "old_log_probs", "ref_log_probs", "response_mask"))
    metrics = dict(critic.update(batch.select(*SEQUENCE, "values", "returns")))
    metrics |= cost_critic.update(batch.select(*SEQUENCE, "cost_values", "cost_returns"))
    metrics |= actor.update(batch.select(*SEQUENCE, "old_log_probs", "advantages"))
    return metrics


ALGORITHMS: dict[str, Algorithm] = {"ppo": ppo, "grpo": grpo, "remax": remax, "safe-rlhf": safe_rlhf}
