"""How role calls reach the workers, without Ray: the wire format (executor.wire), the Dispatch that sends the calls
held for a set as one task per worker, and a failed call named as itself (tests/test_execute.py runs the whole
path)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("ray")

from hfplan.dataflow.batch import Batch  # noqa: E402
from hfplan.dataflow.ops import ROLE_OPS  # noqa: E402
from hfplan.dataflow.roles import RoleFacts  # noqa: E402
from hfplan.executor import wire  # noqa: E402
from hfplan.executor.errors import RunFailed  # noqa: E402
from hfplan.executor.roles import ActorRole, Dispatch, Recorder, WorkerGroupRole, WorkerSet  # noqa: E402
from hfplan.executor.worker import SetWorker, Timed  # noqa: E402
from hfplan.plan import Layout  # noqa: E402


class _Ref:
    """Stands in for a Ray reference: wire.pack keeps objects of the reference type out of the pickle."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_wire_keeps_references_beside_the_pickle_and_large_arrays_out_of_band(monkeypatch):
    monkeypatch.setattr(wire, "_ref_type", lambda: _Ref)
    ref = _Ref("other worker's outputs")
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    large = np.arange(wire.OUT_OF_BAND_BYTES // 4, dtype=np.float32)
    blob, buffers, refs = wire.pack({"pieces": (ref, ref), "small": small, "large": large})
    assert refs == [ref]  # once, however often it occurs
    assert len(buffers) == 1 and buffers[0].nbytes == large.nbytes  # only the large array left the pickle
    back = wire.unpack(blob, buffers, refs)
    assert back["pieces"][0] is ref and back["pieces"][1] is ref
    assert np.array_equal(back["small"], small) and np.array_equal(back["large"], large)


def test_a_result_packed_without_references_keeps_large_arrays_out_of_band(monkeypatch):
    monkeypatch.setattr(wire, "_ref_type", lambda: _Ref)
    large = np.arange(wire.OUT_OF_BAND_BYTES // 4, dtype=np.float32)
    result = {"fields": {"log_probs": large, "mask": np.ones(3)}, "spans": [Timed("log_prob", "compute", 1.0, 2.0)],
              "note": _Ref("not looked for")}
    blob, buffers, refs = wire.pack(result, refs=False)
    assert refs == [] and len(buffers) == 1  # nothing taken for a reference; the large array beside the pickle
    back = wire.unpack(blob, buffers, refs)
    assert np.array_equal(back["fields"]["log_probs"], large) and back["spans"] == result["spans"]
    assert back["note"].name == "not looked for"


def test_wire_sends_a_pickle_alone_when_nothing_travels_beside_it():
    packed = wire.pack({"call": ("actor", "log_prob"), "rows": np.arange(4)})
    assert isinstance(packed, bytes)  # one argument, which Ray passes without a pickler of its own
    assert wire.arguments(packed) == (packed,)
    back = wire.unpack_packed(packed)
    assert back["call"] == ("actor", "log_prob") and np.array_equal(back["rows"], np.arange(4))


class _Worker:
    """A worker's task handling as SetWorker.calls runs it (the real method), with run_call recording each call
    it runs and returning what the test set (default: no fields), or raising for the call ids in `failing`."""

    def __init__(self, name: str) -> None:
        self.name, self.tasks, self.ran = name, [], []
        self.calls = self
        self.results: dict[int, object] = {}  # call id -> what the call returns
        self.failing: dict[int, Exception] = {}

    def options(self, num_returns: int):
        self.num_returns = num_returns
        return self

    def remote(self, *packed):
        calls = wire.unpack(*packed)
        assert len(calls) == self.num_returns
        self.tasks.append([(role, op, call_id) for role, op, _, _, call_id, _ in calls])
        return SetWorker.calls(self, *packed)

    def run_call(self, role, op, fields, options, call_id, keep_from):
        self.ran.append(call_id)
        if call_id in self.failing:
            raise self.failing[call_id]
        return self.results.get(call_id, {"fields": {}, "spans": [Timed(op, "compute", 1.0, 2.0)]})


def _roles(monkeypatch, workers, dispatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)  # the "references" are the packed results
    recorder = Recorder(clock_offsets={(0, 0): 0.0})
    recorder.start_iteration()
    worker_set = WorkerSet(0, ("actor", "reference"), workers, lambda role, op, failure: f"{role}.{op}: {failure}")
    layouts = {kind: Layout() for kind in ("train", "infer", "gen")}
    actor = ActorRole("actor", RoleFacts(output="old_log_probs", trains=True, generates=True), worker_set,
                      layouts, recorder, 1.0, dispatch, rollout=None)
    reference = WorkerGroupRole("reference", RoleFacts(output="ref_log_probs"), worker_set,
                                {ROLE_OPS["log_prob"].layout: Layout()}, recorder, 1.0, dispatch)
    return actor, reference


def test_calls_held_for_a_set_go_as_one_task_when_something_waits_and_a_generation_goes_alone(monkeypatch):
    worker, dispatch = _Worker("rank 0"), Dispatch()
    actor, reference = _roles(monkeypatch, [worker], dispatch)
    generated = actor.generate(Batch(prompts=np.zeros((2, 3), dtype=np.int64)))
    assert worker.tasks == [[("actor", "generate", 0)]]  # sent at once
    seqs = generated.select("prompts", "responses", "response_mask")
    actor.log_prob(seqs)
    ref = reference.log_prob(seqs)
    assert len(worker.tasks) == 1 and len(dispatch.held) == 2  # held: nothing waits on them yet
    worker.results[2] = {"fields": {"ref_log_probs": np.ones((2, 2))}, "spans": [Timed("log_prob", "compute", 1, 2)]}
    assert np.array_equal(ref["ref_log_probs"].result(), np.ones((2, 2)))  # a wait sends every held call, as one
    # task per worker
    assert worker.tasks[1] == [("actor", "log_prob", 1), ("reference", "log_prob", 2)] and not dispatch.held
    actor.update(seqs)
    actor.generate(Batch(prompts=np.zeros((2, 3), dtype=np.int64)))  # the update before it, alone
    assert worker.tasks[2:] == [[("actor", "update", 3)], [("actor", "generate", 4)]]


def test_every_rank_s_arguments_are_packed_before_the_first_rank_s_task_goes(monkeypatch):
    """A set's ranks get their tasks back to back: packing rank 1's arguments between the two submissions would
    start it later, and its first collective would hold rank 0 that long."""
    events: list[tuple] = []
    workers = [_Worker("rank 0"), _Worker("rank 1")]
    for rank, worker in enumerate(workers):
        def remote(*packed, submit=worker.remote, rank=rank):
            events.append(("submit", rank))
            return submit(*packed)
        worker.remote = remote
    pack = wire.pack
    monkeypatch.setattr(wire, "pack", lambda obj, **options: events.append(("pack",)) or pack(obj, **options))
    recorder, dispatch = Recorder(clock_offsets={}), Dispatch()
    recorder.start_iteration()
    worker_set = WorkerSet(0, ("reference",), workers, lambda role, op, failure: f"{role}.{op}: {failure}")
    reference = WorkerGroupRole("reference", RoleFacts(output="ref_log_probs"), worker_set,
                                {ROLE_OPS["log_prob"].layout: Layout(dp=2)}, recorder, 1.0, dispatch)
    out = reference.log_prob(Batch(prompts=np.zeros((4, 3)), responses=np.zeros((4, 2)),
                                   response_mask=np.ones((4, 2))))
    dispatch.send()
    assert events[:3] == [("pack",), ("pack",), ("submit", 0)]  # (each worker here packs its result as it runs)
    assert [task for worker in workers for task in worker.tasks] == [[("reference", "log_prob", 0)]] * 2
    call = out["ref_log_probs"].call
    assert call.opens_task and all(ref is not None for ref in call.refs)


def test_a_call_that_failed_in_a_task_is_named_and_those_after_it_did_not_run(monkeypatch):
    worker, dispatch = _Worker("rank 0"), Dispatch()
    actor, reference = _roles(monkeypatch, [worker], dispatch)
    seqs = Batch(prompts=np.zeros((2, 3)), responses=np.zeros((2, 2)), response_mask=np.ones((2, 2)))
    first, second = actor.log_prob(seqs), reference.log_prob(seqs)
    worker.failing[0] = ValueError("bad shapes")
    with pytest.raises(RunFailed, match=r"actor\.log_prob: ValueError: bad shapes"):
        first["old_log_probs"].result()
    assert worker.tasks == [[("actor", "log_prob", 0), ("reference", "log_prob", 1)]] and worker.ran == [0]
    with pytest.raises(RunFailed, match=r"reference\.log_prob: not run: actor\.log_prob, sent with it, failed first"):
        second["ref_log_probs"].result()


def test_grpo_sends_its_update_before_it_waits_for_the_log_prob_pair(monkeypatch):
    """The update needs the advantages (from the rewards) and the pair's log-probs, which the worker keeps: the
    controller sends it with nothing waited for but the generation and the rewards, and reads the pair's results
    only once the update is sent (the Dispatch's order of sends and waits, not timing)."""
    from hfplan.dataflow.algorithms import grpo
    from hfplan.dataflow.controller import ControllerState
    from hfplan.executor.roles import ExecutionController

    worker, dispatch = _Worker("rank 0"), Dispatch()
    actor, reference = _roles(monkeypatch, [worker], dispatch)
    recorder = actor.recorder
    reward = WorkerGroupRole("reward", RoleFacts(output="rewards", head="scalar"), actor.workers,
                             {ROLE_OPS["score"].layout: Layout()}, recorder, 1.0, dispatch)
    spans = [Timed("op", "compute", 1.0, 2.0)]
    worker.results[0] = {"fields": {"prompts": np.zeros((4, 3)), "responses": np.zeros((4, 2)),
                                    "response_mask": np.ones((4, 2)), "behaviour_log_probs": np.zeros((4, 2))},
                         "spans": spans}
    worker.results[1] = {"fields": {"old_log_probs": np.zeros((4, 2))}, "spans": spans}
    worker.results[2] = {"fields": {"ref_log_probs": np.zeros((4, 2))}, "spans": spans}
    worker.results[3] = {"fields": {"rewards": np.array([0.0, 1.0, 1.0, 1.0])}, "spans": spans}
    worker.results[4] = {"fields": {"actor_metrics": {"policy_loss": 0.5}}, "spans": spans}
    controller = ExecutionController(ControllerState(samples_per_prompt=2), recorder)
    prompts = np.zeros((2, 3), dtype=np.int64)
    updates = grpo({"actor": actor, "reference": reference, "reward": reward}, Batch(prompts=prompts), controller)
    calls = {call.label[:2]: call for call in recorder.calls}
    pair = calls[("actor", "log_prob")], calls[("reference", "log_prob")]
    assert all(call.waited_after is None for call in pair)  # the program never waited for them
    actor.send_ahead(prompts, 2, False)  # what the controller sends next: the update goes first
    assert updates["actor_metrics"].result() == {"policy_loss": 0.5}
    recorder.finish_iteration()  # reads what nothing read before: the pair
    update = calls[("actor", "update")]
    assert all(call.sent_in < calls[("reward", "score")].waited_after for call in pair)
    assert all(update.sent_in < call.waited_after for call in pair)
    assert worker.tasks == [[("actor", "generate", 0)],
                            [("actor", "log_prob", 1), ("reference", "log_prob", 2), ("reward", "score", 3)],
                            [("actor", "update", 4)], [("actor", "generate", 5)]]
    timings = recorder.call_timings()  # what bench/dispatch_gaps.py reads: the sends' times, the workers' spans
    assert [(t.role, t.op) for t in timings] == [label[:2] for label in calls]
    assert [t.sent for t in timings] == [call.sent_at for call in calls.values()] and timings[0].sent > 0
    assert all((t.start, t.end) == (1.0, 2.0) for t in timings)


def test_forward_calls_on_another_set_reading_a_sent_generation_go_together(monkeypatch):
    """PPO's reference log-probs and values on a set apart from the actor read the generation's outputs through Ray
    references. The generation is already sent, so making the second call must not send the first alone: both
    reach their worker as one task (run back to back) when the controller waits."""
    import ray

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    actor_worker, other_worker, dispatch = _Worker("set 0"), _Worker("set 1"), Dispatch()
    recorder = Recorder(clock_offsets={(0, 0): 0.0, (1, 0): 0.0})
    recorder.start_iteration()

    def describe(role, op, failure):
        return f"{role}.{op}: {failure}"

    actor = ActorRole("actor", RoleFacts(output="old_log_probs", trains=True, generates=True),
                      WorkerSet(0, ("actor",), [actor_worker], describe),
                      {kind: Layout() for kind in ("train", "infer", "gen")}, recorder, 1.0, dispatch, rollout=None)
    other = WorkerSet(1, ("reference", "critic"), [other_worker], describe)
    reference = WorkerGroupRole("reference", RoleFacts(output="ref_log_probs"), other,
                                {ROLE_OPS["log_prob"].layout: Layout()}, recorder, 1.0, dispatch)
    critic = WorkerGroupRole("critic", RoleFacts(output="values", head="scalar"), other,
                             {ROLE_OPS["values"].layout: Layout()}, recorder, 1.0, dispatch)
    generated = actor.generate(Batch(prompts=np.zeros((2, 3), dtype=np.int64)))
    seqs = generated.select("prompts", "responses", "response_mask")
    actor.log_prob(seqs)
    reference.log_prob(seqs)
    values = critic.values(seqs)
    assert len(dispatch.held) == 3  # the generation's references were at hand: nothing sent yet
    other_worker.results[3] = {"fields": {"values": np.ones((2, 2))}, "spans": [Timed("values", "compute", 1, 2)]}
    assert np.array_equal(values["values"].result(), np.ones((2, 2)))
    assert other_worker.tasks == [[("reference", "log_prob", 2), ("critic", "values", 3)]]
    assert actor_worker.tasks == [[("actor", "generate", 0)], [("actor", "log_prob", 1)]]
