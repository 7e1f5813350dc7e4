"""bench/generation_cost.py: the torch engine's generation timed beside the simulator's price of it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.scripts import BENCH_DIR, ROOT


def test_every_case_is_timed_and_priced():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(BENCH_DIR / "generation_cost.py"), "--quick", "--models", "tiny"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert [(row[0], row[1], row[2]) for row in rows] == [("tiny", b, t) for b in ("1", "8") for t in ("1", "4")]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)
    # One token is the prefill's alone; four add three decode steps.
    assert [row[-3] for row in rows] == ["0", "3", "0", "3"]
