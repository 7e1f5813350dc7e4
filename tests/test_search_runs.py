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
    pytest.importorskip("torch")  # the pre-flight builds the executor's models
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



@pytest.mark.parametrize("name", ["ppo-qwen2.5-0.5b", "grpo-qwen2.5-0.5b"])
def test_best_plans_cap_their_engine_at_the_simulated_batch_without_changing_the_estimate(name):
    """The search writes the batch its simulation chose into gen.max_batch (so the executor runs those waves or
    slots): the cap is the largest batch of any generate call, and simulating without it gives the same time."""
    from hfplan.simulator import engine
    from hfplan.simulator.mapping import PlanCosts
    from hfplan.simulator.trace import trace

    workload = workload_from_dict(WORKLOADS[name], name)
    best = search(workload, make_cluster(4, "a100-80g"), top_k=1).top[0]
    generator = PlanCosts.of_plan(best).generator
    gen = best.parallelism[generator].gen
    assert gen.max_batch is not None and gen.max_batch >= 1
    par = best.parallelism[generator]
    uncapped = best.model_copy(update={"parallelism": {**best.parallelism, generator: par.model_copy(
        update={"gen": gen.model_copy(update={"max_batch": None})})}, "estimate": None})
    assert PlanCosts.of_plan(uncapped).engine_batch(trace(workload)) == gen.max_batch
    assert engine.simulate_plan(uncapped).estimate.iteration_s == pytest.approx(best.estimate.iteration_s, rel=1e-12)
