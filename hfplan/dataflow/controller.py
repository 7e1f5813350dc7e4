"""Steps the single controller runs itself between model calls (advantages, the Lagrange multiplier).

Each step is registered with the fields it reads and the fields it writes: a program hands it the
whole batch and gets back only what it writes, so the tracer knows the step's inputs and outputs
without running it, and every backend passes it exactly the fields it reads (numpy arrays).
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
    reuse_policy_log_probs: bool = False  # Workload.reuse_policy_log_probs
    staleness: int = 0  # Workload.staleness
    lagrange: float | None = None


@dataclass(frozen=True)
class ControllerStep:
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    run: Callable[[Arrays, ControllerState], Arrays]

    def __call__(self, fields: Arrays, state: ControllerState) -> Arrays:
        """Run on the fields it reads (taken from `fields`); returns exactly the fields it writes."""
        missing = [name for name in self.reads if name not in fields]
        if missing:
            raise KeyError(f"controller step {self.name!r} reads {', '.join(missing)}, which the batch lacks")
        out = self.run({name: fields[name] for name in self.reads}, state)
        if set(out) != set(self.writes):
            raise ValueError(f"controller step {self.name!r} wrote {sorted(out)}, not {list(self.writes)}")
        return out


STEPS: dict[str, ControllerStep] = {}


def controller_step(name: str, reads: tuple[str, ...], writes: tuple[str, ...]):
    def add(fn: Callable[[Arrays, ControllerState], Arrays]) -> Callable[[Arrays, ControllerState], Arrays]:
        if name in STEPS:
            raise ValueError(f"controller step {name!r} registered twice")
        STEPS[name] = ControllerStep(name, reads, writes, fn)
        return fn

    return add


_MASKED = ("old_log_probs", "ref_log_probs", "response_mask")


@controller_step("gae", reads=("rewards", "values", *_MASKED), writes=("advantages", "returns"))
def _gae(b: Arrays, state: ControllerState) -> Arrays:
    cfg, mask = state.cfg, b["response_mask"]
    rewards = adv.token_rewards(b["rewards"], b["old_log_probs"], b["ref_log_probs"], mask, cfg.kl_coef)
    advantages, returns = adv.gae(rewards, b["values"], mask, cfg.gamma, cfg.lam)
    return {"advantages": adv.whiten(advantages, mask), "returns": returns}


@controller_step("group_norm", reads=("rewards", "response_mask"), writes=("advantages",))
def _group_norm(b: Arrays, state: ControllerState) -> Arrays:
    return {"advantages": adv.group_advantages(b["rewards"], b["response_mask"], state.samples_per_prompt)}


@controller_step("greedy_baseline", reads=("rewards", "baseline_rewards", *_MASKED), writes=("advantages",))
def _greedy_baseline(b: Arrays, state: ControllerState) -> Arrays:
    mask = b["response_mask"]
    # The KL penalty is folded into the score as in PPO: a per-sequence sum over its tokens.
    kl = (state.cfg.kl_coef * (b["old_log_probs"] - b["ref_log_probs"]) * mask).sum(axis=1)
    score = b["rewards"] - kl
    return {"advantages": adv.baseline_advantages(score, b["baseline_rewards"], mask)}


@controller_step("safe_gae", reads=("rewards", "costs", "values", "cost_values", *_MASKED),
                 writes=("advantages", "returns", "cost_returns"))
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
