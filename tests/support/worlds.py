"""Run a function on a small real torch.distributed world (gloo on 127.0.0.1), one process per rank.

`run_world(fn, world_size, *args)` calls `fn(rank, world_size, *args)` in each rank after
`init_process_group` and returns the per-rank results in rank order. `fn` must be importable (a
module-level function); its result may hold tensors, lists, dicts and numbers (it travels back
through torch.save / torch.load(weights_only=True)). A rank that fails raises here with its
traceback; every wait is bounded by `timeout`, after which the ranks are killed. `pg_timeout` (default:
`timeout`) is the process group's own timeout, for tests of what a rank does when its peers stop answering.

Spawning a rank and importing torch takes seconds, so each rank of a world size is spawned once per
session as a "zygote" that imports torch (and, on the first call of a test module, that module) and then
forks a child per call: the child joins a new process group, runs the call and exits. A call thus starts
from a process that never touched torch.distributed (torch caches device meshes and process-group names
globally, so reusing one process across calls of multi-rank worlds leaked them: a later call's DTensor found
a group name an earlier call had destroyed; single-rank references run in the test process, through
hfplan.executor.local's world of one, whose tests build their meshes afresh each time). A world whose call
failed or ran out of time is killed, zygotes and children, and the next call spawns a new one; a zygote whose
test process died (killed, so it never stopped its worlds) ends within a second.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import itertools
import multiprocessing as mp
import os
import pickle
import queue as queue_errors
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

_CALLS = itertools.count()


@dataclass(frozen=True)
class _Call:
    number: int
    fn: Callable[..., Any]
    args: tuple
    rendezvous: str  # a file no call has used: its ranks meet there (a port found free could be taken meanwhile)
    pg_timeout: float


def _run_call(call: _Call, rank: int, world_size: int) -> tuple[bool, bytes | str]:
    try:
        dist.init_process_group("gloo", init_method=f"file://{call.rendezvous}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=call.pg_timeout))
        out = call.fn(rank, world_size, *call.args)
        buffer = io.BytesIO()
        torch.save(out, buffer)
        return True, buffer.getvalue()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        return False, traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _forked(call: _Call, rank: int, world_size: int) -> tuple[bool, bytes | str]:
    """Run the call in a child forked from this process; its outcome comes back through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, write, exit without running the zygote's exit handlers
        os.close(read_end)
        code = 1
        try:
            with os.fdopen(write_end, "wb") as sink:
                pickle.dump(_run_call(call, rank, world_size), sink)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as source:
        data = source.read()
    _, status = os.waitpid(pid, 0)
    if data:
        return pickle.loads(data)
    return False, f"the rank's process ended ({os.waitstatus_to_exitcode(status)}) without a result"


def _zygote(rank: int, world_size: int, calls: mp.Queue, results: mp.Queue) -> None:
    os.setsid()  # the parent kills this process and its children as one group
    torch.set_num_threads(1)
    parent = os.getppid()
    while True:
        try:
            call = calls.get(timeout=1.0)
        except queue_errors.Empty:
            if os.getppid() != parent:  # the test process died without stopping its worlds (killed)
                return
            continue
        if call is None:
            return
        ok, payload = _forked(call, rank, world_size)
        results.put((call.number, rank, ok, payload))


@dataclass
class _World:
    procs: list[BaseProcess]
    calls: list[mp.Queue]
    results: mp.Queue

    @classmethod
    def spawn(cls, world_size: int) -> _World:
        ctx = mp.get_context("spawn")
        calls = [ctx.Queue() for _ in range(world_size)]
        results = ctx.Queue()
        procs = [ctx.Process(target=_zygote, args=(rank, world_size, calls[rank], results), daemon=True)
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        return cls(procs, calls, results)

    def run(self, call: _Call, deadline: float) -> list[Any]:
        for queue in self.calls:
            queue.put(call)
        collected: dict[int, Any] = {}
        while len(collected) < len(self.procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"world of {len(self.procs)} did not finish in time (ranks done: "
                                   f"{sorted(collected)})")
            try:
                number, rank, ok, payload = self.results.get(timeout=0.5)
            except queue_errors.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"a rank exited with code {dead[0]} without a result") from None
                continue
            assert number == call.number, (number, call.number)  # a failed call's world is never reused
            if not ok:
                raise RuntimeError(self._failures({rank: payload}))
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=True)
        return [collected[r] for r in range(len(self.procs))]

    def _failures(self, failed: dict[int, str], grace_s: float = 2.0) -> str:
        """Every rank's failure that arrives within `grace_s` of the first, in rank order: the rank that failed
        first is not always the first to report (its peers' errors about its exit may come sooner)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                _, rank, ok, payload = self.results.get(timeout=0.1)
            except queue_errors.Empty:
                continue
            if not ok:
                failed[rank] = payload
        return "\n".join(f"rank {rank} failed:\n{failed[rank]}" for rank in sorted(failed))

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the zygote and the call's child
            proc.kill()  # if it died before it led its own group
            proc.join(timeout=5)


_POOL: dict[int, _World] = {}


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              pg_timeout: float | None = None) -> list[Any]:
    deadline = time.monotonic() + timeout
    world = _POOL.pop(world_size, None) or _World.spawn(world_size)
    number = next(_CALLS)
    with tempfile.TemporaryDirectory(prefix="hfplan-world-") as folder:
        call = _Call(number, fn, args, os.path.join(folder, "rendezvous"), pg_timeout or timeout)
        try:
            results = world.run(call, deadline)
        except BaseException:
            world.kill()
            raise
    _POOL[world_size] = world
    return results
