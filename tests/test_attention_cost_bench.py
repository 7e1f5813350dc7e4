"""bench/attention_cost.py: torch's attention kernel timed alone beside the simulator's price of it."""

from __future__ import annotations

import os
import subprocess
import sys

from hfplan.profiler.sweeps import sweeps_for
from tests.support.scripts import BENCH_DIR, ROOT


def test_every_case_is_timed_and_priced_on_the_profile_and_on_its_refit():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(BENCH_DIR / "attention_cost.py"), "--quick"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    cases = sweeps_for("cpu", True).attention
    rows = [line.split() for line in lines[1:1 + len(cases)]]
    assert [(row[0], int(row[1]), int(row[2]), int(row[3]), int(row[4])) for row in rows] == [
        (op, batch, heads, width, length) for op, batch, heads, _, width, length in cases]
    assert all(float(row[5]) > 0 and row[6].endswith("%") and row[7].endswith("%") for row in rows)
    summaries = lines[1 + len(cases):]
    assert [line.split(":")[0] for line in summaries] == [
        "decode on profile", "decode on refit", "forward on profile", "forward on refit"]
