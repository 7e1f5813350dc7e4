"""Collective measurements across W local processes (torch.distributed: nccl on GPUs, gloo on CPU).

The processes rendezvous through a file in a private temporary folder (no TCP store), and gloo/NCCL
are pointed at the loopback interface, so nothing listens beyond localhost. Rank 0 reports each
finished point and, at the end, its rows through a queue, so the parent can drive a progress bar.
"""

from __future__ import annotations

import math
import os
import queue as queue_module
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

from hfplan.errors import HfplanError
from hfplan.executor.loopback import loopback_interface
from hfplan.measure import typical
from hfplan.profiler.device import Device
from hfplan.profiler.fit import COLLECTIVES
from hfplan.profiler.host_share import measure_sharing
from hfplan.profiler.runtime import engine_seconds, world_modes
from hfplan.simulator.collectives import collective_terms

Step = Callable[[], None]
SHARING_TIMES = 40  # the host-sharing probe's budget in collective points' min_time (6 s in a full CPU profile)
# CPU processes: each collective is timed after a burst of compute on every rank, as the executor calls them (FSDP2's
# gathers and reduce-scatters between its units' passes, tensor parallelism's all-reduces between layers), not back
# to back: on the project's 2-core VM a 16 KiB all-gather took 0.1 ms back to back and 0.9-1.4 ms after 1-3 ms of
# matmuls on each rank (an all-reduce 0.4 and 1.4 ms), the ranks no longer in step and each waking to its peer.
BURST_S = 1e-3


def points(sizes: Sequence[int]) -> int:
    """Progress steps of one collective sweep."""
    return len(COLLECTIVES) * len(sizes)


def measure_collectives(torch, device: Device, sizes: Sequence[int], min_time: float, engine_reps: int,
                        step: Step) -> list[dict]:
    """All-reduce, all-gather, reduce-scatter and point-to-point over `device.world_size` processes, then the
    training engine wrapped in FSDP2 and (where the demo model splits over them) split by tensor parallelism and in
    pipeline stages across them (rows of kind `engine`, for runtime.measure_runtime_inputs), and on CPU how the
    processes share the host's cores (rows of kind `sharing`, host_share)."""
    import torch.multiprocessing as mp

    if device.world_size < 2:
        return []
    messages = mp.get_context("spawn").Queue()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hfplan-profile-") as folder:
        init = Path(folder, "rendezvous").as_uri()
        context = mp.start_processes(_worker, args=(device.world_size, device.kind, init, tuple(sizes), min_time,
                                                    engine_reps, device.threads, messages),
                                     nprocs=device.world_size, join=False, start_method="spawn")
        try:
            done = False
            while not done:
                done = context.join(timeout=0.1)
                rows += _drain(messages, step)
        except mp.ProcessRaisedException as failure:
            last = str(failure).strip().splitlines()[-1]
            raise HfplanError(f"collective measurement failed in a worker process: {last}") from None
        except mp.ProcessExitedException as failure:
            raise HfplanError(f"collective measurement failed: {failure}") from None
        rows += _drain(messages, step)
    return rows


def _drain(messages, step: Step) -> list[dict]:
    rows = []
    while True:
        try:
            kind, payload = messages.get_nowait()
        except queue_module.Empty:
            return rows
        if kind == "step":
            step()
        else:
            rows += payload


def _worker(rank: int, world: int, kind: str, init: str, sizes: tuple[int, ...], min_time: float, engine_reps: int,
            threads: int, messages) -> None:
    import torch
    import torch.distributed as dist

    loopback = loopback_interface()
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    if kind == "cuda":
        torch.cuda.set_device(rank)
        dtype, backend = torch.bfloat16, "nccl"
    else:
        torch.set_num_threads(1)
        dtype, backend = torch.float32, "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(minutes=5))
    try:
        rows = _sweep(torch, dist, rank, world, kind, dtype, sizes, min_time, messages)
        torch.set_num_threads(threads)  # the engines as a run's workers compute (the collectives took one)
        for mode in world_modes(world):  # every rank computing at once, as in a run
            rows += engine_seconds(torch, kind, mode, engine_reps).rows()
        if kind == "cpu":  # processes share the host's cores; GPUs compute on their own
            rows += measure_sharing(torch, dist, SHARING_TIMES * min_time)
        if rank == 0:
            messages.put(("rows", rows))
        dist.barrier()  # every rank done before any tears its connections down
    finally:
        dist.destroy_process_group()
    # Done and reported: leave without the interpreter's exit, whose teardown of torch's C++ state aborted a rank now
    # and then after its work ("terminate called without an active exception", SIGABRT, seen on CI and under load,
    # a barrier before the teardown notwithstanding); what this rank put on the queue is flushed first.
    messages.close()
    messages.join_thread()
    os._exit(0)


def _sweep(torch, dist, rank, world, kind, dtype, sizes, min_time, messages) -> list[dict]:
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    esize = torch.empty((), dtype=dtype).element_size()

    def sync() -> None:
        if kind == "cuda":
            torch.cuda.synchronize()

    def agreed_max(value: float) -> float:
        """The largest of every rank's value: all ranks run the same loop, and a collective ends
        when its slowest rank does."""
        t = torch.tensor([value], dtype=torch.float64, device=kind)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    burst_s = BURST_S if kind == "cpu" else 0.0
    burst = compute_burst(torch, burst_s)
    rows = []
    for op in COLLECTIVES:
        for size in sizes:
            elements = max(world, math.ceil(size / esize / world) * world)
            full = torch.ones(elements, dtype=dtype, device=kind)
            part = torch.ones(elements // world, dtype=dtype, device=kind)
            if op == "all_reduce":
                def call(full=full) -> None:
                    dist.all_reduce(full)
            elif op == "all_gather":
                def call(full=full, part=part) -> None:
                    all_gather(full, part)
            elif op == "reduce_scatter":
                def call(full=full, part=part) -> None:
                    reduce_scatter(part, full)
            else:  # ping-pong between ranks 0 and 1; one call is a round trip of two one-way messages
                def call(full=full) -> None:
                    if rank == 0:
                        dist.send(full, 1)
                        dist.recv(full, 1)
                    elif rank == 1:
                        dist.recv(full, 0)
                        dist.send(full, 0)
            call()
            sync()
            start = time.perf_counter()
            call()
            sync()
            once = agreed_max(time.perf_counter() - start)
            reps = int(min(500, max(1, math.ceil(min_time / 3 / max(once + burst_s, 1e-7)))))
            trials = []
            for _ in range(3):
                dist.barrier()
                sync()
                trials.append(agreed_max(beyond_bursts(call, burst, reps, sync)))
            seconds = typical(trials) / (2 if op == "p2p" else 1)
            nbytes = float(elements * esize)
            steps, factor = collective_terms(op, world)
            rows.append(dict(kind="collective", op=op, link="intra_node", world=world, dtype=str(dtype).split(".")[-1],
                             bytes=nbytes, steps=steps, moved_bytes=factor * nbytes, seconds=seconds,
                             rate=factor * nbytes / seconds))
            if rank == 0:
                messages.put(("step", None))
            del full, part
    return rows


def compute_burst(torch, seconds: float) -> Callable[[], None]:
    """A burst of about `seconds` of matmuls on this rank (none for 0: GPUs time collectives back to back, NCCL's
    kernels queueing behind each other on the device)."""
    if seconds <= 0:
        return lambda: None
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(50):
        torch.mm(a, b)
    count = max(1, round(seconds / ((time.perf_counter() - start) / 50)))

    def burst() -> None:
        for _ in range(count):
            torch.mm(a, b)
    return burst


def beyond_bursts(call: Callable[[], None], burst: Callable[[], None], reps: int,
                  sync: Callable[[], None] = lambda: None) -> float:
    """Seconds per call of `call` beyond the burst before each: `reps` of (burst, call), less `reps` bursts alone."""
    start = time.perf_counter()
    for _ in range(reps):
        burst()
        call()
    sync()
    with_bursts = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(reps):
        burst()
    return max(0.0, with_bursts - (time.perf_counter() - start)) / reps
