"""Advantage estimators (numpy) and the controller steps built on them, checked against hand arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from hfplan.dataflow import advantages as adv
from hfplan.dataflow.controller import STEPS, ControllerState
from hfplan.hyperparams import Hyperparameters

# Two responses of a 3-token window: the first fills it, the second ends after two tokens. The values
# past the end (5.0 reward, 9.0 value) are garbage that must never leak into any result.
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
REWARDS = np.array([[1.0, 0.0, 2.0], [0.0, 3.0, 5.0]])
VALUES = np.array([[0.5, 1.0, 1.5], [1.0, 2.0, 9.0]])


# -- GAE ------------------------------------------------------------------------------------------
def test_gae_by_hand():
    # gamma = 0.9, lam = 0.8, so gamma * lam = 0.72.
    # Sequence 0: deltas (r_t + 0.9 V_{t+1} - V_t) = [1 + 0.9 - 0.5, 0 + 1.35 - 1, 2 - 1.5] = [1.4, 0.35, 0.5]
    #   A_2 = 0.5; A_1 = 0.35 + 0.72 * 0.5 = 0.71; A_0 = 1.4 + 0.72 * 0.71 = 1.9112
    # Sequence 1 (ends at t = 1, so V_2 counts as 0): deltas [0 + 1.8 - 1, 3 - 2] = [0.8, 1.0]
    #   A_1 = 1.0; A_0 = 0.8 + 0.72 * 1.0 = 1.52; A_2 = 0 (masked)
    advantages, returns = adv.gae(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(advantages, [[1.9112, 0.71, 0.5], [1.52, 1.0, 0.0]], atol=1e-12)
    np.testing.assert_allclose(returns, [[2.4112, 1.71, 2.0], [2.52, 3.0, 0.0]], atol=1e-12)


def test_gae_masked_positions_are_zero_and_returns_are_advantages_plus_values():
    rng = np.random.default_rng(0)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=float)
    rewards = rng.normal(size=mask.shape)
    values = rng.normal(size=mask.shape)
    advantages, returns = adv.gae(rewards, values, mask, gamma=0.99, lam=0.95)
    assert np.all(advantages[mask == 0] == 0.0)
    assert np.all(returns[mask == 0] == 0.0)
    np.testing.assert_allclose(returns[mask == 1], (advantages + values)[mask == 1])


def test_gae_ignores_what_lies_past_the_end():
    changed_rewards, changed_values = REWARDS.copy(), VALUES.copy()
    changed_rewards[1, 2] = -100.0
    changed_values[1, 2] = 123.0
    a1, r1 = adv.gae(REWARDS, VALUES, MASK, 0.9, 0.8)
    a2, r2 = adv.gae(changed_rewards, changed_values, MASK, 0.9, 0.8)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(r1, r2)


def test_gae_lambda_one_gives_monte_carlo_returns_and_lambda_zero_gives_td_errors():
    # lam = 1: returns are the discounted sums of future rewards, whatever the values.
    _, returns = adv.gae(REWARDS, VALUES, MASK, gamma=0.5, lam=1.0)
    expected = [[1.0 + 0.5 * 0.0 + 0.25 * 2.0, 0.0 + 0.5 * 2.0, 2.0], [0.0 + 0.5 * 3.0, 3.0, 0.0]]
    np.testing.assert_allclose(returns, expected, atol=1e-12)
    # lam = 0: one-step TD errors r_t + gamma V_{t+1} - V_t (V past the end counts as 0).
    advantages, _ = adv.gae(REWARDS, VALUES, MASK, gamma=0.5, lam=0.0)
    expected_td = [[1.0 + 0.5 - 0.5, 0.0 + 0.75 - 1.0, 2.0 - 1.5], [0.0 + 1.0 - 1.0, 3.0 - 2.0, 0.0]]
    np.testing.assert_allclose(advantages, expected_td, atol=1e-12)


# -- per-token rewards ----------------------------------------------------------------------------
def test_token_rewards_score_on_last_real_token_and_kl_everywhere():
    score = np.array([2.0, -1.0])
    log_probs = np.array([[-1.0, -2.0, -0.5], [-1.0, -1.0, -7.0]])
    ref_log_probs = np.array([[-1.5, -1.0, -0.5], [-2.0, -1.0, -3.0]])
    out = adv.token_rewards(score, log_probs, ref_log_probs, MASK, kl_coef=0.1)
    # -0.1 * (lp - ref): seq 0 -> [-0.05, 0.1, 0]; seq 1 -> [-0.1, 0, masked]
    # score on the last real token: seq 0 at t = 2, seq 1 at t = 1.
    np.testing.assert_allclose(out, [[-0.05, 0.1, 2.0], [-0.1, -1.0, 0.0]], atol=1e-12)


def test_token_rewards_without_kl_is_only_the_score():
    score = np.array([0.7, 0.3])
    lp = np.zeros((2, 3))
    out = adv.token_rewards(score, lp + 1.0, lp, MASK, kl_coef=0.0)
    np.testing.assert_allclose(out, [[0.0, 0.0, 0.7], [0.0, 0.3, 0.0]])


def test_last_token_index():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert adv.last_token_index(mask).tolist() == [2, 0, 3]


# -- whitening ------------------------------------------------------------------------------------
def test_whiten_mean_zero_var_one_over_real_tokens():
    values = np.array([[1.0, 2.0, 3.0, 1000.0], [4.0, 5.0, -1000.0, -1000.0]])
    mask = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    out = adv.whiten(values, mask)
    real = out[mask == 1]
    assert real.mean() == pytest.approx(0.0, abs=1e-9)
    assert real.var() == pytest.approx(1.0, rel=1e-6)
    assert np.all(out[mask == 0] == 0.0)
    # By hand: real values 1..5, mean 3, population variance 2.
    np.testing.assert_allclose(real, (np.array([1, 2, 3, 4, 5]) - 3) / np.sqrt(2), rtol=1e-6)


# -- GRPO -----------------------------------------------------------------------------------------
def test_group_advantages_normalise_within_each_group():
    score = np.array([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
    mask = np.ones((6, 2))
    mask[4, 1] = 0.0
    out = adv.group_advantages(score, mask, group_size=3)
    # Group 1: mean 2, population std sqrt(2/3) -> -1.2247, 0, 1.2247. Group 2: all equal -> 0.
    z = 1.0 / np.sqrt(2.0 / 3.0)
    np.testing.assert_allclose(out[:3], [[-z, -z], [0.0, 0.0], [z, z]], rtol=1e-5)
    np.testing.assert_allclose(out[3:], 0.0, atol=1e-9)
    assert out[4, 1] == 0.0


def test_group_advantages_groups_are_consecutive_and_independent():
    # Shifting one group's scores by a constant does not change any advantage.
    score = np.array([0.0, 1.0, 5.0, 9.0])
    mask = np.ones((4, 1))
    a = adv.group_advantages(score, mask, 2)
    b = adv.group_advantages(score + np.array([100.0, 100.0, 0.0, 0.0]), mask, 2)
    np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(a[:, 0], [-1.0, 1.0, -1.0, 1.0], atol=1e-5)


def test_group_advantages_refuse_uneven_groups():
    with pytest.raises(ValueError, match="groups of 2"):
        adv.group_advantages(np.arange(5.0), np.ones((5, 3)), group_size=2)


# -- ReMax ----------------------------------------------------------------------------------------
def test_baseline_advantages():
    out = adv.baseline_advantages(np.array([1.0, 0.5]), np.array([0.25, 2.0]), MASK)
    np.testing.assert_allclose(out, [[0.75, 0.75, 0.75], [-1.5, -1.5, 0.0]])


# -- Safe-RLHF ------------------------------------------------------------------------------------
def test_lagrange_step_direction_and_floor():
    # Cost above the limit: the multiplier grows by lr * excess.
    assert adv.lagrange_step(1.0, mean_cost=0.5, limit=0.1, lr=0.1) == pytest.approx(1.04)
    # Cost below the limit: it shrinks.
    assert adv.lagrange_step(1.0, mean_cost=-0.9, limit=0.1, lr=0.1) == pytest.approx(0.9)
    # ... but never below zero.
    assert adv.lagrange_step(0.05, mean_cost=-10.0, limit=0.0, lr=0.1) == 0.0
    assert adv.lagrange_step(0.0, mean_cost=-1.0, limit=0.0, lr=1.0) == 0.0
    # On the limit: unchanged.
    assert adv.lagrange_step(0.3, mean_cost=0.2, limit=0.2, lr=5.0) == pytest.approx(0.3)


def test_safe_advantages_formula():
    reward_adv = np.array([[2.0, -1.0]])
    cost_adv = np.array([[1.0, 3.0]])
    # (A_r - lambda A_c) / (1 + lambda), lambda = 3: [(2 - 3) / 4, (-1 - 9) / 4]
    np.testing.assert_allclose(adv.safe_advantages(reward_adv, cost_adv, 3.0), [[-0.25, -2.5]])
    np.testing.assert_allclose(adv.safe_advantages(reward_adv, cost_adv, 0.0), reward_adv)


# -- controller steps -----------------------------------------------------------------------------
def _arrays(sequences: int = 4, length: int = 5, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((sequences, length))
    for i in range(sequences):
        mask[i, 1 + i % length:] = 0.0  # lengths 1, 2, 3, ...
    mask[-1] = 1.0
    return {
        "response_mask": mask,
        "rewards": rng.normal(size=sequences),
        "baseline_rewards": rng.normal(size=sequences),
        "costs": rng.normal(size=sequences),
        "values": rng.normal(size=(sequences, length)),
        "cost_values": rng.normal(size=(sequences, length)),
        "old_log_probs": -rng.random(size=(sequences, length)),
        "ref_log_probs": -rng.random(size=(sequences, length)),
    }


def test_every_algorithm_step_is_registered():
    assert {"gae", "group_norm", "greedy_baseline", "safe_gae"} <= set(STEPS)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_controller_step_writes_exactly_its_declared_fields(name):
    step = STEPS[name]
    state = ControllerState(samples_per_prompt=2)
    arrays = _arrays()
    out = step.run(arrays, state)
    assert set(out) == set(step.writes)
    for field, value in out.items():
        assert value.shape == arrays["response_mask"].shape, field
        assert np.all(value[arrays["response_mask"] == 0] == 0.0), f"{name} leaks into masked {field}"


def test_gae_step_is_whitened_gae_of_kl_penalised_rewards():
    arrays = _arrays()
    state = ControllerState(cfg=Hyperparameters(gamma=0.95, lam=0.9, kl_coef=0.2))
    out = STEPS["gae"].run(arrays, state)
    mask = arrays["response_mask"]
    rewards = adv.token_rewards(arrays["rewards"], arrays["old_log_probs"], arrays["ref_log_probs"], mask, 0.2)
    raw, returns = adv.gae(rewards, arrays["values"], mask, 0.95, 0.9)
    np.testing.assert_allclose(out["returns"], returns)
    np.testing.assert_allclose(out["advantages"], adv.whiten(raw, mask))
    assert out["advantages"][mask == 1].mean() == pytest.approx(0.0, abs=1e-9)


def test_group_norm_step_uses_samples_per_prompt():
    arrays = _arrays(sequences=4)
    arrays["rewards"] = np.array([1.0, 3.0, 0.0, 0.0])
    out = STEPS["group_norm"].run(arrays, ControllerState(samples_per_prompt=2))
    mask = arrays["response_mask"]
    # Groups (1, 3) and (0, 0): -1, +1, 0, 0 on every real token.
    np.testing.assert_allclose(out["advantages"], np.array([[-1.0], [1.0], [0.0], [0.0]]) * mask, atol=1e-5)
    with pytest.raises(ValueError):
        STEPS["group_norm"].run(arrays, ControllerState(samples_per_prompt=3))


def test_greedy_baseline_step_by_hand():
    mask = np.array([[1.0, 1.0], [1.0, 0.0]])
    arrays = {
        "response_mask": mask,
        "rewards": np.array([1.0, 2.0]),
        "baseline_rewards": np.array([0.5, 2.5]),
        "old_log_probs": np.array([[-1.0, -1.0], [-1.0, -9.0]]),
        "ref_log_probs": np.array([[-2.0, -1.5], [-1.0, 0.0]]),
    }
    state = ControllerState(cfg=Hyperparameters(kl_coef=0.1))
    out = STEPS["greedy_baseline"].run(arrays, state)
    # KL sums: seq 0: 0.1 * (1 + 0.5) = 0.15; seq 1: 0 (its second token is masked).
    # advantages: 1 - 0.15 - 0.5 = 0.35 on both tokens; 2 - 0 - 2.5 = -0.5 on its one token.
    np.testing.assert_allclose(out["advantages"], [[0.35, 0.35], [-0.5, 0.0]], atol=1e-12)


def test_safe_gae_step_combines_and_updates_the_multiplier():
    arrays = _arrays(seed=3)
    cfg = Hyperparameters(gamma=1.0, lam=0.95, kl_coef=0.05, cost_limit=0.1, lagrange_lr=0.5, lagrange_init=2.0)
    state = ControllerState(cfg=cfg)
    out = STEPS["safe_gae"].run(arrays, state)
    mask = arrays["response_mask"]
    lp, ref = arrays["old_log_probs"], arrays["ref_log_probs"]
    # The KL penalty lowers the reward and raises the cost, on every real token; each score sits on
    # its sequence's last real token.
    last = mask.sum(axis=1).astype(int) - 1
    rows = np.arange(4)
    rewards = -0.05 * (lp - ref) * mask
    rewards[rows, last] += arrays["rewards"]
    costs = 0.05 * (lp - ref) * mask
    costs[rows, last] += arrays["costs"]
    r_adv, r_ret = adv.gae(rewards, arrays["values"], mask, 1.0, 0.95)
    c_adv, c_ret = adv.gae(costs, arrays["cost_values"], mask, 1.0, 0.95)
    expected = (adv.whiten(r_adv, mask) - 2.0 * adv.whiten(c_adv, mask)) / 3.0  # the multiplier before the step
    np.testing.assert_allclose(out["advantages"], expected)
    np.testing.assert_allclose(out["returns"], r_ret)
    np.testing.assert_allclose(out["cost_returns"], c_ret)
    assert state.lagrange == pytest.approx(2.0 + 0.5 * (arrays["costs"].mean() - 0.1))


def test_safe_gae_multiplier_persists_across_iterations():
    arrays = _arrays(seed=4)
    arrays["costs"] = np.full(4, 1.0)  # well above the limit of 0: the multiplier keeps growing
    state = ControllerState(cfg=Hyperparameters(lagrange_init=1.0, lagrange_lr=0.1, cost_limit=0.0))
    STEPS["safe_gae"].run(arrays, state)
    STEPS["safe_gae"].run(arrays, state)
    assert state.lagrange == pytest.approx(1.2)
