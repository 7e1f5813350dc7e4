"""What gloo's collectives cost two CPU ranks as the executor calls them.

1. Per call, back to back and after a burst of matmuls on every rank (0.3, 1 and 3 ms), timed as `hfplan profile`
   times them on CPU (hfplan.profiler.comm: compute_burst, beyond_bursts; BURST_S) against back to back.
2. The training engine's actor update over two FSDP2 ranks (the demo models, one micro-batch of 16 sequences a rank):
   its time, and the time inside each kind of collective (torch.distributed's functions wrapped with a timer; FSDP2
   on CPU waits for each where it calls it).

Two gloo processes of one torch thread each, on loopback; medians. Asserts nothing about time.

    python bench/gloo_collectives.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZES = (16 * 1024, 148 * 1024)  # bytes: a small message, and about one `tiny` layer's fp32 weights
BURSTS_MS = (0.0, 0.3, 1.0, 3.0)
REPS, TRIALS = 60, 3
FSDP_MODELS = ("tiny", "tiny-arith")
SEQUENCES, UPDATES, ROUNDS = 16, 10, 5
TIMED = ("all_gather_single", "reduce_scatter_single", "all_reduce")


def _collectives(torch, dist, out: dict) -> None:
    from hfplan.profiler.comm import beyond_bursts, compute_burst

    world = dist.get_world_size()
    bursts = {ms: compute_burst(torch, ms * 1e-3) for ms in BURSTS_MS}
    for nbytes in SIZES:
        full, part = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world)
        calls = {"all_gather": lambda full=full, part=part: dist.all_gather_single(full, part),
                 "reduce_scatter": lambda full=full, part=part: dist.reduce_scatter_single(part, full),
                 "all_reduce": lambda full=full: dist.all_reduce(full)}
        for name, call in calls.items():
            for burst_ms, burst in bursts.items():
                extra = []
                for _ in range(TRIALS):
                    dist.barrier()
                    extra.append(beyond_bursts(call, burst, REPS))
                out[("call", name, nbytes, burst_ms)] = statistics.median(extra)


def _fsdp_update(torch, dist, model: str, out: dict) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import train_engine

    from hfplan.executor.engines.training import RoleModel
    from hfplan.executor.mesh import ParallelDims
    from hfplan.executor.models import build_model
    from hfplan.hyperparams import Hyperparameters

    role = RoleModel(build_model(model, "lm", seed=0, dtype=torch.float32), ParallelDims(1, 1, 2, 1).build("cpu"),
                     Hyperparameters(), "cpu", torch.float32, pad_id=0, lr=1e-6, fsdp=True)
    data = train_engine.batch(model, SEQUENCES)
    spent: dict[str, float] = {}
    originals = {name: getattr(dist, name) for name in TIMED}

    def timed(name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            work = originals[name](*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                work.wait()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
            return work
        return call

    def update():
        role.update_actor(data, mini_batches=1, epochs=1, micro_batch=SEQUENCES, use_kl_loss=True)

    for name in TIMED:
        setattr(dist, name, timed(name))
    try:
        update()
        rounds = []
        for _ in range(ROUNDS):
            spent.clear()
            start = time.perf_counter()
            for _ in range(UPDATES):
                update()
            rounds.append(((time.perf_counter() - start) / UPDATES, {k: v / UPDATES for k, v in spent.items()}))
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    wall, split = sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]
    out[("fsdp", model)] = (wall, split)


def _rank(rank: int, init: str, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    out: dict = {}
    _collectives(torch, dist, out)
    for model in FSDP_MODELS:
        _fsdp_update(torch, dist, model, out)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from hfplan.executor.loopback import loopback_interface

    loopback = loopback_interface()
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init = Path(folder, "rendezvous").as_uri()
        ranks = [context.Process(target=_rank, args=(r, init, queue)) for r in range(2)]
        for process in ranks:
            process.start()
        out = queue.get(timeout=600)
        for process in ranks:
            process.join(timeout=60)
    print(f"gloo, 2 ranks of one thread, load average {os.getloadavg()[0]:.1f}")
    print(f"{'collective':<16}{'bytes':>8}" + "".join(f"{f'after {b:g} ms':>14}" for b in BURSTS_MS) + "  (us a call)")
    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        for nbytes in SIZES:
            cells = "".join(f"{out[('call', name, nbytes, b)] * 1e6:>14.0f}" for b in BURSTS_MS)
            print(f"{name:<16}{nbytes:>8}{cells}")
    print(f"FSDP2 actor update over 2 ranks, {SEQUENCES} sequences a rank (median of {ROUNDS} rounds of {UPDATES})")
    for model in FSDP_MODELS:
        wall, split = out[("fsdp", model)]
        inside = ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in sorted(split.items()))
        print(f"{model:<12}{wall * 1e3:>8.1f} ms, inside collectives: {inside} ms "
              f"({sum(split.values()) / wall:.0%})")


if __name__ == "__main__":
    main()
