"""The RLHF losses as pure tensor math over the [B, R] per-token layout of `sequences`.

Aggregation is a token mean over a whole mini-batch across every data-parallel rank: each function
takes `tokens`, the number of real response tokens in the mini-batch on all ranks together, and
returns sum(token terms) / tokens for its micro-batch. Summing those over the micro-batches and ranks
of a mini-batch (gradient accumulation plus a summed gradient reduction) gives exactly the gradient
of the single-process token mean. The statistics returned beside each loss are normalised the same
way, so they add up across micro-batches and ranks too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from hfplan.dataflow.ops import BEHAVIOUR

if TYPE_CHECKING:
    from hfplan.hyperparams import Hyperparameters

KlEstimator = Literal["k1", "k2", "k3"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask` is 1 (masked entries never contribute, even if NaN or inf)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum()


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor  # sum of clipped-surrogate token losses / tokens (differentiable)
    clip_frac: torch.Tensor  # share of tokens where the clipped term was taken (/ tokens)
    approx_kl: torch.Tensor  # 0.5 * (logp - old_logp)^2 per token (/ tokens), a KL(old || new) estimate


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_ratio: float, tokens: float | torch.Tensor,
                weights: torch.Tensor | None = None) -> PolicyLoss:
    """PPO clipped surrogate: per token max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c)), times `weights` per
    token when given (an off-policy run's importance weights, constants of the gradient)."""
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    with torch.no_grad():
        clip_frac = masked_sum((clipped > unclipped).to(per_token.dtype), mask) / tokens
        approx_kl = masked_sum(0.5 * log_ratio.detach() ** 2, mask) / tokens
    return PolicyLoss(masked_sum(per_token, mask) / tokens, clip_frac, approx_kl)


@dataclass(frozen=True)
class ValueLoss:
    loss: torch.Tensor  # sum of clipped value token losses / tokens (differentiable)
    clip_frac: torch.Tensor  # share of tokens where the clipped error was the larger (/ tokens)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               value_clip: float, tokens: float | torch.Tensor) -> ValueLoss:
    """Clipped value loss: per token 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)."""
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
    with torch.no_grad():
        clip_frac = masked_sum((clipped_error > unclipped_error).to(per_token.dtype), mask) / tokens
    return ValueLoss(masked_sum(per_token, mask) / tokens, clip_frac)


def kl_per_token(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; known: k1, k2, k3")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, in float32: logsumexp(l) - sum(p * l)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def token_mean(values: torch.Tensor, mask: torch.Tensor, tokens: float | torch.Tensor) -> torch.Tensor:
    """A per-token term aggregated like the losses: masked sum / mini-batch token count."""
    return masked_sum(values, mask) / tokens


# The objectives of the trained roles over one micro-batch (fields as in the update's batch), shared by
# every engine that trains: (loss, statistics), each a sum of token terms / `tokens`.
Objective = tuple[torch.Tensor, dict[str, torch.Tensor]]


def behaviour_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token importance weights of an off-policy batch: min(pi_old / pi_behaviour, cap), detached. The PPO
    ratio is taken against pi_old (the weights the update starts from), and these weights carry the samples from
    the behaviour policy (older weights, that generated them) over to pi_old; truncating them bounds the variance
    (truncated importance sampling, as the decoupled PPO objective of asynchronous trainers does)."""
    return torch.exp(old_log_probs.detach() - behaviour_log_probs).clamp(max=cap)


def actor_objective(log_probs: torch.Tensor, entropy: torch.Tensor, batch: dict[str, torch.Tensor],
                    tokens: float | torch.Tensor, hp: Hyperparameters, use_kl_loss: bool) -> Objective:
    """PPO clipped surrogate - entropy_coef * entropy (+ kl_loss_coef * KL to the reference). Without
    old_log_probs in the batch (Workload.reuse_policy_log_probs: on-policy), the ratio is against the current
    log-probs, detached. With behaviour_log_probs (an asynchronous run, Workload.staleness > 0), every token's
    surrogate is weighed by behaviour_weights."""
    mask = batch["response_mask"]
    old = batch["old_log_probs"] if "old_log_probs" in batch else log_probs.detach()
    weights = behaviour_weights(old, batch[BEHAVIOUR], hp.off_policy_cap) if BEHAVIOUR in batch else None
    policy = policy_loss(log_probs, old, batch["advantages"], mask, hp.clip_ratio, tokens, weights)
    entropy_term = token_mean(entropy, mask, tokens)
    loss = policy.loss - hp.entropy_coef * entropy_term
    stats = {"policy_loss": policy.loss, "entropy": entropy_term, "approx_kl": policy.approx_kl,
             "clip_frac": policy.clip_frac}
    if weights is not None:
        stats["behaviour_weight"] = token_mean(weights, mask, tokens)
    if use_kl_loss:
        kl = token_mean(kl_per_token(log_probs, batch["ref_log_probs"], hp.kl_estimator), mask, tokens)
        loss = loss + hp.kl_loss_coef * kl
        stats["kl"] = kl
    return loss, stats


def critic_objective(values: torch.Tensor, batch: dict[str, torch.Tensor], value_key: str, return_key: str,
                     tokens: float | torch.Tensor, hp: Hyperparameters) -> Objective:
    """Clipped value regression of `values` toward batch[return_key], around batch[value_key]."""
    out = value_loss(values, batch[value_key], batch[return_key], batch["response_mask"], hp.value_clip, tokens)
    return out.loss, {"value_loss": out.loss, "value_clip_frac": out.clip_frac}
