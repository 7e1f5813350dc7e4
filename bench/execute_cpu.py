"""CPU seconds per iteration of `hfplan execute`, controller and worker, for one or more source trees in
alternating rounds: a measure of the executor's own work that a machine shared with other jobs disturbs far less
than wall-clock time does.

Each round runs `hfplan execute PLAN` once per tree (the tree on PYTHONPATH, so its Ray worker runs that tree too)
and reads the CPU time (user + system, /proc) of the controller's process and of its one worker between the end of
iteration --skip and the end of iteration --iterations - 5 (the last ones write the checkpoint), the median
`iteration_s` over them, and the median of the worker's idle time per iteration (`iteration_s` less the union of its
set's spans in timeline.json: the gaps between its calls). PLAN defaults to the plan bench/vs_trl.py runs
(`arith-grpo` on 1 process, the `cpu` profile); plans of more than one worker are refused. Linux only (/proc).
Prints figures; asserts nothing.

    RAY_AUTH_MODE=disabled python bench/execute_cpu.py [--plan PLAN] [--rounds N] [--iterations N]
        [NAME=TREE ...]   (default: this tree, as "this")
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_for(predicate, proc: subprocess.Popen, what: str) -> None:
    while not predicate():
        if proc.poll() is not None:
            raise SystemExit(f"hfplan execute exited ({proc.returncode}) before {what}")
        time.sleep(0.005)


def one_run(tree: Path, plan: Path, out: Path, iterations: int, skip: int) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (a folder with checkpoints is refused)
    env = os.environ | {"PYTHONPATH": str(tree)}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    command = [sys.executable, "-m", "hfplan.cli", "execute", str(plan), "--iterations", str(iterations),
               "--out", str(out), "--seed", "0", "--log-every", str(iterations)]
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, workers = out / "metrics.jsonl", out / "workers.json"
    wait_for(workers.is_file, proc, "its workers started")
    pids = list(json.loads(workers.read_text())["pids"].values())
    if len(pids) != 1:
        proc.kill()
        raise SystemExit(f"{plan}: {len(pids)} workers; this bench reads one")
    end = iterations - 5
    wait_for(lambda: lines(metrics) >= skip, proc, f"iteration {skip}")
    controller0, worker0 = cpu_s(proc.pid), cpu_s(pids[0])
    wait_for(lambda: lines(metrics) >= end, proc, f"iteration {end}")
    controller1, worker1 = cpu_s(proc.pid), cpu_s(pids[0])
    if proc.wait():
        raise SystemExit(f"hfplan execute failed ({proc.returncode}) in {tree}")
    seconds = [json.loads(line)["iteration_s"] for line in metrics.read_text().splitlines()[skip:end]]
    timeline = json.loads((out / "timeline.json").read_text())["iterations"][skip:end]
    idle = [wall - busy_s(entry["spans"]) for wall, entry in zip(seconds, timeline, strict=True)]
    n = end - skip
    return {"controller_cpu_ms": 1e3 * (controller1 - controller0) / n, "worker_cpu_ms": 1e3 * (worker1 - worker0) / n,
            "iteration_s_median_ms": 1e3 * statistics.median(seconds),
            "worker_idle_median_ms": 1e3 * statistics.median(idle)}


def busy_s(spans: list[dict]) -> float:
    """Seconds covered by the spans of the workers' set (set 0; the controller's are set -1), overlaps once."""
    covered, reach = 0.0, 0.0
    for start, end in sorted((s["start"], s["end"]) for s in spans if s["set"] == 0):
        covered += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", help="NAME=TREE: a source tree to run (default: this one)")
    parser.add_argument("--plan", type=Path, default=None, help="default: bench/vs_trl.py's hfplan plan")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--skip", type=int, default=20, help="first iterations not counted")
    args = parser.parse_args()
    if args.rounds < 1 or args.skip < 1 or args.iterations < args.skip + 10:
        raise SystemExit("--rounds must be at least 1, --skip at least 1, --iterations at least --skip + 10")
    trees = dict(item.split("=", 1) for item in args.trees) if args.trees else {"this": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="hfplan-execute-cpu-") as scratch:
        folder = Path(scratch)
        plan = args.plan
        if plan is None:
            from vs_trl import HFPLAN, make_plans

            plan = make_plans(folder)[HFPLAN]
        print(f"hfplan execute {plan.name}: CPU ms per iteration over iterations {args.skip}-{args.iterations - 5}, "
              f"{args.rounds} alternating rounds; load average {os.getloadavg()[0]:.2f}")
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for round_index in range(args.rounds):
            for name, tree in trees.items():
                run = one_run(Path(tree).resolve(), plan, folder / f"run-{name}", args.iterations, args.skip)
                runs[name].append(run)
                print(f"  round {round_index + 1} {name:<10}" + "".join(f"  {key} {value:7.2f}"
                                                                      for key, value in run.items())
                      + f"  (load {os.getloadavg()[0]:.2f})", flush=True)
    print("medians over rounds:")
    for name, rows in runs.items():
        print(f"  {name:<10}" + "".join(f"  {key} {statistics.median(r[key] for r in rows):7.2f}" for key in rows[0]))


if __name__ == "__main__":
    main()
