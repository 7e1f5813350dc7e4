"""Hyperparameters of a real run: optimisation, losses, advantages, sampling, Safe-RLHF's multiplier.

They live in the workload (`hyperparameters:` in its file) and `hfplan execute --set key=value`
overrides them. The simulator and the planner ignore them: they change what is learned, not what
a call costs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hfplan.errors import HfplanError, describe_validation_error, known_names


class Hyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Optimisation (AdamW), per trained role.
    actor_lr: float = Field(default=1e-6, gt=0, description="actor learning rate")
    critic_lr: float = Field(default=1e-5, gt=0, description="critic learning rate")
    cost_critic_lr: float = Field(default=1e-5, gt=0, description="Safe-RLHF cost critic learning rate")
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient clipping by global norm")
    # Losses.
    clip_ratio: float = Field(default=0.2, gt=0, description="PPO clipped surrogate: 1 +- clip_ratio")
    value_clip: float = Field(default=0.2, gt=0, description="critic: values clipped to old +- value_clip")
    entropy_coef: float = Field(default=0.0, ge=0, description="entropy bonus in the actor loss")
    kl_coef: float = Field(default=0.05, ge=0, description="PPO, ReMax, Safe-RLHF: KL penalty in the reward")
    kl_loss_coef: float = Field(default=0.001, ge=0, description="GRPO: KL term in the actor loss")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="estimator of KL(pi || pi_ref) per token (Schulman's k1, k2, k3)")
    off_policy_cap: float = Field(
        default=2.0, ge=1, description="asynchronous runs (staleness > 0): each token's importance weight "
        "old / behaviour policy probability is truncated at this (truncated importance sampling)")
    # Advantages.
    gamma: float = Field(default=1.0, ge=0, le=1, description="GAE discount")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda")
    # Sampling.
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    # Safe-RLHF.
    cost_limit: float = Field(default=0.0, description="allowed mean cost per response")
    lagrange_lr: float = Field(default=0.05, ge=0)
    lagrange_init: float = Field(default=1.0, ge=0)


def with_overrides(base: Hyperparameters, assignments: list[str]) -> Hyperparameters:
    """Apply `key=value` strings (from `--set`); values are parsed as the field's type."""
    fields = Hyperparameters.model_fields
    updates: dict[str, object] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise HfplanError(f"--set {item!r}: expected key=value")
        if key not in fields:
            raise HfplanError(f"--set {key}: unknown hyperparameter; known: {known_names(fields)}")
        updates[key] = raw.strip()
    data = base.model_dump() | updates
    try:
        return Hyperparameters.model_validate(data)
    except ValidationError as bad:
        raise HfplanError(f"--set: {describe_validation_error(bad)}") from None
