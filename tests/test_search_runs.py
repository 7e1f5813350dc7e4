"""One rule for what runs: every best plan the search returns on the `cpu` profile passes `hfplan execute`'s
pre-flight (hfplan.layout's rule, which the search space consults, and the executor's own checks)."""

from __future__ import annotations

import json

import pytest

from hfplan.errors import HfplanError
from hfplan.executor import preflight
from hfplan.executor.controller import ExecuteOptions
from hfplan.planner.search import search
from hfplan.spec import BUILTIN_WORKLOADS, make_cluster, workload_from_dict

SMALL = {"prompt_len": 64, "response_len": 64, "batch_prompts": 8, "mini_batches": 2}
WORKLOADS = {
    "demo": BUILTIN_WORKLOADS["demo"],
    "arith-grpo": BUILTIN_WORKLOADS["arith-grpo"],
    "ppo-qwen2.5-0.5b": BUILTIN_WORKLOADS["ppo-qwen2.5-0.5b"] | SMALL,
    "grpo-qwen2.5-0.5b": BUILTIN_WORKLOADS["grpo-qwen2.5-0.5b"] | SMALL | {"batch_prompts": 4},
}
GPUS = (1, 2, 3, 4, 8)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_best_plan_on_the_cpu_profile_passes_the_pre_flight(name, tmp_path):
    workload = workload_from_dict(WORKLOADS[name], name)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(8)))
    found = 0
    for gpus in GPUS:
        try:
            plans = search(workload, make_cluster(gpus, "cpu"), top_k=1).top
        except HfplanError as error:
            assert "no plan fits" in str(error), (gpus, str(error))  # too small a cluster, said so
            continue
        found += 1
        preflight.check(plans[0], ExecuteOptions(iterations=1, data=str(data)))
    assert found > 0

