"""`hfplan execute` end to end: Ray, gloo worker processes, tiny HF Llama models, every algorithm."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hfplan.executor.controller import METRICS_FILE, TIMELINE_FILE, WORKERS_FILE, ExecuteOptions, execute
from hfplan.plan import ROLLOUT, WEIGHT_SYNC_OP
from hfplan.simulator.trace import trace
from tests.support.executor_runs import (
    ARITH_GRPO,
    PPO_TWO_RANKS_RUN,
    REWARD_MODEL_RUN,
    SAFE_RLHF_RUN,
    cpu_plan,
    reward_model_plan,
    safe_rlhf_plan,
    tiny_workload,
)

pytestmark = pytest.mark.slow

CLOCK_SLACK_S = 0.003  # bounds the error of the estimate of a worker's clock offset (half its quickest trip)


@pytest.fixture(autouse=True)
def on_the_session_cluster(ray_driver):
    """Every run of this module on the session's Ray cluster."""


def run(plan, tmp_path, iterations=2, **options):
    tmp_path.mkdir(parents=True, exist_ok=True)  # the run folder's parent: execute makes only the run folder
    summary = execute(plan, ExecuteOptions(iterations=iterations, out=tmp_path / "run", call_timeout_s=120,
                                           start_timeout_s=120, **options))
    return summary, read_run(plan, summary, iterations)


def shared(shared_runs, plan, iterations=2, **options):
    """`run`, of a run other tests read too (conftest's shared_runs): made once a session."""
    summary = shared_runs.get(plan, iterations=iterations, **options)
    return summary, read_run(plan, summary, iterations)


def read_run(plan, summary, iterations):
    """The run's timeline, once its folder is checked: a row and a timeline entry per iteration, each
    worker's peak memory."""
    lines = (summary.out / METRICS_FILE).read_text().splitlines()
    timeline = json.loads((summary.out / TIMELINE_FILE).read_text())
    assert len(lines) == iterations == len(summary.iterations) == len(timeline["iterations"])
    workers = json.loads((summary.out / WORKERS_FILE).read_text())
    assert len(workers["peak_memory_bytes"]) == sum(group.gpus for group in plan.placement)
    assert all(peak > 0 for peak in workers["peak_memory_bytes"].values())
    return timeline


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
def test_ppo_colocated_on_two_ranks(shared_runs, shard):
    """Sharded, the run test_resume resumes from."""
    plan = cpu_plan(tiny_workload("ppo"), [(("actor", "critic", "reference"), 2)], shard=shard)
    summary, timeline = shared(shared_runs, plan, **PPO_TWO_RANKS_RUN)
    check_metrics(summary, "reward", "kl", "actor/policy_loss", "critic/value_loss", "response_len", "tokens_per_s")
    assert measured_calls(timeline) == traced_calls(plan)
    assert {s["set"] for s in timeline["iterations"][0]["spans"]} == {0, -1}


def test_ppo_split_sets_overlap_their_preparation_calls(tmp_path):
    workload = tiny_workload("ppo", prompt_len=32, response_len=32, batch_prompts=16, mini_batches=1)
    plan = cpu_plan(workload, [(("actor",), 1), (("critic", "reference"), 1)])
    summary, timeline = run(plan, tmp_path, iterations=4)
    check_metrics(summary, "reward", "kl", "actor/policy_loss", "critic/value_loss")

    def overlaps(record: dict) -> bool:
        spans = [s for s in record["spans"] if s["kind"] == "compute"]
        actor = next(s for s in spans if (s["role"], s["op"]) == ("actor", "log_prob"))
        other = [s for s in spans if s["set"] == 1 and s["phase"] == "preparation"]
        return any(s["start"] < actor["end"] and actor["start"] < s["end"] for s in other)

    # Calls of one iteration sent to the two sets at once run at once; on a 2-core machine that other work keeps
    # busy, one process may still be descheduled through a whole call, so one iteration of three shows it.
    assert any(overlaps(record) for record in timeline["iterations"][1:]), timeline["iterations"][1:]


@pytest.mark.parametrize("sets", [[(("actor", "reference"), 2)], [(("actor",), 1), (("reference",), 1)]])
def test_grpo_on_two_processes(shared_runs, sets):
    """On two sets, the run whose start-up test_startup reads."""
    plan = cpu_plan(tiny_workload("grpo", ARITH_GRPO), sets)
    summary, timeline = shared(shared_runs, plan)
    check_metrics(summary, "reward", "kl", "actor/policy_loss")
    assert measured_calls(timeline) == traced_calls(plan)
    for record in timeline["iterations"] if len(sets) == 2 else ():
        # the reference's inputs come from the actor's generation on the other set, which its call waits for
        # (it is dispatched at once): that wait is not drawn as transfer
        spans = record["spans"]
        generated = next(s for s in spans if (s["role"], s["op"], s["kind"]) == ("actor", "generate", "compute"))
        fetched = next(s for s in spans if (s["role"], s["op"], s["kind"]) == ("reference", "log_prob", "transfer"))
        assert fetched["start"] >= generated["end"] - CLOCK_SLACK_S, (record["iteration"], fetched, generated)


def test_grpo_reusing_the_policy_log_probs_learns_what_computing_them_learns(tmp_path, shared_runs):
    """On-policy GRPO without the actor's log_prob call: the same metrics over two iterations (the second
    generated by the first update's weights), and the call neither runs nor is simulated."""
    sets = [(("actor", "reference"), 1)]
    computed, _ = shared(shared_runs, cpu_plan(tiny_workload("grpo", ARITH_GRPO), sets))
    plan = cpu_plan(tiny_workload("grpo", ARITH_GRPO, reuse_policy_log_probs=True), sets)
    reused, timeline = run(plan, tmp_path / "reused")
    assert measured_calls(timeline) == traced_calls(plan) == {"actor.generate", "reference.log_prob",
                                                              "reward.score", "controller.group_norm", "actor.update"}
    for a, b in zip(computed.iterations, reused.iterations, strict=True):
        for key in ("reward", "response_len", "actor/policy_loss", "actor/grad_norm", "actor/kl", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_rollout_set_generates_with_the_synced_weights(tmp_path, shared_runs):
    """PPO with a separate rollout set, synced after every update, over five iterations: the same metrics as
    the hybrid engine's run (each iteration generated by the previous update's weights)."""
    workload = tiny_workload("ppo")
    hybrid = cpu_plan(workload, [(("actor", "critic", "reference"), 1)])
    separate = cpu_plan(workload, [(("actor", "critic", "reference"), 1), ((ROLLOUT,), 1)])
    first, _ = shared(shared_runs, hybrid, iterations=5)
    second, timeline = run(separate, tmp_path / "b", iterations=5)
    assert len(first.iterations) == len(second.iterations) == 5
    for a, b in zip(first.iterations, second.iterations, strict=True):
        assert a["response_len"] == b["response_len"]
        for key in ("reward", "kl", "actor/policy_loss", "critic/value_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    for record in timeline["iterations"]:
        syncs = [s for s in record["spans"] if s["role"] == ROLLOUT and s["op"] == WEIGHT_SYNC_OP]
        assert [(s["kind"], s["phase"]) for s in syncs] == [("transition", "generation")], record["iteration"]
        # The rollout set's generation, sent while the sync still ran, runs after the weights are loaded (the
        # workers' clocks agree with the controller's to about a millisecond).
        generate = next(s for s in record["spans"] if (s["op"], s["kind"]) == ("generate", "compute"))
        assert syncs[0]["end"] <= generate["start"] + 0.002, record["iteration"]


def test_remax_one_iteration(tmp_path):
    models = {"actor": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"}
    plan = cpu_plan(tiny_workload("remax", models), [(("actor", "reference"), 2)])
    summary, timeline = run(plan, tmp_path, iterations=1)
    check_metrics(summary, "reward", "kl", "actor/policy_loss")
    assert measured_calls(timeline) == traced_calls(plan)
    # The sampled and the greedy generation run in one generation layout: one switch in, one back (recorded at
    # the next call, in generation's phase), as the simulator prices it.
    spans = sorted(timeline["iterations"][0]["spans"], key=lambda s: s["start"])
    switches = [(s["op"], s["phase"]) for s in spans if s["kind"] == "transition"]
    assert switches == [("reshard", "generation"), ("reshard back", "generation")]
    generates = [s for s in spans if s["op"] == "generate" and s["kind"] == "compute"]
    back = next(s for s in spans if s["op"] == "reshard back")
    assert len(generates) == 2 and back["start"] >= generates[1]["end"]


def test_the_next_generation_sent_ahead_changes_nothing_but_the_wait(tmp_path):
    """Each iteration's first generation is sent while the last iteration's update runs (none before the last
    iteration's checkpoint): the same run, metric for metric, as the single-process backend's, which sends
    nothing ahead; each iteration's time starts where the last one's ended."""
    from hfplan.executor.local import run_local, single_process_world

    models = {"actor": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"}
    plan = cpu_plan(tiny_workload("remax", models), [(("actor", "reference"), 1)])
    summary, _ = run(plan, tmp_path, iterations=3)  # sent after iterations 0 and 1
    with single_process_world():
        alone = run_local(plan, ExecuteOptions(iterations=3)).iterations
    assert any(it["actor/grad_norm"] > 0 for it in alone)  # the weights move between the generations
    for got, want in zip(summary.iterations, alone, strict=True):
        for key in ("reward", "response_len", "actor/policy_loss", "actor/grad_norm", "kl"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_a_generation_is_sent_ahead_only_where_no_checkpoint_or_evaluation_comes_between():
    from hfplan.executor.controller import sends_ahead_after

    options = ExecuteOptions(iterations=6, checkpoint_every=2, eval_every=3)
    assert [done for done in range(1, 7) if sends_ahead_after(done, options, evaluates=False)] == [1, 3, 5]
    assert [done for done in range(1, 7) if sends_ahead_after(done, options, evaluates=True)] == [1, 5]


def test_safe_rlhf_runs(shared_runs):
    """The run test_resume resumes from its first checkpoint."""
    plan = safe_rlhf_plan()
    summary, timeline = shared(shared_runs, plan, **SAFE_RLHF_RUN)
    check_metrics(summary, "reward", "cost", "lagrange", "actor/policy_loss", "critic/value_loss",
                  "cost_critic/value_loss")
    assert measured_calls(timeline) == traced_calls(plan)


def test_model_reward_scores_on_its_own_set(shared_runs):
    """The run whose samples test_cli_execute_loggers reads (csv its only logger: no metrics.jsonl here)."""
    summary = shared_runs.get(reward_model_plan(), **REWARD_MODEL_RUN)
    timeline = json.loads((summary.out / TIMELINE_FILE).read_text())
    check_metrics(summary, "reward")
    assert any(s["role"] == "reward" and s["set"] == 1 for s in timeline["iterations"][0]["spans"])
