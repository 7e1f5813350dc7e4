"""The run folder's start-up breakdown (startup.json): every stage named, for the controller and every worker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfplan.executor.startup import STARTUP_FILE, WORKER_STAGES, StartupLog, process_start_time
from tests.support.executor_runs import ARITH_GRPO, cpu_plan, tiny_workload


def test_a_worker_s_stages_follow_one_another_on_the_controller_s_clock():
    log = StartupLog(origin=100.0)
    log.add_worker("set 1 rank 0", {"start": 12.0, "setup": 13.0, "imports": 15.0, "process group": 15.5,
                                    "models": 16.0}, 10.0)
    assert log.stages == [("set 1 rank 0 imports", 2.0, 5.0), ("set 1 rank 0 process group", 5.0, 5.5),
                          ("set 1 rank 0 models", 5.5, 6.0)]
    # imports done before the controller asked for the set-up: the wait between is no stage's
    later = StartupLog(origin=100.0)
    later.add_worker("set 0 rank 0", {"start": 12.0, "imports": 13.0, "setup": 14.0, "process group": 14.5,
                                      "models": 15.0}, 10.0)
    assert later.stages == [("set 0 rank 0 imports", 2.0, 3.0), ("set 0 rank 0 process group", 4.0, 4.5),
                            ("set 0 rank 0 models", 4.5, 5.0)]


def test_the_launch_is_this_process_s_start():
    launched = process_start_time()
    assert launched is not None  # Linux: /proc says
    now = time.time()
    assert now - 3600 < launched <= now  # this test process started within the hour, and before now
    assert StartupLog().origin == pytest.approx(launched, abs=1e-3)  # read again: the clocks tick between


CONTROLLER_CHECKS = """
import sys
import hfplan.cli
from hfplan.executor import controller, preflight
from tests.support.executor_runs import ARITH_GRPO, TINY_PPO, cpu_plan, tiny_workload
for workload in (tiny_workload("ppo", TINY_PPO), tiny_workload("grpo", ARITH_GRPO)):
    plan = cpu_plan(workload, [(workload.model_roles, 1)])
    checked = preflight.check(plan, controller.ExecuteOptions(out=controller.Path(sys.argv[1]) / "run"))
    ids = checked.encode(checked.prompts[:4])
    assert checked.decode_prompts(ids) and checked.decode_responses(ids, ids > 0)
print(sorted(name for name in ("torch", "transformers", "ray") if name in sys.modules))
"""


def test_the_controller_checks_and_encodes_before_the_workers_start_without_torch_or_transformers(tmp_path):
    """Start-up: the controller's work while Ray starts (every check, the tokenizer, the prompts) imports
    neither torch nor transformers, seconds of the cores Ray's processes start on."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", CONTROLLER_CHECKS, str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[]", done.stdout


@pytest.mark.slow
def test_a_run_itemises_its_start_up_in_the_run_folder(shared_runs):
    """test_execute's GRPO run on two sets."""
    plan = cpu_plan(tiny_workload("grpo", ARITH_GRPO), [(("actor",), 1), (("reference",), 1)])
    out = shared_runs.get(plan, iterations=2).out
    startup = json.loads((out / STARTUP_FILE).read_text())
    stages = [row["stage"] for row in startup["stages"]]
    workers = [f"set {index} rank 0 {stage}" for index in (0, 1) for stage in WORKER_STAGES]
    assert sorted(stages) == sorted(["command", "checks", "tokenizer", "ray start", "set 0 placement group",
                                     "set 1 placement group", "set 0 worker start", "set 1 worker start",
                                     "worker facts", "clock offsets", *workers])
    for row in startup["stages"]:
        assert set(row) == {"stage", "start_s", "end_s", "seconds"}
        assert row["seconds"] >= 0, row
    assert isinstance(startup["first_iteration_s"], float)
