"""Measured seconds of each call of `hfplan execute` beside the simulator's estimate, per parallel layout.

The built-in `demo` workload (PPO on the tiny model, rule reward) with every role on one set, in the layouts
tp x pp x dp = 1 x 1 x 1, 1 x 1 x 2, 2 x 1 x 1, 2 x 1 x 2, 1 x 2 x 1 and 2 x 2 x 1 (training and inference in
that layout, ZeRO-3 where dp > 1, a pipeline's mini-batch in pp micro-batches; generation at the same tp in one
stage, pp x dp replicas). Each plan runs through the executor's library API on one Ray session; the first iterations are
warm-up. Per call: the median compute seconds per iteration measured on the workers, the simulator's
seconds for the same call (hfplan.simulator.engine.simulate_plan on the hardware profile given, `cpu` by
default: pass the name of a measured one, from `hfplan profile --device cpu`), and their ratio; the same
for the whole iteration. The first figures of the simulator's fidelity on tensor- and pipeline-parallel
layouts.
Prints figures; asserts nothing about time.

    RAY_AUTH_MODE=disabled python bench/execute_layouts.py [--iterations N] [--hardware NAME] [--max-processes N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from execute_speed import compute_per_call, run_executor  # bench/ is the script's folder, hence on sys.path

from hfplan.plan import Plan, colocated_plan
from hfplan.simulator.engine import simulate_plan
from hfplan.spec import load_workload

LAYOUTS = ((1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 1), (2, 2, 1))  # (tp, pp, dp)


def simulated_per_call(plan: Plan) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for span in simulate_plan(plan).timeline.spans:
        if span.kind == "compute" and span.set >= 0:
            sums[f"{span.role}.{span.op}"] += span.end - span.start
    return sums


def ratio(measured: float, simulated: float) -> str:
    return f"{measured / simulated:8.2f}" if simulated > 0 else f"{'-':>8}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6, help="iterations per layout (the first 2 warm up)")
    parser.add_argument("--hardware", default="cpu", help="hardware profile of the simulator's estimate")
    parser.add_argument("--max-processes", type=int, default=4, help="skip layouts of more processes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.iterations < 2:
        raise SystemExit("--iterations must be at least 2 (the first is warm-up)")
    warmup = min(2, args.iterations - 1)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    workload = load_workload("demo")
    ray_tmp = tempfile.mkdtemp(prefix="hfr-", dir="/tmp")  # short: Ray's socket paths have a length limit
    out = Path(tempfile.mkdtemp(prefix="hfplan-bench-"))
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=ray_tmp,
             log_to_driver=False)
    try:
        print(f"hfplan execute per layout against the simulator on {args.hardware!r}: workload demo, "
              f"{args.iterations - warmup} measured iterations after {warmup} warm-up; {os.cpu_count()} cores, "
              f"load average {os.getloadavg()[0]:.1f}")
        for tp, pp, dp in LAYOUTS:
            gpus = tp * pp * dp
            if gpus > args.max_processes:
                continue
            plan = colocated_plan(workload, tp, pp, dp, args.hardware)
            simulated = simulated_per_call(plan)
            started = time.perf_counter()
            name = f"tp{tp} pp{pp} dp{dp}"
            run = run_executor(name, gpus, plan, args.iterations, warmup, args.seed, out / name.replace(" ", "-"))
            measured = compute_per_call(run)
            print(f"\ntp={tp} pp={pp} dp={dp} ({gpus} processes, run {time.perf_counter() - started:.0f} s)")
            print(f"  {'call':<22}{'measured s':>11}{'simulated s':>12}{'ratio':>8}")
            for call in sorted(set(measured) | set(simulated)):
                got, want = measured.get(call, 0.0), simulated.get(call, 0.0)
                print(f"  {call:<22}{got:>11.4f}{want:>12.4f}{ratio(got, want)}")
            iteration, estimate = run.median("iteration_s"), simulate_plan(plan).estimate.iteration_s
            print(f"  {'iteration':<22}{iteration:>11.4f}{estimate:>12.4f}{ratio(iteration, estimate)}")
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
