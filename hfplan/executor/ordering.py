"""Ordered tasks on a worker: the controller numbers each ordered task it sends to a worker (per worker, from 0, in
the order it sends them) and the worker runs them one at a time, on one thread of its own, in that order, whatever
order Ray hands them over in.

Why: a worker's Ray actor is an asyncio actor (worker.InOrderWorker) whose tasks only hand their work to the worker's
own thread and await it, so Ray takes the next task in (its dequeue, its arguments) and replies to the last one on
its event loop while the current task computes; the worker's thread starts the next task as soon as the last ends,
without Ray's switch between tasks in between. An asyncio actor does not keep the order in which tasks were sent (a
task sent before the actor was up may come in after later ones): these numbers do, and a task that came early
waits for its turn without holding a thread. One thread runs every ordered task, so torch's per-thread state (grad
mode, autocast, the current CUDA device and stream) is the same for all of them, as on an actor of one thread.

Every method of worker.SetWorker is ORDERED (the controller sends it through `send`, the worker's face runs it in
turn) or UNORDERED (it reads no state an ordered task changes: Ray runs it at once, also while a task computes). An
ordered task that fails (raises) still hands the turn on: the next one runs, as the next task did on an actor of one
thread. A task numbered but never run (Ray failed it before the worker's code, e.g. an argument it could not read)
would hold back every later one until the controller's timeout; the ordered methods take no argument Ray has to
resolve first (a load's buckets come as references in a list, fetched in turn) so that a failed producer fails the
task in the worker's code, which hands the turn on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

ORDERED = frozenset({"setup", "calls", "leave_generation", "weight_buckets", "load_shards", "export_model",
                     "save_checkpoint", "load_checkpoint", "peak_memory_bytes", "close"})
UNORDERED = frozenset({"rendezvous_address", "clock", "pid", "node_id", "run_call"})  # run_call: inside `calls`


class NumberedCalls(list):
    """The role calls of one Ray task (SetWorker.run_call's arguments, in order) and the task's number on its worker:
    a list, so that the calls read as they always did; the number travels in the same pickle."""

    def __init__(self, seq: int, calls: list) -> None:
        super().__init__(calls)
        self.seq = seq


_numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # worker handle -> its next task's number
_lock = threading.Lock()


def numbered(worker, submit: Callable[[int], Any]) -> Any:
    """`submit(number)` with the next number of `worker` (a Ray actor handle): what it returns (Ray references). The
    number is taken only when the submission did not raise, so that no number goes unsent. Numbers belong to this
    process, as Ray's order of a caller's tasks did: every ordered task of a worker comes from its controller."""
    with _lock:
        seq = _numbers.get(worker, 0)
        refs = submit(seq)
        _numbers[worker] = seq + 1
    return refs


def send(worker, method: str, *args, num_returns: int = 1) -> Any:
    """Ordered method `method` of `worker` with `args`, numbered: its Ray reference (a list of num_returns)."""
    if method not in ORDERED or method == "calls":
        raise ValueError(f"{method!r} is not an ordered method taking its number first")
    remote = getattr(worker, method)
    if num_returns != 1:
        remote = remote.options(num_returns=num_returns)
    return numbered(worker, lambda seq: remote.remote(seq, *args))


class InOrder:
    """The worker's side: runs numbered work one piece at a time on its own thread, in number order from 0; `submit`
    returns the future of a piece's result (or error) at once, whenever its turn comes."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._waiting: dict[int, tuple[Callable[[], Any], Future]] = {}
        self._next = 0
        threading.Thread(target=self._loop, name="hfplan-in-order", daemon=True).start()

    def submit(self, seq: int, work: Callable[[], Any]) -> Future:
        done: Future = Future()
        with self._ready:
            if seq < self._next or seq in self._waiting:
                raise RuntimeError(f"ordered task {seq} came twice")
            self._waiting[seq] = (work, done)
            self._ready.notify()
        return done

    def _loop(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._next in self._waiting)
                work, done = self._waiting.pop(self._next)
                self._next += 1
            try:
                done.set_result(work())
            except BaseException as error:  # the task's own error, raised on its Ray thread; the next one runs
                done.set_exception(error)
