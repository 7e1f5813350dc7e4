"""Whether a built-in demo workload learns, as the README runs it: `hfplan search --workload W --hardware cpu
--gpus G`, then `hfplan execute` for a few seeds; prints each run's mean reward over its first and last
iterations (two windows that share no iteration) and the median change. Prints figures; asserts nothing.

    python bench/demo_learning.py [--workload demo|arith-grpo] [--gpus G] [--iterations N] [--seeds 0 1 2]
                                  [--window 10] [--rollout torch|vllm]
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

HFPLAN = [str(Path(sys.executable).parent / "hfplan")]  # the console script of this environment


def _run(args: list[str], cwd: Path) -> None:
    env = os.environ | {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    done = subprocess.run([*HFPLAN, *args], cwd=cwd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"hfplan {' '.join(args)} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")


def rewards(workload: str, gpus: int, iterations: int, seed: int, folder: Path, rollout: str | None = None
            ) -> list[float]:
    _run(["search", "--gpus", str(gpus), "--hardware", "cpu", "--workload", workload, "--out", "plan.json",
          "--no-compare"], folder)
    engine = [] if rollout is None else ["--rollout", rollout]
    _run(["execute", "plan.json", "--iterations", str(iterations), "--seed", str(seed), "--out", f"run-{seed}",
          *engine], folder)
    lines = (folder / f"run-{seed}" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["reward"] for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="arith-grpo")
    parser.add_argument("--gpus", type=int, default=1, help="CPU processes of the plan")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--rollout", choices=["torch", "vllm"], help="generate with this engine (hfplan execute "
                                                                     "--rollout), not the plan's")
    args = parser.parse_args()
    if 2 * args.window > args.iterations:
        parser.error("--iterations must hold two --window windows")
    engine = f", rollout {args.rollout}" if args.rollout else ""
    print(f"{args.workload} on {args.gpus} CPU process(es){engine}, {args.iterations} iterations, mean reward of the "
          f"first and last {args.window}")
    gains = []
    with tempfile.TemporaryDirectory(prefix="hfplan-learning-") as tmp:
        for seed in args.seeds:
            series = rewards(args.workload, args.gpus, args.iterations, seed, Path(tmp), args.rollout)
            first = statistics.fmean(series[:args.window])
            last = statistics.fmean(series[-args.window:])
            gains.append(last - first)
            print(f"seed {seed}: {first:.3f} -> {last:.3f} ({last - first:+.3f})")
    print(f"median change {statistics.median(gains):+.3f}; runs that improved: "
          f"{sum(g > 0 for g in gains)}/{len(gains)}")


if __name__ == "__main__":
    main()
