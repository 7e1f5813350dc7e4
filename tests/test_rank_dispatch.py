"""A call sent to every rank of a set: its ranks start one after another (Runtime.rank_dispatch_us), what the
executor records of it (Recorder.rank_start_spreads) and what the simulator charges for it."""

from __future__ import annotations

import pytest

from hfplan.plan import EDGE, colocated_plan
from hfplan.profiler.call_gaps import rank_dispatch
from hfplan.profiles.hardware import Runtime, load_hardware
from hfplan.simulator.engine import simulate_plan
from hfplan.spec import load_workload


def test_a_call_opening_a_task_pays_the_rank_dispatch_for_each_rank_past_the_first():
    runtime = Runtime(call_dispatch_us=700.0, rank_dispatch_us=300.0)
    assert runtime.call_dispatch_s() == pytest.approx(700e-6)  # a call after another in one task: no new spread
    assert runtime.task_dispatch_s() == pytest.approx(700e-6)  # no task opening measured: a call's dispatch
    assert runtime.task_dispatch_s(2) == pytest.approx(1000e-6)
    assert runtime.task_dispatch_s(4) == pytest.approx(1600e-6)
    opened = runtime.model_copy(update={"task_dispatch_us": 900.0})
    assert opened.task_dispatch_s(2) == pytest.approx(1200e-6)
    assert opened.task_opening_s(2) == pytest.approx(500e-6)  # on top of the call's own dispatch
    # The edge out of the controller pays its sending side less one rank's task dispatch: the ranks past the
    # first are in the call's own dispatch.
    opened = opened.model_copy(update={"controller_send_us": 1500.0})
    assert opened.send_wait_s() == pytest.approx(600e-6)


def _simulated(tmp_path, dp: int, rank_dispatch_us: float):
    base = load_hardware("cpu")
    # The controller's own CPU left out (it shares the host and would stretch the spans): the dispatch alone.
    hw = base.model_copy(update={"runtime": base.runtime.model_copy(update={"rank_dispatch_us": rank_dispatch_us,
                                                                            "controller_task_cpu_us": 0.0})})
    path = tmp_path / f"cpu-{rank_dispatch_us:g}.yaml"
    path.write_text(hw.to_yaml())
    return simulate_plan(colocated_plan(load_workload("demo"), 1, 1, dp, str(path)))


def test_every_call_opening_a_task_on_a_two_rank_set_waits_for_its_second_rank_and_one_rank_pays_nothing(tmp_path):
    """The demo on one set: the calls that open a Ray task (the generation, the log-prob after it, the first
    update after the advantages) have their dispatch grow by the rank dispatch, the calls after them in their
    task do not, and every call queues behind the one before on the set: the iteration grows by it three times."""
    extra = 1e-3
    before, after = _simulated(tmp_path, 2, 0.0), _simulated(tmp_path, 2, extra * 1e6)
    dispatches = [[s for s in sim.timeline.spans if s.kind == "dispatch" and s.set >= 0 and EDGE not in s.op]
                  for sim in (before, after)]  # a role call's own dispatch, not a field the controller sends
    assert len(dispatches[0]) == len(dispatches[1]) >= 5  # generate, log-probs, values, two updates
    grown = [(new.role, new.op) for old, new in zip(*dispatches, strict=True)
             if (new.end - new.start) - (old.end - old.start) == pytest.approx(extra)]
    assert grown == [("actor", "generate"), ("actor", "log_prob"), ("critic", "update")]
    assert all((new.end - new.start) == pytest.approx(old.end - old.start)
               for old, new in zip(*dispatches, strict=True) if (new.role, new.op) not in grown)
    assert after.timeline.iteration_s - before.timeline.iteration_s == pytest.approx(3 * extra)
    one_before, one_after = _simulated(tmp_path, 1, 0.0), _simulated(tmp_path, 1, extra * 1e6)
    assert one_after.timeline.iteration_s == pytest.approx(one_before.timeline.iteration_s)


def test_the_rank_dispatch_is_the_median_spread_of_tasks_sent_to_both_ranks():
    assert rank_dispatch([[0.002, 0.004], [0.003]]) == pytest.approx(0.003)
    with pytest.raises(ValueError, match="no task sent to both ranks"):
        rank_dispatch([[], []])


def test_the_recorder_takes_the_start_spread_of_a_task_opening_call_on_the_controllers_clock():
    pytest.importorskip("torch")
    pytest.importorskip("ray")
    from hfplan.executor.roles import Recorder
    from hfplan.executor.worker import Timed

    # Rank 1's clock runs 0.5 s ahead of the controller's: its stretch at 1.503 started at 1.003 here.
    recorder = Recorder(clock_offsets={(0, 0): 0.0, (0, 1): 0.5})
    recorder.start_iteration(origin=0.0)
    ranks = [{"spans": [Timed("log_prob", "transfer", 1.0, 1.1), Timed("log_prob", "compute", 1.1, 2.0)]},
             {"spans": [Timed("log_prob", "transfer", 1.503, 1.6), Timed("log_prob", "compute", 1.6, 2.6)]}]
    recorder.worker_spans("actor", "log_prob", 0, ranks, opens_task=True)
    assert recorder.rank_start_spreads == [pytest.approx(0.003)]
    recorder.worker_spans("actor", "log_prob", 0, ranks)  # a later call of the same task: no dispatch of its own
    recorder.worker_spans("actor", "log_prob", 0, ranks[:1], opens_task=True)  # one rank: no spread
    assert len(recorder.rank_start_spreads) == 1
    compute = [s for s in recorder.spans if s.kind == "compute"]
    assert compute[0].start == pytest.approx(1.1) and compute[0].end == pytest.approx(2.1)  # first start, last end
    recorder.start_iteration(origin=0.0)
    assert recorder.rank_start_spreads == []
