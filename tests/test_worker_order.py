"""A worker runs the controller's tasks in the order it sent them, one at a time, while Ray takes in the next ones
(executor.ordering): on a real Ray actor made as placement.py makes one, with run_call standing in for the roles."""

from __future__ import annotations

import inspect
import time

import pytest

from hfplan.executor import ordering, wire
from hfplan.executor.roles import send_calls
from hfplan.executor.worker import SetWorker, WorkerSpec
from hfplan.hyperparams import Hyperparameters
from tests.support.plans import sample_plan

TIMEOUT_S = 60
AHEAD = 8  # tasks sent at once, before the actor is up: Ray may hand them over in any order


def test_every_worker_method_is_ordered_or_not_on_purpose():
    methods = {name for name, _ in inspect.getmembers(SetWorker, inspect.isfunction) if not name.startswith("_")}
    assert methods == ordering.ORDERED | ordering.UNORDERED
    assert not ordering.ORDERED & ordering.UNORDERED


@pytest.fixture
def worker(ray_driver):
    import ray

    from hfplan.executor.worker import InOrderWorker

    class Recording(InOrderWorker):  # defined here: Ray ships it by value
        """Role calls that sleep options["sleep"] seconds and raise when their op is "fail"; every call and way back
        from generation recorded as (what, call id, start, end)."""

        def __init__(self, spec: WorkerSpec) -> None:
            super().__init__(spec)
            self.events: list[tuple] = []

        def run_call(self, role, op, fields, options, call_id, keep_from):
            start = time.time()
            time.sleep(options.get("sleep", 0.0))
            self.events.append(("call", call_id, start, time.time()))
            if op == "fail":
                raise ValueError("bad call")
            return {"fields": {}, "spans": []}

        def _leave_generation(self, role=None, op=None, spans=None):
            now = time.time()
            self.events.append(("leave", None, now, now))

        def recorded(self) -> list[tuple]:  # unordered: read once every task has answered
            return self.events

    spec = WorkerSpec(sample_plan().model_dump_json(), Hyperparameters().model_dump_json(), 0, 0, 1, 0, "cpu", "gloo",
                      TIMEOUT_S)
    handle = ray.remote(Recording).options(num_cpus=0).remote(spec)  # as placement.start_sets makes a worker
    try:
        yield handle
    finally:
        ray.kill(handle)


def _call(call_id: int, op: str = "log_prob", sleep: float = 0.0) -> tuple:
    return ("actor", op, {}, {"sleep": sleep}, call_id, 0)


def _results(refs) -> list:
    import ray

    return [wire.unpack_packed(packed) for packed in ray.get(refs, timeout=TIMEOUT_S)]


def test_tasks_sent_ahead_run_in_the_order_sent_one_at_a_time(worker):
    import ray

    first = send_calls(worker, [_call(0, sleep=0.4)])
    clock = worker.clock.remote()  # unordered: answered while the first call runs
    rest = [send_calls(worker, [_call(call_id)]) for call_id in range(1, AHEAD)]
    answered = ray.get(clock, timeout=TIMEOUT_S)
    assert all(isinstance(result, dict) for result in _results([first, *rest]))
    events = ray.get(worker.recorded.remote(), timeout=TIMEOUT_S)
    assert [call_id for _, call_id, _, _ in events] == list(range(AHEAD))
    assert all(later[2] >= earlier[3] for earlier, later in zip(events, events[1:], strict=False))  # one at a time
    assert answered < events[0][3]


def test_tasks_that_come_in_out_of_order_run_in_number_order(worker):
    import ray

    def numbered_task(seq: int):  # as send_calls sends it, with the number given here
        return worker.calls.options(num_returns=1).remote(
            *wire.arguments(wire.pack(ordering.NumberedCalls(seq, [_call(seq, sleep=0.05)]))))

    refs = [numbered_task(seq) for seq in reversed(range(AHEAD))]
    ray.get(worker.clock.remote(), timeout=TIMEOUT_S)
    assert all(isinstance(result, dict) for result in _results(refs))
    events = ray.get(worker.recorded.remote(), timeout=TIMEOUT_S)
    assert [call_id for _, call_id, _, _ in events] == list(range(AHEAD))


def test_a_failed_call_stops_its_task_and_the_next_task_runs(worker):
    import ray

    failing = send_calls(worker, [_call(0, op="fail", sleep=0.2), _call(1)])
    after = send_calls(worker, [_call(2)])
    broken = ordering.send(worker, "load_shards", "no-such-role", [])  # an ordered method that raises
    last = send_calls(worker, [_call(3)])
    failed, not_run, ran, ran_last = _results([*failing, after, last])
    assert failed == wire.CallFailed("ValueError: bad call")
    assert not_run == wire.CallFailed("not run: actor.fail, sent with it, failed first")
    assert isinstance(ran, dict) and isinstance(ran_last, dict)
    with pytest.raises(ray.exceptions.RayTaskError, match="no-such-role"):
        ray.get(broken, timeout=TIMEOUT_S)
    assert [call_id for _, call_id, _, _ in ray.get(worker.recorded.remote(), timeout=TIMEOUT_S)] == [0, 2, 3]


def test_a_method_sent_between_calls_runs_between_them(worker):
    import ray

    before = send_calls(worker, [_call(0, sleep=0.3)])
    leave = ordering.send(worker, "leave_generation")
    after = send_calls(worker, [_call(1)])
    _results([before, after])
    assert ray.get(leave, timeout=TIMEOUT_S) == []
    events = ray.get(worker.recorded.remote(), timeout=TIMEOUT_S)
    assert [(what, call_id) for what, call_id, _, _ in events] == [("call", 0), ("leave", None), ("call", 1)]
    assert events[0][3] <= events[1][2] <= events[2][2]
