"""`hfplan execute` from the command line: bad input stops before any worker starts; the demo learns."""

from __future__ import annotations

import json
import re

import pytest

from hfplan.spec import make_cluster
from tests.execute_support import cpu_plan, tiny_workload
from tests.support import assert_user_error, invoke


@pytest.fixture
def demo_plan_file(tmp_path):
    result = invoke("search", "--workload", "demo", "--hardware", "cpu", "--gpus", 2, "--out", tmp_path / "demo.json",
                    "--no-compare")
    assert result.exit_code == 0, result.output
    return tmp_path / "demo.json"


def write_plan(tmp_path, plan) -> str:
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return str(path)


def test_gpu_plan_without_gpus(tmp_path):
    plan = cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 2)])
    plan = plan.model_copy(update={"cluster": make_cluster(8, "a100-80g")})
    assert_user_error(invoke("execute", write_plan(tmp_path, plan), "--out", tmp_path / "run"), "no CUDA device")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "needle"), [
    (["--set", "nope=1"], "unknown hyperparameter"),
    (["--set", "actor_lr=fast"], "actor_lr"),
    (["--data", "missing.jsonl"], "dataset not found"),
    (["--iterations", "0"], "--iterations"),
    (["--timeline", "chart.svg"], "timeline"),
])
def test_bad_options_are_one_line(demo_plan_file, tmp_path, args, needle):
    assert_user_error(invoke("execute", demo_plan_file, "--out", tmp_path / "run", *args), needle)
    assert not (tmp_path / "run").exists()


def test_dataset_without_prompt_column(demo_plan_file, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "hi"}) + "\n")
    assert_user_error(invoke("execute", demo_plan_file, "--data", data, "--out", tmp_path / "run"),
                      "has no 'prompt' field")


def test_missing_plan(tmp_path):
    assert_user_error(invoke("execute", tmp_path / "none.json"), "plan file not found")


def test_out_that_is_a_file(demo_plan_file, tmp_path):
    (tmp_path / "taken").write_text("x")
    assert_user_error(invoke("execute", demo_plan_file, "--out", tmp_path / "taken"), "not a folder")


@pytest.mark.slow
def test_demo_learns_at_its_default_iteration_count(demo_plan_file, tmp_path):
    """The README's CPU demo: the mean reward of the last 10 iterations beats the first 10's by >= 10%."""
    result = invoke("execute", demo_plan_file, "--out", tmp_path / "run", "--timeline", tmp_path / "run.png")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 40
    first, last = (sum(r["reward"] for r in part) / len(part) for part in (rows[:10], rows[-10:]))
    assert last >= 1.1 * first > 0, (first, last)
    shown = re.search(r"last 10 iterations: ([0-9.]+) vs ([0-9.]+)", result.output)
    assert shown and float(shown.group(1)) == pytest.approx(last, abs=1e-4)
    assert (tmp_path / "run.png").stat().st_size > 0
