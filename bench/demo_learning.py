"""Whether the README's CPU demo learns: `hfplan search --workload demo --hardware cpu --gpus 2` then `hfplan
execute` at its default iteration count (40), as the README runs them; prints the reward of every iteration
and the mean of the first and last 10 (the README quotes them). Prints figures; asserts nothing.

    RAY_AUTH_MODE=disabled python bench/demo_learning.py [--iterations N] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def hfplan(*args: str) -> None:
    subprocess.run([sys.executable, "-c", "from hfplan.cli import app; app()", *args], check=True,
                   env=os.environ | {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hfplan-demo-") as folder:
        plan, out = Path(folder) / "demo.json", Path(folder) / "run"
        hfplan("search", "--workload", "demo", "--hardware", "cpu", "--gpus", "2", "--out", str(plan), "--no-compare")
        hfplan("execute", str(plan), "--out", str(out), "--iterations", str(options.iterations),
               "--seed", str(options.seed))
        rewards = [json.loads(line)["reward"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    print("reward per iteration:", " ".join(f"{r:.3f}" for r in rewards))
    count = min(10, len(rewards))
    first, last = sum(rewards[:count]) / count, sum(rewards[-count:]) / count
    print(f"mean reward, first {count} iterations: {first:.4f}; last {count}: {last:.4f} "
          f"({(last - first) / first * 100:+.1f}%)")


if __name__ == "__main__":
    main()
