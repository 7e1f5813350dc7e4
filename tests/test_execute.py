"""`hfplan execute` end to end: Ray, gloo worker processes, tiny HF Llama models, every algorithm."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hfplan.executor.controller import METRICS_FILE, TIMELINE_FILE, WORKERS_FILE, ExecuteOptions, execute
from hfplan.plan import ROLLOUT
from hfplan.simulator.trace import trace
from tests.support.executor_runs import ARITH_GRPO, cpu_plan, tiny_workload

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def on_the_session_cluster(ray_driver):
    """Every run of this module on the session's Ray cluster."""


def run(plan, tmp_path, iterations=2, **options):
    tmp_path.mkdir(parents=True, exist_ok=True)  # the run folder's parent: execute makes only the run folder
    summary = execute(plan, ExecuteOptions(iterations=iterations, out=tmp_path / "run", call_timeout_s=120,
                                           start_timeout_s=120, **options))
    lines = (tmp_path / "run" / METRICS_FILE).read_text().splitlines()
    timeline = json.loads((tmp_path / "run" / TIMELINE_FILE).read_text())
    assert len(lines) == iterations == len(summary.iterations) == len(timeline["iterations"])
    workers = json.loads((tmp_path / "run" / WORKERS_FILE).read_text())
    assert len(workers["peak_memory_bytes"]) == sum(group.gpus for group in plan.placement)
    assert all(peak > 0 for peak in workers["peak_memory_bytes"].values())
    return summary, timeline


def measured_calls(timeline, iteration=0) -> set[str]:
    return {f"{s['role']}.{s['op']}" for s in timeline["iterations"][iteration]["spans"] if s["kind"] == "compute"}


def traced_calls(plan) -> set[str]:
    return {f"{n.role}.{n.op}" for n in trace(plan.workload).nodes}


def check_metrics(summary, *keys):
    for metrics in summary.iterations:
        for key in keys:
            assert key in metrics, (key, sorted(metrics))
            assert np.isfinite(metrics[key]), (key, metrics[key])


@pytest.mark.parametrize("shard", [True, False])
def test_ppo_colocated_on_two_ranks(tmp_path, shard):
    plan = cpu_plan(tiny_workload("ppo"), [(("actor", "critic", "reference"), 2)], shard=shard)
    summary, timeline = run(plan, tmp_path, iterations=1)
    check_metrics(summary, "reward", "kl", "actor/policy_loss", "critic/value_loss", "response_len", "tokens_per_s")
    assert measured_calls(timeline) == traced_calls(plan)
    assert {s["set"] for s in timeline["iterations"][0]["spans"]} == {0, -1}


def test_ppo_split_sets_overlap_their_preparation_calls(tmp_path):
    workload = tiny_workload("ppo", prompt_len=32, response_len=32, batch_prompts=16, mini_batches=1)
    plan = cpu_plan(workload, [(("actor",), 1), (("critic", "reference"), 1)])
    summary, timeline = run(plan, tmp_path)
    check_metrics(summary, "reward", "kl", "actor/policy_loss", "critic/value_loss")
    spans = [s for s in timeline["iterations"][1]["spans"] if s["kind"] == "compute"]
    actor = next(s for s in spans if (s["role"], s["op"]) == ("actor", "log_prob"))
    other = [s for s in spans if s["set"] == 1 and s["phase"] == "preparation"]
    assert any(s["start"] < actor["end"] and actor["start"] < s["end"] for s in other), (actor, other)


@pytest.mark.parametrize("sets", [[(("actor", "reference"), 2)], [(("actor",), 1), (("reference",), 1)]])
def test_grpo_on_two_processes(tmp_path, sets):
    plan = cpu_plan(tiny_workload("grpo", ARITH_GRPO), sets)
    summary, timeline = run(plan, tmp_path, iterations=1)
    check_metrics(summary, "reward", "kl", "actor/policy_loss")
    assert measured_calls(timeline) == traced_calls(plan)


def test_rollout_set_generates_with_the_synced_weights(tmp_path):
    """A separate rollout set, synced after every update, samples exactly what the hybrid engine samples."""
    workload = tiny_workload("grpo", ARITH_GRPO)
    hybrid = cpu_plan(workload, [(("actor", "reference"), 1)])
    separate = cpu_plan(workload, [(("actor", "reference"), 1), ((ROLLOUT,), 1)])
    first, _ = run(hybrid, tmp_path / "a")
    second, timeline = run(separate, tmp_path / "b")
    for a, b in zip(first.iterations, second.iterations, strict=True):
        assert a["response_len"] == b["response_len"]
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)
        assert a["actor/policy_loss"] == pytest.approx(b["actor/policy_loss"], rel=1e-5, abs=1e-7)
    syncs = [s for s in timeline["iterations"][1]["spans"] if s["role"] == ROLLOUT and s["kind"] == "transfer"]
    assert syncs, "no weight sync recorded"


def test_remax_one_iteration(tmp_path):
    models = {"actor": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"}
    plan = cpu_plan(tiny_workload("remax", models), [(("actor", "reference"), 2)])
    summary, timeline = run(plan, tmp_path, iterations=1)
    check_metrics(summary, "reward", "kl", "actor/policy_loss")
    assert measured_calls(timeline) == traced_calls(plan)


def test_safe_rlhf_one_iteration(tmp_path):
    models = {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction",
              "cost": "rule:distinct-chars", "cost_critic": "tiny"}
    plan = cpu_plan(tiny_workload("safe-rlhf", models), [(("actor", "reference"), 1), (("critic", "cost_critic"), 1)])
    summary, timeline = run(plan, tmp_path, iterations=1)
    check_metrics(summary, "reward", "cost", "lagrange", "actor/policy_loss", "critic/value_loss",
                  "cost_critic/value_loss")
    assert measured_calls(timeline) == traced_calls(plan)


def test_model_reward_scores_on_its_own_set(tmp_path):
    models = {"actor": "tiny", "reference": "tiny", "reward": "tiny"}
    plan = cpu_plan(tiny_workload("grpo", models), [(("actor", "reference"), 1), (("reward",), 1)])
    summary, timeline = run(plan, tmp_path, iterations=1)
    check_metrics(summary, "reward")
    assert any(s["role"] == "reward" and s["set"] == 1 for s in timeline["iterations"][0]["spans"])
