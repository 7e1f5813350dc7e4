"""`hfplan execute` with pipeline-parallel roles: a PPO run whose trained and inference roles run 2 stages."""

from __future__ import annotations

import pytest

from hfplan.executor import preflight
from hfplan.layout import unsupported_role
from hfplan.plan import ROLLOUT, WEIGHT_SYNC_OP, GenConfig, InferConfig, RoleParallelism, TrainConfig
from hfplan.spec import make_cluster
from tests.support.executor_runs import ARITH_GRPO, cpu_plan, tiny_workload
from tests.support.plans import build_plan
from tests.test_execute import check_metrics, measured_calls, run, shared, traced_calls

pytestmark = pytest.mark.slow
SETS = [(("actor", "critic", "reference"), 2)]


@pytest.fixture(autouse=True)
def on_the_session_cluster(ray_driver):
    """Every run of this module on the session's Ray cluster."""


def pipelined_plan(workload):
    """Every role of the set on 2 stages (micro-batch 1: 1F1B over the mini-batch's sequences); the actor
    generates in a one-stage layout of 2 replicas, which nests with its 2-stage training layout."""
    def stages(trained: bool, generates: bool) -> RoleParallelism:
        return RoleParallelism(train=TrainConfig(pp=2, micro_batch=1) if trained else None,
                               infer=InferConfig(pp=2, micro_batch=4),
                               gen=GenConfig(dp=2) if generates else None)

    overrides = {"actor": stages(True, True), "critic": stages(True, False), "reference": stages(False, False)}
    return build_plan(workload, SETS, cluster=make_cluster(2, "cpu"), overrides=overrides)


def test_pipelined_plan_passes_the_pre_flight_checks():
    plan = pipelined_plan(tiny_workload("ppo"))
    for role, par in plan.parallelism.items():
        assert unsupported_role(plan.workload, role, par) is None
    preflight.check_layouts(plan)


def test_ppo_with_two_pipeline_stages_matches_the_data_parallel_run(tmp_path):
    """The same first iteration as the dp 2 plan: the same generation replicas and seeds, and (one mini-batch,
    the whole batch on both) the same updates; then a second iteration that runs."""
    workload = tiny_workload("ppo", mini_batches=1)
    piped, timeline = run(pipelined_plan(workload), tmp_path / "pp")
    data_parallel, _ = run(cpu_plan(workload, SETS), tmp_path / "dp", iterations=1)
    check_metrics(piped, "reward", "kl", "actor/policy_loss", "critic/value_loss", "actor/grad_norm")
    assert measured_calls(timeline) == traced_calls(pipelined_plan(workload))
    first, expected = piped.iterations[0], data_parallel.iterations[0]
    for key in ("reward", "kl", "response_len", "actor/policy_loss", "actor/grad_norm", "critic/value_loss",
                "critic/grad_norm"):
        assert first[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key


def test_rollout_set_receives_the_weights_of_every_stage(tmp_path, shared_runs):
    """GRPO with a separate rollout set: after the pipelined actor's update the rollout set generates with the
    weights gathered from both stages, so the second iteration matches the one of the whole actor on one
    process, which generates in the one replica the rollout set is (test_execute's GRPO reference)."""
    workload = tiny_workload("grpo", ARITH_GRPO)
    sets = [(("actor", "reference"), 2), ((ROLLOUT,), 1)]
    piped = {role: RoleParallelism(train=TrainConfig(pp=2, micro_batch=1) if role == "actor" else None,
                                   infer=InferConfig(pp=2, micro_batch=4)) for role in ("actor", "reference")}
    plan = build_plan(workload, sets, cluster=make_cluster(3, "cpu"), overrides=piped, tp=1, gen_tp=1)
    first, timeline = run(plan, tmp_path / "pp")
    second, _ = shared(shared_runs, cpu_plan(workload, [(("actor", "reference"), 1)]))
    assert any(s["role"] == ROLLOUT and s["op"] == WEIGHT_SYNC_OP for s in timeline["iterations"][1]["spans"])
    for a, b in zip(first.iterations, second.iterations, strict=True):
        for key in ("response_len", "reward", "kl", "actor/policy_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
