"""The plan's rollout engine (gen.engine: torch | vllm), `hfplan execute --rollout`, and the one line a plan that
generates with vLLM gets where vLLM is missing. None of these needs vLLM installed."""

from __future__ import annotations

import importlib.util

import pytest

from hfplan.errors import HfplanError
from hfplan.plan import GenConfig
from tests.support.cli import assert_user_error, invoke
from tests.test_plan import valid_plan


def test_a_vllm_engine_keeps_a_paged_kv_cache_and_batches_continuously():
    assert GenConfig(engine="vllm").kv_cache == "paged" and GenConfig(engine="vllm").batching == "continuous"
    assert GenConfig().engine == "torch" and GenConfig().kv_cache == "reserved"
    # plans written before the field: a paged cache was vLLM's
    assert GenConfig(batching="continuous", kv_cache="paged").engine == "vllm"
    with pytest.raises(ValueError, match="engine=torch keeps a reserved KV cache"):
        GenConfig(batching="continuous", kv_cache="paged", engine="torch")
    with pytest.raises(ValueError, match="kv_cache=paged needs batching=continuous"):
        GenConfig(engine="vllm", batching="static")
    with pytest.raises(ValueError, match="gpu_memory_utilization is vLLM's"):
        GenConfig(gpu_memory_utilization=0.5)
    assert GenConfig(engine="vllm", gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5


def test_the_rollout_option_puts_every_generation_layout_on_that_engine():
    from hfplan.plan import plan_from_dict

    plan = plan_from_dict(valid_plan(), "test")
    vllm = plan.with_rollout_engine("vllm")
    gen = vllm.parallelism["actor"].gen
    assert gen.gpu_memory_utilization is None and vllm.estimate is None  # vLLM's default: nothing costed it
    assert (gen.engine, gen.kv_cache, gen.batching, gen.tp, gen.dp) == ("vllm", "paged", "continuous", 1, 4)
    back = vllm.with_rollout_engine("torch").parallelism["actor"].gen
    assert (back.engine, back.kv_cache, back.batching) == ("torch", "reserved", "continuous")
    assert vllm.parallelism["critic"] == plan.parallelism["critic"]
    with pytest.raises(HfplanError, match="--rollout sglang: use torch or vllm"):
        plan.with_rollout_engine("sglang")


def test_a_plan_generating_with_vllm_where_it_is_missing_gets_one_line_naming_the_extra(tmp_path, monkeypatch,
                                                                                          demo_plan_file):
    """vLLM hidden from this process (its import spec): execute refuses before starting anything, exit 2."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    result = invoke("execute", demo_plan_file, "--rollout", "vllm", "--out", tmp_path / "run")
    assert_user_error(result, "parallelism.actor.gen.engine is vllm but vLLM is not installed", "'.[vllm]'",
                      "--rollout torch")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("target", ["verl", "openrlhf"])
def test_the_exports_give_vllm_the_kv_cache_room_the_plan_was_costed_with(target_plans, target):
    """vLLM's KV cache is capacity x gpu_memory_utilization less its own weights and activations (vLLM 0.32's
    worker): with the exported fraction that is the generating set's KV budget, to within the rounding. The plan is
    `hfplan search --gpus 16 --target X`'s (conftest's target_plans)."""
    from hfplan.plan import load_plan
    from hfplan.profiles.hardware import GIB
    from hfplan.simulator import memory
    from hfplan.simulator.mapping import PlanCosts

    plan = load_plan(target_plans[target])
    role = plan.generation_role
    par = plan.parallelism[role]
    # the room as costed: the set's free memory, before the fraction written into the plan caps it
    unset = plan.model_copy(update={"parallelism": plan.parallelism | {role: par.model_copy(
        update={"gen": par.gen.model_copy(update={"gpu_memory_utilization": None})})}})
    costs = PlanCosts.of_plan(unset)
    fraction = costs.vllm_memory_utilization()
    assert par.gen.gpu_memory_utilization == fraction  # the search wrote it
    key = "actor_rollout_ref.rollout.gpu_memory_utilization=" if target == "verl" else "--vllm.gpu_memory_utilization "
    assert f"{key}{fraction}" in invoke("export", target_plans[target], "--to", target).stdout
    hw, gen = plan.cluster.profile, plan.parallelism[plan.generation_role].gen
    arch = plan.workload.arch("actor")
    weights = hw.compute.value_bytes * arch.params("lm") / gen.tp
    # vLLM's profile run: a forward of the device's max_num_batched_tokens, the sampler's logits of its sequences
    activations = memory.vllm_working_bytes(arch, gen, hw.runtime.vllm_batched_tokens,
                                            gen.max_batch or -(-plan.workload.sequences // gen.dp),
                                            hw.compute.value_bytes)
    capacity = hw.memory.capacity_gib * GIB
    kv_room = fraction * capacity - weights - activations
    budget = costs.memory[plan.set_of(role)].kv_budget
    assert budget - capacity / 1000 < kv_room <= budget
    assert 0 < fraction < 1
    # the simulator reads the plan's fraction: the KV cache gets what it leaves vLLM, and a smaller one less
    assert PlanCosts.of_plan(plan).memory[plan.set_of(role)].kv_budget == pytest.approx(kv_room)
    half = plan.model_copy(update={"parallelism": plan.parallelism | {role: par.model_copy(
        update={"gen": par.gen.model_copy(update={"gpu_memory_utilization": fraction / 2})})}})
    assert PlanCosts.of_plan(half).memory[plan.set_of(role)].kv_budget == pytest.approx(
        fraction / 2 * capacity - weights - activations)


def test_the_search_offers_vllm_where_asked_and_an_unknown_engine_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = ("search", "--workload", "arith-grpo", "--hardware", "cpu", "--gpus", 1, "--no-compare", "--out")
    assert invoke(*common, "t.json").exit_code == 0
    assert invoke(*common, "v.json", "--rollout-engines", "vllm").exit_code == 0
    from hfplan.plan import load_plan

    assert load_plan("t.json").parallelism["actor"].gen.engine == "torch"
    vllm = load_plan("v.json").parallelism["actor"].gen
    assert (vllm.engine, vllm.kv_cache, vllm.batching) == ("vllm", "paged", "continuous")
    assert_user_error(invoke(*common, "x.json", "--rollout-engines", "torch,sglang"),
                      "--rollout-engines torch,sglang", "torch, vllm")
