"""Run a function on a small real torch.distributed world (gloo on 127.0.0.1), one spawned process per rank.

`run_world(fn, world_size, *args)` starts the ranks, calls `fn(rank, world_size, *args)` in each after
`init_process_group`, and returns the per-rank results in rank order. `fn` must be importable (a
module-level function); its result may hold tensors, lists, dicts and numbers (it travels back
through torch.save / torch.load(weights_only=True)). A rank that fails raises here with its
traceback; every wait is bounded by `timeout`, after which the ranks are killed. `pg_timeout` (default:
`timeout`) is the process group's own timeout, for tests of what a rank does when its peers stop answering.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import queue as queue_errors
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: mp.Queue,
               timeout: float) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              pg_timeout: float | None = None) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    rank_args = (world_size, port, args, results, pg_timeout or timeout)
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, *rank_args), daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"world of {world_size} did not finish in {timeout} s "
                                   f"(ranks done: {sorted(collected)})")
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue_errors.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank exited with code {dead[0]} without a result") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    finally:
        for proc in procs:
            proc.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return [collected[r] for r in range(world_size)]
