"""The RLHF algorithms, each one iteration of a single-controller program over roles.

Written once, run by every backend: the executor passes Ray worker groups as roles, the simulator
passes tracing roles (hfplan.dataflow.roles is the contract). `ctl.step(name, batch)` runs a registered
controller step on the fields it declares it reads. Each role call gets only the fields it reads
(`select`), which is what makes its data dependencies explicit. Results may be futures: nothing here
waits, so calls on disjoint sets (updates included) overlap. Registered in hfplan.dataflow.registry.

Off-policy (asynchronous, `ctl.staleness` > 0), the responses were sampled by weights up to that many updates
older than the actor's: each actor update then also reads the behaviour policy's log-probs (`off_policy`), and
its loss weighs every token by the truncated importance ratio of the current policy's old log-probs to them
(hfplan.executor.engines.losses.actor_objective). The critics' updates are unchanged.
"""

from __future__ import annotations

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.ops import BEHAVIOUR
from hfplan.dataflow.ops import GENERATED as SEQUENCE
from hfplan.dataflow.roles import Controller, Roles


def off_policy(ctl: Controller) -> tuple[str, ...]:
    """The fields an actor update reads beyond its algorithm's own: the behaviour log-probs when off-policy."""
    return (BEHAVIOUR,) if ctl.staleness else ()


def ppo(roles: Roles, prompts: Batch, ctl: Controller) -> Batch:
    actor, critic, reference, reward = (roles[r] for r in ("actor", "critic", "reference", "reward"))
    batch = actor.generate(prompts)
    seqs = batch.select(*SEQUENCE)
    batch = batch | actor.log_prob(seqs) | reference.log_prob(seqs) | critic.values(seqs) | reward.score(seqs)
    batch = batch | ctl.step("gae", batch)
    return (critic.update(batch.select(*SEQUENCE, "values", "returns"))
            | actor.update(batch.select(*SEQUENCE, "old_log_probs", "advantages", *off_policy(ctl))))


def grpo(roles: Roles, prompts: Batch, ctl: Controller) -> Batch:
    actor, reference, reward = (roles[r] for r in ("actor", "reference", "reward"))
    batch = actor.generate(prompts, n=ctl.samples_per_prompt)
    seqs = batch.select(*SEQUENCE)
    # On-policy (one optimizer step per iteration), the loss may take its ratio against the current policy's
    # own log-probs, detached: the same values and gradients without the forward call.
    own = () if ctl.reuse_policy_log_probs else ("old_log_probs",)
    if own:
        batch = batch | actor.log_prob(seqs)
    batch = batch | reference.log_prob(seqs) | reward.score(seqs)
    batch = batch | ctl.step("group_norm", batch)
    return actor.update(batch.select(*SEQUENCE, *own, "ref_log_probs", "advantages", *off_policy(ctl)))


def remax(roles: Roles, prompts: Batch, ctl: Controller) -> Batch:
    actor, reference, reward = (roles[r] for r in ("actor", "reference", "reward"))
    batch = actor.generate(prompts)
    greedy = actor.generate(prompts, greedy=True)
    seqs = batch.select(*SEQUENCE)
    baseline = reward.score(greedy.select(*SEQUENCE)).rename(rewards="baseline_rewards")
    batch = batch | actor.log_prob(seqs) | reference.log_prob(seqs) | reward.score(seqs) | baseline
    batch = batch | ctl.step("greedy_baseline", batch)
    return actor.update(batch.select(*SEQUENCE, "old_log_probs", "advantages", *off_policy(ctl)))


def safe_rlhf(roles: Roles, prompts: Batch, ctl: Controller) -> Batch:
    actor, critic, reference, reward, cost, cost_critic = (
        roles[r] for r in ("actor", "critic", "reference", "reward", "cost", "cost_critic"))
    batch = actor.generate(prompts)
    seqs = batch.select(*SEQUENCE)
    batch = (batch | actor.log_prob(seqs) | reference.log_prob(seqs) | critic.values(seqs)
             | cost_critic.values(seqs) | reward.score(seqs) | cost.score(seqs))
    batch = batch | ctl.step("safe_gae", batch)
    return (critic.update(batch.select(*SEQUENCE, "values", "returns"))
            | cost_critic.update(batch.select(*SEQUENCE, "cost_values", "cost_returns"))
            | actor.update(batch.select(*SEQUENCE, "old_log_probs", "advantages", *off_policy(ctl))))
