"""A call after its process idled runs longer (Compute.idle_wake): the profile's points, their fit from the probe's
rows, the engine's steady-state charge on hand-computed schedules, and the search still exact with it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hfplan.profiler.idle_wake import AFTER_IDLE, BACK_TO_BACK, fit_idle_wake
from hfplan.profiles.hardware import load_hardware
from hfplan.simulator.engine import Scheduled, run_calls, simulate_plan
from hfplan.simulator.trace import Edge, Node

POINTS = ((10.0, 1000.0), (30.0, 2000.0))


def _compute(points):
    cpu = load_hardware("cpu")
    return cpu.compute.model_copy(update={"idle_wake": points})


@pytest.mark.parametrize(("idle_s", "extra_us"), [
    (0.0, 0.0), (0.005, 500.0), (0.010, 1000.0), (0.020, 1500.0), (0.030, 2000.0), (1.0, 2000.0)])
def test_the_extra_is_interpolated_from_none_at_no_idle_and_held_beyond_the_last_point(idle_s, extra_us):
    assert _compute(POINTS).wake_seconds(idle_s) == pytest.approx(extra_us * 1e-6)


def test_without_points_a_wait_costs_nothing():
    assert _compute(None).wake_seconds(1.0) == 0.0


@pytest.mark.parametrize("points", [(), ((10.0, 1.0), (10.0, 2.0)), ((30.0, 1.0), (10.0, 2.0)), ((0.0, 1.0),),
                                    ((10.0, -1.0),)])
def test_points_must_rise_in_idle_time_and_cost_nothing_negative(points):
    cpu = load_hardware("cpu")
    with pytest.raises(ValidationError):
        type(cpu.compute).model_validate({**cpu.compute.model_dump(), "idle_wake": points})


def test_the_fit_is_each_wait_s_call_over_the_call_back_to_back_and_never_negative():
    rows = [dict(kind="wake", op=BACK_TO_BACK, idle_ms=0.0, seconds=0.010),
            dict(kind="wake", op=AFTER_IDLE, idle_ms=30.0, seconds=0.012),
            dict(kind="wake", op=AFTER_IDLE, idle_ms=3.0, seconds=0.0099),
            dict(kind="sharing", op="probe_alone", seconds=1.0)]
    assert fit_idle_wake(rows) == ((3.0, 0.0), (30.0, 2000.0))
    assert fit_idle_wake([r for r in rows if r["op"] != BACK_TO_BACK]) is None


def _node(i, role, op, phase, deps=()):
    return Node(i, role, op, phase, 8, tuple(Edge(d, 1.0, ("x",)) for d in deps), ("x",))


def _free(src: int, dst: int, nbytes: float) -> float:
    return 0.0


def test_a_set_pays_its_idle_wait_before_each_call_in_the_steady_state():
    """The actor generates (set 0, 1 s), the reference reads it (set 1, 1 s), the actor updates after it (1 s), with
    a wait costing a tenth of its length. The reference's first call of the iteration follows its call of the last
    iteration: by hand, a first pass gives 0 | 1 + 0.1 (its wait from the start) | 1.1 + 0.11, iteration 3.21, so
    the reference idles 1.11 s after its call; the second pass: generation 0-1, the reference 1-2.211 (it waited
    1 + 1.11 s), the update 2.211-3.3321 (the actor waited 1.211 s)."""
    gen = _node(0, "actor", "generate", "generation")
    ref = _node(1, "reference", "log_prob", "preparation", (0,))
    up = _node(2, "actor", "update", "training", (1,))
    calls = [Scheduled(gen, 0, 1.0, 0.0, None), Scheduled(ref, 1, 1.0, 0.0, None), Scheduled(up, 0, 1.0, 0.0, None)]
    timeline = run_calls(calls, _free, 8, wake=lambda idle: 0.1 * idle)
    spans = {(s.role, s.op): (s.start, s.end) for s in timeline.spans}
    assert spans[("actor", "generate")] == pytest.approx((0.0, 1.0))
    assert spans[("reference", "log_prob")] == pytest.approx((1.0, 2.211))
    assert spans[("actor", "update")] == pytest.approx((2.211, 3.3321))
    assert timeline.iteration_s == pytest.approx(3.3321)
    assert sum(timeline.stages().values()) == pytest.approx(timeline.iteration_s)
    assert run_calls(calls, _free, 8).iteration_s == pytest.approx(3.0)


def test_calls_back_to_back_on_one_set_pay_nothing():
    gen = _node(0, "actor", "generate", "generation")
    lp = _node(1, "actor", "log_prob", "preparation", (0,))
    up = _node(2, "actor", "update", "training", (1,))
    calls = [Scheduled(node, 0, 1.0, 0.0, None) for node in (gen, lp, up)]
    assert run_calls(calls, _free, 8, wake=lambda idle: 0.1 * idle).iteration_s == pytest.approx(3.0)


def test_the_search_stays_exact_where_waits_cost_and_a_split_plan_pays_them(tmp_path):
    """arith-grpo's actor and reference on a process each of a CPU host whose waits cost: the reference idles while
    the actor generates and trains, so the plan runs longer than on the same profile without the cost, and the
    search (whose fast schedule is then only a bound) reports the engine's time."""
    from hfplan.planner.search import search
    from hfplan.planner.strategies import Rules
    from hfplan.spec import load_workload, make_cluster

    cpu = load_hardware("cpu")
    paths = {}
    for name, points in (("waits", ((10.0, 2000.0), (50.0, 5000.0))), ("no-waits", None)):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(cpu.model_copy(update={"name": name, "compute": cpu.compute.model_copy(
            update={"idle_wake": points})}).to_yaml())
    workload = load_workload("arith-grpo")
    rules = Rules(name="split", placements=((("actor",), ("reference",)),))
    best = search(workload, make_cluster(2, str(paths["waits"])), rules=rules).best
    assert best.estimate.iteration_s == pytest.approx(simulate_plan(best).estimate.iteration_s, rel=1e-12)
    without = best.model_copy(update={"cluster": best.cluster.model_copy(update={"hardware": str(paths["no-waits"])})})
    assert simulate_plan(best).estimate.iteration_s > simulate_plan(without).estimate.iteration_s + 2e-3
