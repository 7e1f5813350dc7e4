"""Advantage estimators computed on the controller (numpy; shared by every backend).

Arrays are [sequences, response_len]; `mask` is 1 on real response tokens and 0 after the end of a
response. Per-sequence scores arrive as [sequences].
"""

from __future__ import annotations

import numpy as np


def last_token_index(mask: np.ndarray) -> np.ndarray:
    lengths = mask.sum(axis=1).astype(int)
    return np.maximum(lengths - 1, 0)


def token_rewards(score: np.ndarray, log_probs: np.ndarray, ref_log_probs: np.ndarray, mask: np.ndarray,
                  kl_coef: float) -> np.ndarray:
    """Per-token reward: -kl_coef * (log pi - log pi_ref) on every token, plus the sequence score on
    its last real token."""
    rewards = -kl_coef * (log_probs - ref_log_probs) * mask
    rows = np.arange(len(score))
    rewards[rows, last_token_index(mask)] += score
    return rewards


def gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float
        ) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation (Schulman et al., 2016) over masked responses.
    Returns (advantages, returns), both zero past the end of each response."""
    steps = rewards.shape[1]
    advantages = np.zeros_like(rewards, dtype=np.float64)
    running = np.zeros(rewards.shape[0])
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < steps else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    returns = (advantages + values) * mask
    return advantages * mask, returns


def whiten(values: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Normalise to zero mean and unit variance over the real tokens."""
    n = max(mask.sum(), 1.0)
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / n
    return (values - mean) / np.sqrt(var + eps) * mask


def group_advantages(score: np.ndarray, mask: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """GRPO: each response's score normalised by the mean and std of its prompt's group of
    `group_size` consecutive responses, broadcast to its tokens."""
    if len(score) % group_size:
        raise ValueError(f"{len(score)} scores do not split into groups of {group_size}")
    groups = score.reshape(-1, group_size)
    normalised = (groups - groups.mean(axis=1, keepdims=True)) / (groups.std(axis=1, keepdims=True) + eps)
    return normalised.reshape(-1, 1) * mask


def baseline_advantages(score: np.ndarray, baseline: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """ReMax: the sampled response's score minus the greedy response's score, on every token."""
    return (score - baseline).reshape(-1, 1) * mask


def lagrange_step(multiplier: float, mean_cost: float, limit: float, lr: float) -> float:
    """Safe-RLHF: gradient ascent on the multiplier of the cost constraint, kept non-negative."""
    return max(0.0, multiplier + lr * (mean_cost - limit))


def safe_advantages(reward_adv: np.ndarray, cost_adv: np.ndarray, multiplier: float) -> np.ndarray:
    """Safe-RLHF's combined advantage (A_r - lambda * A_c) / (1 + lambda)."""
    return (reward_adv - multiplier * cost_adv) / (1.0 + multiplier)
