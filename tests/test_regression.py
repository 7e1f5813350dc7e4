"""The best plans of fixed searches, pinned before a refactoring that must not change them.

tests/data/regression_plans.json holds, for each case, the best plan's placement, parallelism and
iteration time as the search found them when the file was written. A change that alters search
semantics on purpose regenerates the file (`python tests/test_regression.py`) and says why.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from hfplan.planner.targets import get_target, search_target
from hfplan.spec import load_workload, make_cluster

DATA = Path(__file__).parent / "data" / "regression_plans.json"
# (workload, GPUs, target): the default workload at three sizes, one workload per algorithm, and a
# separate rollout engine (the OpenRLHF target), whose weight sync the schedule pays.
CASES = [("ppo-llama2-7b", 16, "hfplan"), ("ppo-llama2-7b", 64, "hfplan"), ("ppo-llama2-7b", 128, "hfplan"),
         ("grpo-qwen2.5-1.5b", 16, "hfplan"), ("remax-qwen2.5-1.5b", 16, "hfplan"),
         ("safe-rlhf-qwen2.5-0.5b", 8, "hfplan"), ("ppo-llama2-7b", 16, "openrlhf")]


def best_plan(workload: str, gpus: int, system: str) -> dict:
    spec = load_workload(workload)
    plan = search_target(get_target(system, spec), spec, make_cluster(gpus), top_k=1).best
    return {"placement": [{"models": g.models, "gpus": g.gpus} for g in plan.placement],
            "parallelism": {role: par.model_dump(mode="json") for role, par in plan.parallelism.items()},
            "iteration_s": plan.estimate.iteration_s}


def _key(workload: str, gpus: int, system: str) -> str:
    return f"{workload}@{gpus}" + ("" if system == "hfplan" else f"/{system}")


@pytest.mark.parametrize(("workload", "gpus", "system"), CASES, ids=[_key(*c) for c in CASES])
def test_best_plan_unchanged(workload, gpus, system):
    expected = json.loads(DATA.read_text())[_key(workload, gpus, system)]
    found = best_plan(workload, gpus, system)
    assert found["placement"] == expected["placement"]
    assert found["parallelism"] == expected["parallelism"]
    assert math.isclose(found["iteration_s"], expected["iteration_s"], rel_tol=1e-9)


if __name__ == "__main__":
    DATA.write_text(json.dumps({_key(*case): best_plan(*case) for case in CASES}, indent=1) + "\n")
    sys.stdout.write(f"wrote {DATA}\n")
