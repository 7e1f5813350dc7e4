"""Which calls open a Ray task on their workers (simulator.schedule.task_openers), as the executor's Dispatch sends
them: per algorithm and placement, hand-read from executor/roles.py (tests/test_dispatch.py holds the Dispatch)."""

from __future__ import annotations

import pytest

from hfplan.dataflow.registry import ROLLOUT
from hfplan.plan import colocated_plan
from hfplan.planner.search import search
from hfplan.planner.strategies import Rules
from hfplan.profiles.hardware import load_hardware
from hfplan.simulator.engine import simulate_plan
from hfplan.simulator.mapping import PlanCosts
from hfplan.simulator.schedule import task_openers
from hfplan.simulator.trace import trace
from hfplan.spec import BUILTIN_WORKLOADS, load_workload, make_cluster, workload_from_dict


def _openers(plan) -> list[str]:
    dag = trace(plan.workload)
    where = PlanCosts.of_plan(plan)
    return [dag.nodes[i].label for i in task_openers(dag, [where.set_of(n) for n in dag.nodes])]


def _placed(workload, rules):
    return search(workload, make_cluster(2, "cpu"), rules=rules).best


def test_ppo_on_one_set_opens_a_task_at_the_generation_the_first_forward_and_the_first_update():
    """The generation goes alone; the forwards wait until the reward's rule reads the generation (one task); the
    updates until the iteration's end, after the advantages."""
    assert _openers(colocated_plan(load_workload("demo"), 1, 1, 1, "cpu")) == [
        "actor.generate", "actor.log_prob", "critic.update"]


def test_grpo_and_remax_on_one_set():
    assert _openers(colocated_plan(load_workload("arith-grpo"), 1, 1, 1, "cpu")) == [
        "actor.generate", "actor.log_prob", "actor.update"]
    remax = workload_from_dict(dict(BUILTIN_WORKLOADS["demo"], algorithm="remax",
                                    models={r: BUILTIN_WORKLOADS["demo"]["models"][r]
                                            for r in ("actor", "reference", "reward")}), "demo-remax")
    # Both generations go alone; the forwards after them wait for the reward's read of the sampled responses.
    assert _openers(colocated_plan(remax, 1, 1, 1, "cpu")) == [
        "actor.generate", "actor.generate(greedy)", "actor.log_prob", "actor.update"]


def test_ppo_split_opens_a_task_on_each_set_and_a_rollout_set_s_generation_is_a_task_of_its_own():
    demo = load_workload("demo")
    rest = tuple(r for r in demo.model_roles if r != "actor")
    split = _placed(demo, Rules(name="split", placements=((("actor",), rest),)))
    assert _openers(split) == ["actor.generate", "actor.log_prob", "reference.log_prob", "critic.update",
                               "actor.update"]
    grpo = load_workload("arith-grpo")
    rollout = _placed(grpo, Rules(name="rollout", rollout=True,
                                  placements=((tuple(grpo.model_roles), (ROLLOUT,)),)))
    assert _openers(rollout) == ["actor.generate", "actor.log_prob", "actor.update"]


def test_a_call_opening_a_task_pays_the_opening_on_top_of_its_dispatch_and_the_calls_after_it_do_not(tmp_path):
    base = load_hardware("cpu")
    hw = base.model_copy(update={"runtime": base.runtime.model_copy(update={"task_dispatch_us": None,
                                                                            "rank_dispatch_us": 0.0,
                                                                            "controller_task_cpu_us": 0.0}),
                                 "compute": base.compute.model_copy(update={"idle_wake": None})})  # openings alone
    opened = hw.model_copy(update={"runtime": hw.runtime.model_copy(
        update={"task_dispatch_us": hw.runtime.call_dispatch_s() * 1e6 + 1000.0})})
    times = []
    for name, profile in (("same", hw), ("opened", opened)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(profile.model_copy(update={"name": name}).to_yaml())
        times.append(simulate_plan(colocated_plan(load_workload("demo"), 1, 1, 1, str(path))).timeline)
    spans = [{(s.role, s.op): s.end - s.start for s in t.spans if s.kind == "dispatch" and "->" not in s.op}
             for t in times]
    for key in spans[0]:
        grown = spans[1][key] - spans[0][key]
        assert grown == pytest.approx(1e-3 if key in {("actor", "generate"), ("actor", "log_prob"),
                                                       ("critic", "update")} else 0.0)
    # The first update waits for the controller's send, which already holds a task's opening: the sending side
    # less the opening is what its edge pays, so only the two calls the worker opens itself lengthen the iteration.
    assert times[1].iteration_s - times[0].iteration_s == pytest.approx(2e-3)


def test_remax_s_forwards_start_after_the_controller_scored_the_greedy_responses():
    """With a rule reward the controller scores the greedy responses itself before it makes the forwards: the
    log-prob starts no earlier than that score's end, the controller's send and its own dispatch."""
    demo = BUILTIN_WORKLOADS["demo"]
    remax = workload_from_dict(dict(demo, algorithm="remax", models={r: demo["models"][r]
                                                                      for r in ("actor", "reference", "reward")}),
                               "demo-remax")
    plan = colocated_plan(remax, 1, 1, 1, "cpu")
    spans = simulate_plan(plan).timeline.spans
    score = min((s for s in spans if (s.role, s.op, s.kind) == ("reward", "score", "compute")), key=lambda s: s.start)
    log_prob = next(s for s in spans if (s.role, s.op, s.kind) == ("actor", "log_prob", "compute"))
    assert log_prob.start >= score.end + load_hardware("cpu").runtime.controller_send_s() - 1e-9


def _with_controller_cpu(tmp_path, task_cpu_us: float) -> str:
    base = load_hardware("cpu")
    hw = base.model_copy(update={"name": f"ctl-{task_cpu_us:g}", "runtime": base.runtime.model_copy(
        update={"controller_task_cpu_us": task_cpu_us})})
    path = tmp_path / f"ctl-{task_cpu_us:g}.yaml"
    path.write_text(hw.to_yaml())
    return str(path)


def test_the_controller_s_cpu_shares_its_host_with_the_workers_there(tmp_path):
    """The controller computes its CPU of the iteration (per task it sends) on the first host from the iteration's
    start: two ranks beside it slow, more than one rank does (that one finds a core the controller leaves), and
    nothing slows without it."""
    demo = load_workload("demo")
    times = {}
    for dp in (1, 2):
        for cpu_us in (0.0, 2000.0):
            plan = colocated_plan(demo, 1, 1, dp, _with_controller_cpu(tmp_path, cpu_us))
            times[dp, cpu_us] = simulate_plan(plan).timeline.iteration_s
    one, two = times[1, 2000.0] - times[1, 0.0], times[2, 2000.0] - times[2, 0.0]
    assert 0 < one < two
    tasks = 3 * 2  # the generation, the forwards and the updates, one task per rank of two ranks
    # Two ranks and the controller on a host of parallelism p: each rank runs at slowdown(2) / slowdown(3) while
    # it computes; the iteration grows by less than the controller's whole CPU.
    assert two < tasks * 2000e-6
    unshared = load_hardware("a100-80g")
    where = PlanCosts(demo, [(tuple(demo.model_roles), 2)], {}, unshared.model_copy(update={
        "runtime": unshared.runtime.model_copy(update={"controller_task_cpu_us": 2000.0})}), 8)
    assert where.host_ranks() is None  # GPUs: the controller's CPU shares no cores with the work


def test_the_search_prices_the_controller_s_cpu_as_its_engine_does(tmp_path):
    """A search over a shared host checks its best choice on the simpy engine, which now holds the controller."""
    path = _with_controller_cpu(tmp_path, 2000.0)
    best = search(load_workload("demo"), make_cluster(2, path), top_k=1).best
    assert best.estimate.iteration_s == pytest.approx(simulate_plan(best).timeline.iteration_s)
