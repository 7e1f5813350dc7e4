"""How far apart the ranks of a set start each task, and the iteration, for one or more source trees in
alternating rounds: `hfplan validate PLAN --json` once per tree and round (the tree on PYTHONPATH, so its Ray
workers run that tree too).

A task sent to every rank of a set does its first collective when its last rank has started, so the spread between
the ranks' starts is time every rank of a data-parallel set waits. PLAN defaults to `arith-grpo` colocated on one set
of 2 processes (data parallel 2, FSDP2), on the `cpu` profile. Prints, per tree, the medians over the rounds of the
run's median start spread (validate's `rank_start_spread_s`), its measured iteration and the machine's pace
(validate's probe: above 1, slower than when profiled), and each tree's ratio to the first tree's. Linux or macOS;
asserts nothing.

    RAY_AUTH_MODE=disabled python bench/start_spread.py [--plan PLAN] [--rounds N] [--iterations N]
        [NAME=TREE ...]   (default: this tree, as "this")
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def default_plan(folder: Path) -> Path:
    from hfplan.plan import colocated_plan
    from hfplan.spec import load_workload

    plan = colocated_plan(load_workload("arith-grpo"), tp=1, pp=1, dp=2, hardware="cpu")
    path = folder / "arith-grpo-dp2.json"
    path.write_text(plan.model_dump_json(indent=1))
    return path


def validate_once(tree: Path, plan: Path, iterations: int) -> dict:
    env = os.environ | {"PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-m", "hfplan", "validate", str(plan), "--iterations", str(iterations),
                           "--json"], cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise SystemExit(f"hfplan validate in {tree} failed: {last}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", metavar="NAME=TREE", help="source trees to compare (default: this one)")
    parser.add_argument("--plan", type=Path, default=None, help="default: arith-grpo on one set of 2 processes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=12)
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in (t.split("=", 1) for t in args.trees)] or [("this", ROOT)]
    with tempfile.TemporaryDirectory(prefix="hfplan-spread-") as folder:
        plan = args.plan.resolve() if args.plan else default_plan(Path(folder))
        print(f"hfplan validate {plan.name} --iterations {args.iterations}, {args.rounds} alternating round(s); "
              f"load average {os.getloadavg()[0]:.2f}")
        runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
        for round_index in range(args.rounds):
            for name, tree in trees:
                runs[name].append(validate_once(tree, plan, args.iterations))
            print(f"  round {round_index + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'tree':<12}{'start spread ms':>16}{'iteration ms':>14}{'pace':>7}   per round (spread / iteration ms)")
    medians = {}
    for name, _ in trees:
        spreads = [1e3 * (r["rank_start_spread_s"] or 0.0) for r in runs[name]]
        iterations = [1e3 * r["iteration"]["measured"] for r in runs[name]]
        paces = [r["pace"]["ratio"] for r in runs[name] if r.get("pace")]
        medians[name] = (statistics.median(spreads), statistics.median(iterations))
        rounds = ", ".join(f"{s:.2f} / {i:.1f}" for s, i in zip(spreads, iterations, strict=True))
        pace = f"{statistics.median(paces):.2f}" if paces else "n/a"
        print(f"{name:<12}{medians[name][0]:>16.2f}{medians[name][1]:>14.1f}{pace:>7}   {rounds}")
    first = trees[0][0]
    for name, _ in trees[1:]:
        spread = (f"start spread {medians[name][0] / medians[first][0]:.2f}x" if medians[first][0] > 0
                  else "no start spread (every set of the plan has one rank)")
        print(f"{name} / {first}: {spread}, iteration {medians[name][1] / medians[first][1]:.2f}x")


if __name__ == "__main__":
    main()
