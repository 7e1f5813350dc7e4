"""How the processes of one CPU host share its cores (Compute.host_parallelism).

A CPU "device" is a process with its share of the host's threads, and a plan's set of k processes on one host
computes on all of them at once. Whether k processes then each run at their own speed depends on the host: on the
project's 2-core VM, with nothing else running, the same decode loop took 1.17x as long in each of two processes at
once as in one alone (2-3x while other jobs ran), which a profile timed on one process cannot show. So the
world's processes time the same work, the executor's rollout engine generating for one prompt, first on rank 0
while the others wait, then on every rank at once, in alternating rounds (a slower stretch of a shared machine
falls on both alike): the host computes world x alone / together ranks' worth of work at full speed.
torch is passed in; this runs inside hfplan.profiler.comm's world of processes.
"""

from __future__ import annotations

import math
import time

from hfplan.measure import typical

ROUNDS = 3
OPS = ("probe_alone", "probe_together")


def measure_sharing(torch, dist, budget_s: float) -> list[dict]:
    """Rows (kind `sharing`, on rank 0) of the probe's seconds per call alone and together; every rank of the
    process group calls this. `budget_s`: about how long the whole measurement takes."""
    from hfplan.executor.rollout.base import SamplingParams
    from hfplan.profiler import runtime

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, prompts = runtime.cpu_probe(torch)
    params = SamplingParams(max_new_tokens=runtime.LONG)

    def calls(reps: int) -> float:
        start = time.perf_counter()
        for _ in range(reps):
            engine.generate(prompts, params)
        return (time.perf_counter() - start) / reps

    once = calls(1)  # and the warm-up
    reps = torch.tensor([max(1, math.ceil(budget_s / (2 * ROUNDS) / max(once, 1e-6)))], dtype=torch.int64)
    dist.broadcast(reps, 0)  # every rank runs the same work, so the ranks run together to the end
    alone, together = [], []
    for _ in range(ROUNDS):
        dist.barrier()
        if rank == 0:
            alone.append(calls(int(reps.item())))
        dist.barrier()
        mine = torch.tensor([calls(int(reps.item()))], dtype=torch.float64)
        dist.all_reduce(mine)
        together.append(float(mine.item()) / world)
    if rank != 0:
        return []
    return [dict(kind="sharing", op=op, model=runtime.MODEL, world=world, seconds=typical(times))
            for op, times in zip(OPS, (alone, together), strict=True)]


def parallelism(world: int, alone_s: float, together_s: float) -> float:
    """How many of `world` processes' work the host does at full speed when each took `together_s` at once for
    what one alone took in `alone_s`: world x alone / together."""
    return world * alone_s / together_s


def fit_parallelism(rows: list[dict]) -> float | None:
    """Compute.host_parallelism from measure_sharing's rows (None without them)."""
    by_op = {r["op"]: r for r in rows if r.get("kind") == "sharing"}
    if set(OPS) - set(by_op):
        return None
    alone, together = by_op["probe_alone"], by_op["probe_together"]
    return round(parallelism(together["world"], alone["seconds"], together["seconds"]), 3)
