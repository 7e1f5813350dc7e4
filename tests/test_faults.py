"""Failures of a running `hfplan execute`: a worker killed mid-run stops the run within seconds, naming its
role, set and rank, and leaves the last checkpoint loadable; a death on an idle set stops the wait on another.
(Ctrl-C: test_local_runs.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from hfplan.executor.errors import RunFailed
from hfplan.executor.export_model import export_checkpoint
from hfplan.executor.placement import DeathWatch, failure_namer
from hfplan.executor.resume import latest, read_checkpoint
from hfplan.executor.roles import WorkerSet
from tests.support.executor_runs import cpu_plan, tiny_workload
from tests.support.processes import start_cli, stop_all, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(cpu_plan(tiny_workload("ppo"), [(("actor", "critic", "reference"), 2)]).to_json())
    return path


def start_long_run(tmp_path, plan_file, *args):
    """A run of many iterations, a checkpoint after each; returns once the first one is complete."""
    out = tmp_path / "run"
    cli = start_cli(tmp_path / "log", "execute", plan_file, "--out", out, "--iterations", 200, "--checkpoint-every", 1,
                    *args)
    wait_for(lambda: latest(out) is not None, 300, "first checkpoint", cli)
    return cli, out


def test_a_killed_worker_stops_the_run_naming_its_set_and_rank(tmp_path, plan_file, ray_cluster):
    cli, out = start_long_run(tmp_path, plan_file, "--address", ray_cluster)
    try:
        pid = json.loads((out / "workers.json").read_text())["pids"]["set 0 rank 1"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        code = cli.wait(60)
        stopped_after = time.monotonic() - killed
    finally:
        stop_all(cli)
    output = cli.output()
    assert code == 1, output
    assert stopped_after < 20, stopped_after
    failure = next(line for line in output.splitlines() if line.startswith("run failed:"))
    assert "set 0 (actor+critic+reference), rank 1 died" in failure, failure
    assert "--resume" in output
    assert "raylet" not in output.lower(), output  # Ray's own report of the death goes to the run's Ray log
    last = latest(out)
    read_checkpoint(last)
    assert set(export_checkpoint(last, tmp_path / "hf")) == {"actor", "critic"}


def test_a_death_on_an_idle_set_stops_the_wait(ray_driver):
    import ray

    class Sleeper:  # stands for a set's worker (`clock` is what the watch calls); defined here, Ray ships it by value
        def clock(self) -> float:
            return time.time()

        def pid(self) -> int:
            return os.getpid()

        def sleep(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    remote = ray.remote(Sleeper)
    busy, idle = remote.remote(), remote.remote()
    sets: list = []
    watch = DeathWatch(sets, period_s=0.5)
    for index, (roles, worker) in enumerate([(("actor",), busy), (("critic", "reference"), idle)]):
        sets.append(WorkerSet(index, roles, [worker], failure_namer(index, roles, [worker], sets, watch)))
    try:
        pid = ray.get(idle.pid.remote(), timeout=60)
        with watch:
            waiting = busy.sleep.remote(120)
            threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
            started = time.monotonic()
            with pytest.raises(RunFailed) as failed:
                try:
                    ray.get(waiting, timeout=150)
                except ray.exceptions.RayError as failure:
                    raise RunFailed(sets[0].describe_failure("actor", "update", failure)) from failure
    finally:
        for worker in (busy, idle):  # the session's cluster outlives the test
            ray.kill(worker)
    assert time.monotonic() - started < 15
    assert str(failed.value) == ("the worker of set 1 (critic+reference), rank 0 died while actor.update ran on "
                                 "set 0")
