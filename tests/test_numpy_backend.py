"""Every registered algorithm, end to end on the single-process numpy backend (tests/support/numpy_backend.py):
the real controller steps on fake model outputs, each call checking the fields and shapes it receives,
the calls matching the tracer's one by one, and futures dispatched before they are awaited."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hfplan.dataflow.controller import STEPS, ControllerStep
from hfplan.dataflow.registry import algorithms, get_algorithm
from hfplan.dataflow.roles import update_field
from hfplan.simulator.trace import trace
from hfplan.spec import Workload, workload_from_dict
from tests.support.numpy_backend import Backend


def tiny_workload(algorithm: str, rules: bool = True) -> Workload:
    spec = get_algorithm(algorithm)
    models = {r: "rule:vowel-fraction" if f.may_be_rule and rules else "tiny" for r, f in spec.roles.items()}
    return workload_from_dict({"algorithm": algorithm, "models": models, "prompt_len": 4, "response_len": 6,
                               "batch_prompts": 4, "samples_per_prompt": spec.min_samples_per_prompt,
                               "mini_batches": 2}, "test")


@pytest.mark.parametrize("rules", [True, False], ids=["rule-rewards", "model-rewards"])
@pytest.mark.parametrize("pooled", [False, True], ids=["inline", "futures"])
@pytest.mark.parametrize("algorithm", sorted(algorithms()))
def test_every_algorithm_runs_end_to_end_like_its_trace(algorithm, pooled, rules):
    workload = tiny_workload(algorithm, rules)
    with ThreadPoolExecutor(max_workers=8) as pool:
        backend = Backend(workload, pool if pooled else None)
        metrics = backend.run()
    dag = trace(workload)
    assert [(c.label, set(c.reads), c.sequences) for c in backend.calls] == [
        (n.label, set(n.reads), n.sequences) for n in dag.nodes]
    trained = [r for r, f in get_algorithm(algorithm).roles.items() if f.trains]
    assert set(metrics) == {update_field(r) for r in trained}
    for value in metrics.values():
        assert value == {"steps": workload.mini_batches * workload.epochs, "sequences": workload.sequences}


def test_rule_rewards_reach_the_controller_step_computed_on_decoded_text(monkeypatch):
    workload = tiny_workload("grpo")
    original, seen = STEPS["group_norm"], {}

    def spy(fields, state):
        seen.update(fields)
        return original(fields, state)

    monkeypatch.setitem(STEPS, "group_norm", ControllerStep("group_norm", original.reads, original.writes, spy))
    Backend(workload).run()
    assert set(seen) == set(original.reads)
    rewards = seen["rewards"]
    assert rewards.shape == (workload.sequences,)
    assert np.all((rewards >= 0) & (rewards <= 1)) and rewards.std() > 0  # vowel fractions of random text


def test_preparation_calls_and_updates_are_dispatched_before_any_is_awaited():
    """PPO with a model reward: its four preparation calls can only finish if all four run at once (a
    barrier of four inside them), and likewise its two updates; a program that awaited one call before
    dispatching the next would time out at the barrier."""
    workload = tiny_workload("ppo", rules=False)
    prep = threading.Barrier(4, timeout=10)
    updates = threading.Barrier(2, timeout=10)
    with ThreadPoolExecutor(max_workers=8) as pool:
        backend = Backend(workload, pool)
        for label in ("actor.log_prob", "reference.log_prob", "critic.values", "reward.score"):
            backend.hooks[label] = prep.wait
        for label in ("critic.update", "actor.update"):
            backend.hooks[label] = updates.wait
        metrics = backend.run()
    assert set(metrics) == {"critic_metrics", "actor_metrics"}
    assert not prep.broken and not updates.broken
