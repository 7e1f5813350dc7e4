"""Resume end to end: `hfplan execute` killed (SIGKILL) after a checkpoint and resumed gives the metrics of an
uninterrupted run; a checkpoint continues on another data-parallel size; the run exports its trained roles."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from hfplan.executor.resume import latest
from tests.support.executor_runs import PPO_TWO_RANKS_RUN, SAFE_RLHF_RUN, cpu_plan, safe_rlhf_plan, tiny_workload
from tests.support.processes import finish, run_cli, start_cli, stop_all, wait_for

pytestmark = pytest.mark.slow
SETS = [(("actor", "critic", "reference"), 2)]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def not_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.endswith("_s")}


def assert_same_metrics(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        x, y = not_timing(x), not_timing(y)
        assert x.keys() == y.keys()
        for key in x:
            assert y[key] == pytest.approx(x[key], rel=1e-6, abs=1e-6), (x["iteration"], key)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(cpu_plan(tiny_workload("ppo"), SETS).to_json())
    return path


@pytest.fixture(scope="module")
def whole_run(shared_runs):
    """PPO_TWO_RANKS_RUN: 4 iterations without interruption, a checkpoint every 2. test_execute reads the run
    too: a test that changes its folder works on a copy."""
    return shared_runs.get(cpu_plan(tiny_workload("ppo"), SETS), **PPO_TWO_RANKS_RUN).out


@pytest.fixture(scope="module")
def started(tmp_path_factory, plan_file, whole_run, ray_cluster, shared_runs) -> dict:
    """The module's runs of `hfplan execute` on the session's cluster, started together (their ranks fit in it
    side by side): most of such a run's seconds go to starting it (imports, connecting, its workers' imports,
    polls), which the runs overlap. Each test waits on its own: by name, the run's process, its folder and its
    metrics before it started. The shared runs they read are made first: the run killed at its second
    checkpoint must not run on meanwhile."""
    safe_rlhf = shared_runs.get(safe_rlhf_plan(), **SAFE_RLHF_RUN).out
    runs = {}
    try:
        folder = tmp_path_factory.mktemp("killed")
        runs["killed"] = (start_cli(folder / "log", "execute", plan_file, "--out", folder / "run", "--iterations", 4,
                                    "--checkpoint-every", 2, "--address", ray_cluster), folder / "run", [])
        # A copy of the whole run (4 iterations, 2 ranks) continues to 5 on one rank.
        folder = tmp_path_factory.mktemp("one-rank")
        one = folder / "one.json"
        one.write_text(cpu_plan(tiny_workload("ppo"), [(("actor", "critic", "reference"), 1)]).to_json())
        shutil.copytree(whole_run, folder / "run")
        runs["one rank"] = (start_cli(folder / "log", "execute", one, "--out", folder / "run", "--iterations", 5,
                                      "--resume", "--keep", 1, "--address", ray_cluster),
                            folder / "run", metrics(folder / "run"))
        # A copy of a Safe-RLHF run's first checkpoint (SAFE_RLHF_RUN: 3 iterations, a checkpoint after each, all
        # kept; test_execute reads the run too) resumed to its end.
        folder = tmp_path_factory.mktemp("safe-rlhf")
        (folder / "plan.json").write_text(safe_rlhf_plan().to_json())
        first = Path("checkpoints") / "iteration-000001"
        shutil.copytree(safe_rlhf / first, folder / "copy" / first)
        runs["safe-rlhf"] = (start_cli(folder / "log", "execute", folder / "plan.json", "--out", folder / "copy",
                                       "--iterations", 3, "--resume", "--address", ray_cluster),
                             folder / "copy", metrics(safe_rlhf))
        yield runs
    finally:
        for cli, *_ in runs.values():
            stop_all(cli)


def test_a_killed_run_resumes_to_the_metrics_of_an_uninterrupted_one(tmp_path, plan_file, whole_run, ray_cluster,
                                                                     started):
    cli, out, _ = started["killed"]
    try:
        wait_for(lambda: (out / "checkpoints" / "iteration-000002" / "manifest.json").is_file(), 300,
                 "checkpoint of iteration 2", cli)
        os.kill(cli.proc.pid, signal.SIGKILL)
        cli.wait(30)
    finally:
        stop_all(cli)
    assert latest(out).name == "iteration-000002"
    resumed = run_cli(tmp_path / "log2", "execute", plan_file, "--out", out, "--iterations", 4, "--resume",
                      "--address", ray_cluster)
    assert resumed.proc.returncode == 0, resumed.output()
    assert_same_metrics(metrics(whole_run), metrics(out))
    assert len(json.loads((out / "timeline.json").read_text())["iterations"]) == 4


def test_the_run_exports_its_actor_and_critic(whole_run):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    AutoModelForCausalLM.from_pretrained(whole_run / "hf" / "actor")
    AutoModelForTokenClassification.from_pretrained(whole_run / "hf" / "critic")
    assert [p.name for p in sorted((whole_run / "checkpoints").iterdir())] == ["iteration-000002", "iteration-000004"]


def test_a_two_rank_checkpoint_continues_on_one_rank(started):
    cli, out, before = started["one rank"]
    finish(cli)
    assert cli.proc.returncode == 0, cli.output()
    after = metrics(out)
    assert len(after) == 5 and after[:4] == before
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["iteration-000005"]


def test_safe_rlhf_resumes_with_its_multiplier(started):
    """A copy of a Safe-RLHF run's first checkpoint, resumed, ends with the run's own metrics (the multiplier too)."""
    cli, copy, rows = started["safe-rlhf"]
    finish(cli)
    assert cli.proc.returncode == 0, cli.output()
    assert rows[1]["lagrange"] != rows[2]["lagrange"]  # the multiplier moves: resuming it is seen
    assert_same_metrics(rows, metrics(copy))
    assert set(json.loads((copy / "checkpoints" / "iteration-000003" / "manifest.json").read_text())["heads"]) == {
        "actor", "critic", "cost_critic"}
