"""bench/runtime_calls.py: one iteration's worker calls through the executor's runtime, timed without its
controller, beside the simulator's figures (run here on one process, in this test's own process group)."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.support.executor_runs import cpu_plan, tiny_workload
from tests.support.scripts import BENCH_DIR, load_bench

SCRIPT = BENCH_DIR / "runtime_calls.py"
BENCH = load_bench("runtime_calls")
PLAN = cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 1)])


def test_each_call_of_the_iteration_is_timed_on_the_rank(tmp_path):
    threads = torch.get_num_threads()
    try:
        seconds = BENCH.iteration_calls(0, 1, PLAN.to_json(), (tmp_path / "rendezvous").as_uri(), BENCH.WARM + 1)
    finally:
        torch.set_num_threads(threads)
    assert set(seconds) == {"actor.generate", "actor.reshard back", "critic.values", "actor.log_prob",
                            "reference.log_prob", "actor.update", "critic.update"}
    assert all(value > 0 for value in seconds.values())


def test_the_simulated_generation_includes_the_switch_into_it():
    simulated = BENCH.simulated_calls(PLAN)
    assert {"actor.generate", "critic.values", "actor.update", "critic.update"} <= set(simulated)
    assert "actor.reshard" not in simulated and all(value > 0 for value in simulated.values())


def test_a_plan_of_two_sets_is_refused_in_one_line(tmp_path):
    split = tmp_path / "split.json"
    split.write_text(cpu_plan(tiny_workload(), [(("actor",), 1), (("critic", "reference"), 1)]).to_json())
    for path in (split, tmp_path / "missing.json"):
        done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert done.stderr.startswith("runtime_calls.py: ")
