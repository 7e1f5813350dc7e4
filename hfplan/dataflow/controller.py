"""Steps the single controller runs itself between model calls (advantages, the Lagrange multiplier).

Each step is registered with the fields it writes, so the tracer knows its outputs without running
it; the executor runs the function on numpy arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hfplan.dataflow import advantages as adv
from hfplan.hyperparams import Hyperparameters

Arrays = dict[str, np.ndarray]


@dataclass
class ControllerState:
    """What the controller carries from one iteration to the next."""

    cfg: Hyperparameters = field(default_factory=Hyperparameters)
    samples_per_prompt: int = 1
    lagrange: float | None = None


@dataclass(frozen=True)
class ControllerStep:
    name: str
    writes: tuple[str, ...]
    run: Callable[[Arrays, ControllerState], Arrays]


STEPS: dict[str, ControllerStep] = {}


def controller_step(name: str, writes: tuple[str, ...]):
    def add(fn: Callable[[Arrays, ControllerState], Arrays]) -> Callable[[Arrays, ControllerState], Arrays]:
        STEPS[name] = ControllerStep(name, writes, fn)
        return fn

    return add


@controller_step("gae", writes=("advantages", "returns"))
def _gae(b: Arrays, state: ControllerState) -> Arrays:
    cfg, mask = state.cfg, b["response_mask"]
    rewards = adv.token_rewards(b["rewards"], b["old_log_probs"], b["ref_log_probs"], mask, cfg.kl_coef)
    advantages, returns = adv.gae(rewards, b["values"], mask, cfg.gamma, cfg.lam)
    return {"advantages": adv.whiten(advantages, mask), "returns": returns}


@controller_step("group_norm", writes=("advantages",))
def _group_norm(b: Arrays, state: ControllerState) -> Arrays:
    return {"advantages": adv.group_advantages(b["rewards"], b["response_mask"], state.samples_per_prompt)}


@controller_step("greedy_baseline", writes=("advantages",))
def _greedy_baseline(b: Arrays, state: ControllerState) -> Arrays:
    mask = b["response_mask"]
    # The KL penalty is folded into the score as in PPO: a per-sequence sum over its tokens.
    kl = (state.cfg.kl_coef * (b["old_log_probs"] - b["ref_log_probs"]) * mask).sum(axis=1)
    score = b["rewards"] - kl
    return {"advantages": adv.baseline_advantages(score, b["baseline_rewards"], mask)}


@controller_step("safe_gae", writes=("advantages", "returns", "cost_returns"))
def _safe_gae(b: Arrays, state: ControllerState) -> Arrays:
    cfg, mask = state.cfg, b["response_mask"]
    if state.lagrange is None:
        state.lagrange = cfg.lagrange_init
    rewards = adv.token_rewards(b["rewards"], b["old_log_probs"], b["ref_log_probs"], mask, cfg.kl_coef)
    costs = adv.token_rewards(b["costs"], b["old_log_probs"], b["ref_log_probs"], mask, -cfg.kl_coef)
    reward_adv, returns = adv.gae(rewards, b["values"], mask, cfg.gamma, cfg.lam)
    cost_adv, cost_returns = adv.gae(costs, b["cost_values"], mask, cfg.gamma, cfg.lam)
    combined = adv.safe_advantages(adv.whiten(reward_adv, mask), adv.whiten(cost_adv, mask), state.lagrange)
    state.lagrange = adv.lagrange_step(state.lagrange, float(np.mean(b["costs"])), cfg.cost_limit,
                                       cfg.lagrange_lr)
    return {"advantages": combined, "returns": returns, "cost_returns": cost_returns}
