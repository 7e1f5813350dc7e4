"""What more ranks than cores do to compute and to gloo's collectives on a CPU host, beside the simulator's rule.

Pairs of gloo ranks of one torch thread each, every pair all-reducing a small tensor within itself, as a
tensor-parallel pair does: one pair (as many processes as `hfplan profile` measures collectives with on the 2-core
VM) against --pairs pairs at once. Each rank times, over --reps repetitions, a burst of matmuls alone, the all-reduce
alone (back to back), and burst then all-reduce; the bursts have one fixed size, taken in this process before any
rank starts. Prints each figure's median over the ranks for both worlds and their ratio, beside what the simulator
charges for the larger world over the smaller on --hardware (costs.on_shared_host, one node holding every rank:
kernels host_slowdown(k) / host_slowdown(2), collectives as measured). Asserts nothing about time.

    python bench/oversubscribed.py [--pairs N] [--reps N] [--bytes N] [--burst-ms MS] [--hardware NAME|PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

MODES = ("burst", "all_reduce", "burst + all_reduce")


def _matmuls_for(torch, seconds: float) -> int:
    """How many 128 x 128 matmuls take about `seconds` on one thread of this process, the machine otherwise idle."""
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(200):
        torch.mm(a, b)
    return max(1, round(seconds / ((time.perf_counter() - start) / 200)))


def _rank(rank: int, world: int, init: str, matmuls: int, nbytes: int, reps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    group = pairs[rank // 2]
    a, b, x = torch.randn(128, 128), torch.randn(128, 128), torch.ones(nbytes // 4)

    def burst() -> None:
        for _ in range(matmuls):
            torch.mm(a, b)

    calls = {"burst": burst, "all_reduce": lambda: dist.all_reduce(x, group=group),
             "burst + all_reduce": lambda: (burst(), dist.all_reduce(x, group=group))}
    out = {}
    for mode, call in calls.items():
        call()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            call()
        out[mode] = (time.perf_counter() - start) / reps
    queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, matmuls: int, nbytes: int, reps: int) -> dict[str, float]:
    """Each mode's seconds per repetition, the median over `world` ranks (world // 2 pairs)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init = Path(folder, "rendezvous").as_uri()
        ranks = [context.Process(target=_rank, args=(r, world, init, matmuls, nbytes, reps, queue))
                 for r in range(world)]
        for process in ranks:
            process.start()
        rows = [queue.get(timeout=600) for _ in ranks]
        for process in ranks:
            process.join(timeout=60)
    return {mode: statistics.median(row[mode] for row in rows) for mode in MODES}


def simulator_ratios(hardware: str, ranks: int, measured_with: int) -> dict[str, float]:
    """What the simulator charges `ranks` ranks of one host over `measured_with` (costs.on_shared_host): for a
    burst of compute (a kernel) and for an all-reduce (a tensor-parallel collective)."""
    from hfplan.profiles.hardware import load_hardware
    from hfplan.simulator.costs import Parts, SetShape, on_shared_host

    hw = load_hardware(hardware)
    call = Parts(gemm=1.0, tp_comm=1.0)
    small, large = (on_shared_host(hw, SetShape(n, n), call) for n in (measured_with, ranks))
    return {"burst": large["gemm"] / small["gemm"], "all_reduce": large["tp_comm"] / small["tp_comm"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="pairs of ranks in the larger world (default 2)")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--bytes", type=int, default=2048, help="all-reduced bytes (default 2048: a decode step's)")
    parser.add_argument("--burst-ms", type=float, default=1.0, help="the burst of matmuls before each all-reduce")
    parser.add_argument("--hardware", default="cpu", help="the profile whose rule is printed beside")
    args = parser.parse_args()
    if args.pairs < 2 or args.reps < 1 or args.bytes < 4 or args.burst_ms < 0:
        parser.exit(2, "oversubscribed.py: --pairs at least 2, --reps and --bytes positive, --burst-ms not negative\n")
    import torch

    from hfplan.executor.loopback import loopback_interface

    loopback = loopback_interface()
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    torch.set_num_threads(1)
    matmuls = _matmuls_for(torch, args.burst_ms * 1e-3)
    worlds = (2, 2 * args.pairs)
    figures = {world: measure(world, matmuls, args.bytes, args.reps) for world in worlds}
    rule = simulator_ratios(args.hardware, worlds[1], worlds[0])
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; pairs all-reducing {args.bytes} B, bursts "
          f"of {matmuls} matmuls (~{args.burst_ms:g} ms alone), {args.reps} reps; us a repetition, median over ranks")
    print(f"{'mode':<20}{f'{worlds[0]} ranks':>10}{f'{worlds[1]} ranks':>10}{'ratio':>8}{'simulator':>11}")
    for mode in MODES:
        small, large = figures[worlds[0]][mode], figures[worlds[1]][mode]
        charged = f"{rule[mode]:>11.2f}" if mode in rule else f"{'-':>11}"
        print(f"{mode:<20}{small * 1e6:>10.0f}{large * 1e6:>10.0f}{large / small:>8.2f}{charged}")


if __name__ == "__main__":
    main()
