"""The executor's call gaps as the profiler reads them off a run: queued gaps, the gap around the controller's
advantage step and the step itself, on hand-made timelines and on a real probe run."""

from __future__ import annotations

import pytest

from hfplan.plan import WEIGHT_SYNC_OP, Span
from hfplan.profiler.call_gaps import (
    CallGaps,
    call_gaps,
    controller_task_cpu,
    gaps_of,
    opening_calls,
    probe_plan,
    probe_workload,
    rollout_probe_plan,
    spread_probe_plan,
    tasks_per_iteration,
    weight_sync,
)
from hfplan.profiles.hardware import load_hardware


def _span(role, op, kind, start, end, set_=0, phase="preparation"):
    return Span(role=role, op=op, phase=phase, set=set_, start=start / 1e3, end=end / 1e3, kind=kind)


def _ppo_iteration(offset=0.0):
    """generate (its input transfer, a switch, the compute), the next task (the switch back, three forwards), the
    controller's reward (during a forward) and advantage step, and two updates: times in ms."""
    o = offset
    return [_span("actor", "generate", "transfer", o + 0.0, o + 0.1, phase="generation"),
            _span("actor", "reshard", "transition", o + 0.2, o + 1.0, phase="generation"),
            _span("actor", "generate", "compute", o + 1.0, o + 9.0, phase="generation"),
            # The next task: its way back first (1.4 after the generation), then the log-prob.
            _span("actor", "reshard back", "transition", o + 10.4, o + 10.5, phase="generation"),
            _span("actor", "log_prob", "transfer", o + 10.5, o + 10.6),
            _span("actor", "log_prob", "compute", o + 10.6, o + 14.0),
            _span("reward", "score", "compute", o + 11.0, o + 11.5, set_=-1),  # during a call, in no gap
            _span("reference", "log_prob", "transfer", o + 14.8, o + 14.9),  # queued: 0.8
            _span("reference", "log_prob", "compute", o + 14.9, o + 18.0),
            _span("critic", "values", "transfer", o + 18.6, o + 18.7),  # queued: 0.6
            _span("critic", "values", "compute", o + 18.7, o + 22.0),
            _span("controller", "gae", "compute", o + 23.5, o + 23.8, set_=-1),  # 1.5 before, 1.7 after
            _span("critic", "update", "transfer", o + 25.5, o + 25.6, phase="training"),
            _span("critic", "update", "compute", o + 25.6, o + 40.0, phase="training"),
            _span("actor", "update", "transfer", o + 41.2, o + 41.3, phase="training"),  # queued: 1.2
            _span("actor", "update", "compute", o + 41.3, o + 55.0, phase="training")]


OPENERS = frozenset({("actor", "generate"), ("actor", "log_prob"), ("critic", "update")})  # PPO on one set


def test_gaps_are_read_between_calls_and_around_the_advantage_step():
    queued, opened, around, sends, steps = gaps_of(_ppo_iteration(), OPENERS)
    assert queued == pytest.approx([0.8e-3, 0.6e-3, 1.2e-3])  # the gap through gae is not queued
    assert opened == pytest.approx([1.4e-3])  # the generation's end to its next task's way back
    assert around == pytest.approx([1.5e-3 + 1.7e-3])
    assert sends == pytest.approx([1.7e-3])
    assert steps == pytest.approx([0.3e-3])


def test_the_figures_are_medians_over_the_iterations():
    slower = [s.model_copy(update={"end": s.end + (0.4e-3 if s.op == "gae" else 0.0)}) for s in _ppo_iteration()]
    gaps = call_gaps([_ppo_iteration(), _ppo_iteration(100.0), slower], OPENERS)
    assert gaps.call_dispatch_s == pytest.approx(0.8e-3)  # the median of 9 queued gaps: 3 kinds, 3 each
    assert gaps.task_dispatch_s == pytest.approx(1.4e-3)
    assert call_gaps([_ppo_iteration()]).task_dispatch_s is None  # no call named as opening a task
    # gae 0.4 ms longer and the next call as late as before: 0.4 ms less of gap after it.
    assert gaps.controller_call_s == pytest.approx(3.2e-3)
    assert gaps.controller_send_s == pytest.approx(1.7e-3)  # 1.7, 1.7 and 1.3 ms
    assert gaps.controller_step_s == pytest.approx(0.3e-3)


def test_the_controller_s_cpu_per_task_is_its_cpu_an_iteration_less_its_own_steps_over_the_tasks_it_sends():
    # 12 ms of CPU an iteration over two iterations; its reward and advantage step take 0.8 ms of spans (0.5 + 0.3).
    iterations = [_ppo_iteration(), _ppo_iteration(100.0)]
    assert controller_task_cpu([1.0, 1.012, 1.024], iterations, 3) == pytest.approx((12e-3 - 0.8e-3) / 3)
    with pytest.raises(ValueError, match="two measured iterations"):
        controller_task_cpu([1.0], iterations, 3)


def test_a_timeline_without_an_advantage_step_between_calls_is_refused():
    no_gae = [s for s in _ppo_iteration() if s.op != "gae"]
    with pytest.raises(ValueError, match="advantage step"):
        call_gaps([no_gae])


def test_the_probe_is_ppo_with_an_advantage_step_on_one_device_and_then_on_two(tmp_path):
    workload = probe_workload()
    assert workload.algorithm == "ppo" and workload.response_len == 8
    plan = probe_plan(load_hardware("cpu"), tmp_path)
    assert opening_calls(plan) == OPENERS and tasks_per_iteration(plan) == 3
    assert plan.cluster.gpus == 1 and len(plan.placement) == 1
    assert set(plan.placement[0].models) >= {"actor", "critic"}
    two = spread_probe_plan(load_hardware("cpu"), tmp_path)
    assert [s.gpus for s in two.placement] == [2] and set(two.placement[0].models) == set(workload.model_roles)
    assert all(layout.dp == 2 for p in two.parallelism.values() for layout in (p.train, p.infer, p.gen) if layout)


def test_the_rollout_probe_generates_on_a_set_of_its_own_and_its_weight_syncs_are_read_as_a_median(tmp_path):
    plan = rollout_probe_plan(load_hardware("cpu"), tmp_path)
    assert [s.gpus for s in plan.placement] == [1, 1] and tuple(plan.placement[1].models) == ("rollout",)
    syncs = [[_span("rollout", WEIGHT_SYNC_OP, "transition", 0.0, ms, set_=1, phase="generation"),
              _span("actor", "generate", "compute", ms, ms + 5.0, set_=1, phase="generation")] for ms in (4, 9, 5)]
    assert weight_sync(syncs) == pytest.approx(5e-3)
    with pytest.raises(ValueError, match="no weight sync"):
        weight_sync([_ppo_iteration()])


def test_the_profile_s_weight_sync_prices_the_probe_s_measured_sync_back(tmp_path):
    """weight_sync_us is the measured sync less the rest the simulator prices of it (engines per tensor, bytes):
    the probe plan simulated on the fitted profile then takes the measured sync again."""
    from hfplan.dataflow.registry import ROLLOUT
    from hfplan.profiler.runtime import _weight_sync_fixed
    from hfplan.simulator.mapping import PlanCosts

    fitted = load_hardware("cpu")
    plan = rollout_probe_plan(fitted, tmp_path)
    measured = 0.02
    gaps = CallGaps(1e-4, 3e-3, 2e-4, 1.5e-3, weight_sync_s=measured, weight_sync_plan=plan)
    sync_us, row = _weight_sync_fixed(fitted, gaps)
    assert 0 < sync_us < measured * 1e6 and row["seconds"] == measured
    priced = fitted.model_copy(update={"runtime": fitted.runtime.model_copy(update={"weight_sync_us": sync_us})})
    costed = PlanCosts.of_plan(plan, priced)
    assert costed.switch_seconds(ROLLOUT) == pytest.approx(measured)


@pytest.mark.slow
def test_a_probe_run_of_the_executor_gives_positive_gaps(ray_driver, tmp_path):
    """The probe executed for real (in the test session's Ray), on one rank and on two: every figure measured and
    positive (the two ranks of a task cannot start at one instant), the round trip through the controller longer
    than a queued call's gap (it holds one and more), and the worker's own resident memory."""
    pytest.importorskip("torch")
    from hfplan.profiler.call_gaps import measure_call_gaps

    gaps = measure_call_gaps(load_hardware("cpu"), ranks=2)
    assert gaps.call_dispatch_s > 0 and gaps.controller_step_s > 0
    assert gaps.rank_dispatch_s is not None and 0 < gaps.rank_dispatch_s < 0.1
    assert gaps.controller_call_s > gaps.call_dispatch_s
    assert gaps.task_dispatch_s is not None and gaps.task_dispatch_s > 0
    assert gaps.controller_task_cpu_s is not None and 0 < gaps.controller_task_cpu_s < 0.1
    # The rollout probe's weight sync, through Ray's object store and the controller: a round trip at least.
    assert gaps.weight_sync_s is not None and gaps.controller_call_s < gaps.weight_sync_s < 1.0
    assert tuple(gaps.weight_sync_plan.placement[1].models) == ("rollout",)
    # On CPU, the worker's own memory beyond the probe plan's simulated peak: the interpreter and torch at least.
    assert gaps.worker_resident_gib is not None and 0.1 < gaps.worker_resident_gib < 4
