"""Where a worker waits between role calls: for each call of `hfplan execute`'s iterations, how long before the
previous call on its set ended the controller had sent it (`lead`: negative means the worker waited for the
controller), and how long after that end the worker started it (`gap`: Ray's switch between tasks, or between
calls in one task, plus any wait for the controller). Per call (role.op, in program order), medians and 90th
percentiles over iterations --skip .. --iterations - 5, and how many were sent after the previous call ended.

Reads each iteration's IterationReport.calls (the Dispatch's send times and the workers' spans, on the
controller's clock). PLAN defaults to the plan bench/vs_trl.py runs (`arith-grpo` on 1 process, the `cpu`
profile); calls on different sets are compared with the previous call of their own set. Prints figures;
asserts nothing.

    RAY_AUTH_MODE=disabled python bench/dispatch_gaps.py [--plan PLAN] [--iterations N] [--skip N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def boundaries(reports: list, set_of: dict[str, int]) -> list[tuple[int, str, float, float]]:
    """(iteration, role.op, lead, gap), lead and gap in ms, each call against the one before it on its set (the
    first call of an iteration against the previous iteration's last)."""
    out: list[tuple[int, str, float, float]] = []
    last_end: dict[int, float] = {}
    for report in reports:
        for call in sorted(report.calls, key=lambda c: c.call_id):
            where = set_of[call.role]
            if where in last_end:
                previous = last_end[where]
                out.append((report.iteration, f"{call.role}.{call.op}", 1e3 * (previous - call.sent),
                            1e3 * (call.start - previous)))
            last_end[where] = call.end
    return out


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=None, help="default: bench/vs_trl.py's hfplan plan")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--skip", type=int, default=20, help="first iterations not counted")
    args = parser.parse_args()
    if args.skip < 1 or args.iterations < args.skip + 10:
        raise SystemExit("--skip must be at least 1 and --iterations at least --skip + 10")
    from hfplan.executor.controller import ExecuteOptions, execute
    from hfplan.plan import load_plan

    reports = []
    with tempfile.TemporaryDirectory(prefix="hfplan-dispatch-gaps-") as scratch:
        folder = Path(scratch)
        plan_path = args.plan
        if plan_path is None:
            from vs_trl import HFPLAN, make_plans

            plan_path = make_plans(folder)[HFPLAN]
        plan = load_plan(plan_path)
        load = os.getloadavg()[0]
        execute(plan, ExecuteOptions(iterations=args.iterations, out=folder / "run", log_every=args.iterations),
                on_iteration=reports.append)
    counted = reports[args.skip:args.iterations - 5]
    set_of = {role: plan.set_of(role) for role in plan.placed_roles}
    print(f"hfplan execute {plan_path.name}: iterations {args.skip}-{args.iterations - 5}, load average "
          f"{load:.2f} before and {os.getloadavg()[0]:.2f} after; per call, against the previous call on its set:")
    rows = boundaries(reports[args.skip - 1:args.iterations - 5], set_of)[len(reports[args.skip - 1].calls) - 1:]
    for label in dict.fromkeys(label for _, label, _, _ in rows):
        leads = [lead for _, name, lead, _ in rows if name == label]
        gaps = [gap for _, name, _, gap in rows if name == label]
        print(f"  {label:<20} sent {statistics.median(leads):6.2f} ms before it ended (median), started "
              f"{statistics.median(gaps):5.2f} ms after (median; p90 {p90(gaps):5.2f}); sent after it ended: "
              f"{sum(lead < 0 for lead in leads)}/{len(leads)}")
    per_iteration: dict[int, float] = {}
    for iteration, _, _, gap in rows:
        per_iteration[iteration] = per_iteration.get(iteration, 0.0) + gap
    print(f"  the gaps of an iteration together: median {statistics.median(per_iteration.values()):.2f} ms, "
          f"iteration_s median {1e3 * statistics.median(r.metrics['iteration_s'] for r in counted):.2f} ms")

if __name__ == "__main__":
    main()
