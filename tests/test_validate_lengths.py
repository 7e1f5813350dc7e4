"""`hfplan validate` costs the plan with the run's measured response lengths (validation.run)."""

import pytest

from hfplan.simulator.engine import simulate_plan
from hfplan.validation.run import length_counts, with_prompt_len, with_response_lengths
from tests.support.executor_runs import cpu_plan, tiny_workload


def test_a_measured_length_is_taken_between_one_and_the_longest():
    assert length_counts([0, 1, 1, 21, 2], 16) == ((1, 3), (2, 1), (16, 1))


def test_the_simulation_is_costed_with_the_measured_lengths_even_after_the_plan_was_costed():
    """validate costs the plan first (to refuse one it cannot cost), which caches the workload's lengths; the copy
    costed with the measured ones must not keep that cache."""
    plan = cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 1)])
    longest = plan.workload.response_len
    before = simulate_plan(plan).estimate.iteration_s
    costed = with_response_lengths(plan, length_counts([1, 1, 1, 2, longest], longest))
    lengths = costed.workload.response_lengths
    assert [length for length, _ in lengths.points] == [1, 2, longest]
    assert [p for _, p in lengths.points] == pytest.approx([0.6, 0.2, 0.2])
    assert lengths.mean == pytest.approx((3 + 2 + longest) / 5)
    assert simulate_plan(costed).estimate.iteration_s < before


def test_the_simulation_is_costed_at_the_prompts_median_width_after_the_plan_was_costed():
    """The run pads each iteration's prompts to its longest (TextCodec.encode): validate costs the compared
    iterations' median width, on a copy that keeps no cached cost of the workload's prompt_len."""
    plan = cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 1)])
    before = simulate_plan(plan).estimate.iteration_s
    assert plan.workload.prompt_len == 8
    costed = with_prompt_len(plan, [3, 5, 5, 8])  # median 5
    assert costed.workload.prompt_len == 5
    assert costed.workload.model_dump(exclude={"prompt_len"}) == plan.workload.model_dump(exclude={"prompt_len"})
    assert simulate_plan(costed).estimate.iteration_s < before


def test_a_local_run_is_simulated_on_one_node_of_all_its_processes():
    """The executor's own Ray puts every worker on this machine: validate costs the plan on one node of all of
    them (a cpu plan of 3 or 4 processes is cut into nodes of the profile's 2 when searched)."""
    from hfplan.executor.controller import ExecuteOptions
    from hfplan.validation.run import on_this_machine

    models = {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": "rule:vowel-fraction"}
    workload = tiny_workload("ppo", models)
    for processes in (3, 4):
        plan = cpu_plan(workload, [(("actor", "reference"), processes - 1), (("critic",), 1)])
        assert plan.cluster.gpus_per_node == 2
        local = on_this_machine(plan)
        assert (local.cluster.gpus, local.cluster.gpus_per_node, local.cluster.nodes) == (processes, 4, 1)
        assert local.cluster.profile.name == "cpu"
        assert simulate_plan(local).estimate.iteration_s != simulate_plan(plan).estimate.iteration_s
    two = cpu_plan(workload, [(("actor", "reference"), 1), (("critic",), 1)])
    assert on_this_machine(two) is two
    assert ExecuteOptions().on_this_machine and ExecuteOptions(address="127.0.0.1:6379").on_this_machine
    assert not ExecuteOptions(address="10.0.0.7:6379").on_this_machine
