"""The simulator against the executor: `hfplan validate`'s comparison over a grid of plans on this machine.

Plans: the built-in `demo` (PPO) and `arith-grpo` (GRPO) workloads, every role on one set, in the layouts
tp x pp x dp of bench/execute_layouts.py that fit --max-processes (--quick: 1x1x1, 1x1x2, 2x1x1). Each plan is
validated (hfplan.validation.run.validate: executed, the first iteration a warm-up, then simulated with the
measured mean response length) on one Ray session. Prints each plan's simulated and measured iteration, the
median absolute per-stage, iteration and memory errors, and Kendall's tau between simulated and measured
iteration times over the plans (the ranking the search relies on). Asserts nothing about time.

    RAY_AUTH_MODE=disabled python bench/validate.py [--quick] [--iterations N] [--hardware NAME]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from execute_layouts import LAYOUTS, layout_plan  # bench/ is the script's folder, hence on sys.path

from hfplan.executor.controller import ExecuteOptions
from hfplan.spec import load_workload
from hfplan.validation.compare import kendall_tau
from hfplan.validation.run import validate

QUICK_LAYOUTS = ((1, 1, 1), (1, 1, 2), (2, 1, 1))
WORKLOADS = ("demo", "arith-grpo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three layouts, 3 iterations each")
    parser.add_argument("--iterations", type=int, default=None, help="iterations per plan (default 5; quick 3)")
    parser.add_argument("--hardware", default="cpu", help="hardware profile the plans are simulated on")
    parser.add_argument("--max-processes", type=int, default=4)
    args = parser.parse_args()
    iterations = args.iterations or (3 if args.quick else 5)
    layouts = [lay for lay in (QUICK_LAYOUTS if args.quick else LAYOUTS) if lay[0] * lay[1] * lay[2]
               <= args.max_processes]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray_tmp = tempfile.mkdtemp(prefix="hfr-", dir="/tmp")
    out = Path(tempfile.mkdtemp(prefix="hfplan-validate-"))
    started = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=ray_tmp,
             log_to_driver=False)
    rows = []
    try:
        print(f"hfplan validate over {len(WORKLOADS) * len(layouts)} plans, {iterations} iterations each (first "
              f"a warm-up), profile {args.hardware}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        print(f"{'plan':<22}{'simulated s':>12}{'measured s':>12}{'error':>9}")
        for name in WORKLOADS:
            workload = load_workload(name)
            for tp, pp, dp in layouts:
                label = f"{name} t{tp}p{pp}d{dp}"
                plan = layout_plan(workload, tp, pp, dp, args.hardware)
                options = ExecuteOptions(iterations=iterations, out=out / label.replace(" ", "-"),
                                         call_timeout_s=300, start_timeout_s=120)
                result = validate(plan, options, [f"set {i}" for i in range(len(plan.placement))]).comparison
                it = result.iteration
                print(f"{label:<22}{it.simulated:>12.3f}{it.measured:>12.3f}{it.error * 100:>+8.1f}%", flush=True)
                rows.append(result)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)

    def median_abs(values) -> float:
        values = [abs(v) for v in values if v is not None]
        return statistics.median(values) * 100 if values else float("nan")

    stage_errors = [f.error for r in rows for f in r.stages.values()]
    print(f"median |error|: per stage {median_abs(stage_errors):.1f}% (worst "
          f"{max(abs(e) for e in stage_errors if e is not None) * 100:.1f}%), iteration "
          f"{median_abs([r.iteration.error for r in rows]):.1f}%, memory "
          f"{median_abs([f.error for r in rows for f in r.memory_gib.values()]):.1f}%")
    tau = kendall_tau([r.iteration.simulated for r in rows], [r.iteration.measured for r in rows])
    print(f"Kendall tau (simulated vs measured iteration, {len(rows)} plans): {tau:.2f}")
    print(f"whole benchmark: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
