"""`hfplan execute` with tensor-parallel plans end to end (Ray, gloo workers, the tiny demo models)."""

from __future__ import annotations

import pytest

from hfplan.plan import ROLLOUT
from hfplan.spec import make_cluster
from tests.support.executor_runs import ARITH_GRPO, tiny_workload
from tests.support.plans import build_plan
from tests.test_execute import check_metrics, measured_calls, run, shared, traced_calls

pytestmark = pytest.mark.slow

PPO_ROLES = ("actor", "critic", "reference")


@pytest.fixture(autouse=True)
def on_the_session_cluster(ray_driver):
    """Every run of this module on the session's Ray cluster."""


def tp_plan(gpus: int, tp: int, recompute: str = "none"):
    """PPO with every role on one set: training, inference and generation all at `tp`."""
    return build_plan(tiny_workload("ppo"), [(PPO_ROLES, gpus)], cluster=make_cluster(gpus, "cpu"), tp=tp,
                      gen_tp=tp, micro_batch=1, infer_micro_batch=4, recompute=recompute)


def test_ppo_with_tensor_parallel_2_runs_as_one_process(tmp_path, shared_runs):
    """tp 2 splits every model over two processes; the run equals the same plan on one process: the same
    responses (both ranks of the group sample from one generator state), rewards, losses. The split plan
    trains with selective recomputation, which changes no number. Five iterations: the one-process run is
    test_execute's hybrid reference."""
    split = tp_plan(2, 2, recompute="selective")
    assert all(par.infer.tp == 2 for par in split.parallelism.values())
    assert split.parallelism["actor"].train.recompute == "selective"
    summary, timeline = run(split, tmp_path / "tp2", iterations=5)
    single, _ = shared(shared_runs, tp_plan(1, 1), iterations=5)
    check_metrics(summary, "reward", "kl", "actor/policy_loss", "critic/value_loss", "response_len")
    assert measured_calls(timeline) == traced_calls(split)
    for got, want in zip(summary.iterations, single.iterations, strict=True):
        assert got["response_len"] == want["response_len"]
        for key in ("reward", "kl", "actor/policy_loss", "critic/value_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_rollout_set_at_tensor_parallel_2_generates_what_one_process_generates(tmp_path, shared_runs):
    """The actor trains at tp 2; a separate rollout set generates at tp 2 from the slices of its shards the
    actor's ranks send it. Same run as one process."""
    workload = tiny_workload("grpo", ARITH_GRPO)
    single = build_plan(workload, [(("actor", "reference"), 1)], cluster=make_cluster(1, "cpu"), tp=1, gen_tp=1,
                        micro_batch=1, infer_micro_batch=4)
    split = build_plan(workload, [(("actor", "reference"), 2), ((ROLLOUT,), 2)], cluster=make_cluster(4, "cpu"),
                       tp=2, gen_tp=2, micro_batch=1, infer_micro_batch=4)
    assert split.parallelism[ROLLOUT].gen.tp == 2 and split.parallelism["actor"].train.tp == 2
    first, _ = shared(shared_runs, single, iterations=2)
    second, _ = run(split, tmp_path / "split", iterations=2)
    for got, want in zip(second.iterations, first.iterations, strict=True):
        assert got["response_len"] == want["response_len"]
        assert got["reward"] == pytest.approx(want["reward"], abs=1e-6)
        assert got["actor/policy_loss"] == pytest.approx(want["actor/policy_loss"], rel=1e-4, abs=1e-6)
