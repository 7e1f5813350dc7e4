"""Where the hybrid engine goes back to its training layout (simulator.schedule.way_back_points), hand-read from
executor/runtime.py's leave_generation_before: at the start of the first call on the actor's set after its
generation calls. The simulator draws it there (priced with the way in) and validate counts the two as one."""

from __future__ import annotations

from hfplan.dataflow.registry import ROLLOUT
from hfplan.plan import RESHARD_BACK_OP, RESHARD_OP, Span, colocated_plan, phase_seconds
from hfplan.planner.search import search
from hfplan.planner.strategies import Rules
from hfplan.simulator.engine import simulate_plan
from hfplan.simulator.mapping import PlanCosts
from hfplan.simulator.schedule import switch_points, way_back_points
from hfplan.simulator.trace import trace
from hfplan.spec import BUILTIN_WORKLOADS, load_workload, make_cluster, workload_from_dict
from hfplan.validation.compare import call_keys


def _way_backs(plan) -> dict[str, str]:
    dag, where = trace(plan.workload), PlanCosts.of_plan(plan)
    switches = switch_points(dag, where.layout_role, "actor")
    points = way_back_points(dag, where.layout_role, where.set_of, switches)
    return {dag.nodes[i].label: role for i, role in points.items()}


def _remax():
    demo = BUILTIN_WORKLOADS["demo"]
    return workload_from_dict(dict(demo, algorithm="remax",
                                   models={r: demo["models"][r] for r in ("actor", "reference", "reward")}), "rx")


def test_the_way_back_runs_before_the_first_call_on_the_set_after_the_generations():
    assert _way_backs(colocated_plan(load_workload("demo"), 1, 1, 1, "cpu")) == {"actor.log_prob": "actor"}
    # ReMax's greedy generation is one more generation call: the engine goes back only after it.
    assert _way_backs(colocated_plan(_remax(), 1, 1, 1, "cpu")) == {"actor.log_prob": "actor"}
    demo = load_workload("demo")
    rest = tuple(r for r in demo.model_roles if r != "actor")
    split = search(demo, make_cluster(2, "cpu"), rules=Rules(name="split", placements=((("actor",), rest),))).best
    assert _way_backs(split) == {"actor.log_prob": "actor"}


def test_a_rollout_engine_never_goes_back():
    grpo = load_workload("arith-grpo")
    rollout = search(grpo, make_cluster(2, "cpu"), rules=Rules(name="rollout", rollout=True, placements=(
        (tuple(grpo.model_roles), (ROLLOUT,)),))).best
    assert _way_backs(rollout) == {}


def test_the_simulated_generation_window_closes_after_the_next_calls_dispatch():
    """The executor's way back runs once the next call's task has reached the worker, and it is generation's: the
    simulated timeline marks it there, so its generation stage spans that call's dispatch, as a measured one does."""
    spans = simulate_plan(colocated_plan(load_workload("arith-grpo"), 1, 1, 2, "cpu")).estimate.timeline
    back = [s for s in spans if s.op == RESHARD_BACK_OP]
    assert len(back) == 1 and back[0].start == back[0].end and back[0].phase == "generation"
    dispatch = next(s for s in spans if s.kind == "dispatch" and s.role == "actor" and s.op == "log_prob")
    generate = next(s for s in spans if s.op == "generate" and s.kind == "compute")
    assert back[0].start == dispatch.end > generate.end
    first = min(s.start for s in spans if s.phase == "generation" and s.kind != "dispatch")
    assert phase_seconds(spans)["generation"] == back[0].end - first


def test_validate_counts_the_way_back_with_the_way_in():
    def span(op, start, end, phase="generation", kind="transition"):
        return Span(role="actor", op=op, phase=phase, set=0, start=start, end=end, kind=kind)

    keys = call_keys([span(RESHARD_OP, 0.0, 2.0), span("generate", 2.0, 5.0, kind="compute"),
                      span(RESHARD_BACK_OP, 6.0, 6.5), span(RESHARD_OP, 10.0, 11.0)])
    assert keys[(0, "actor", RESHARD_OP, "generation", "transition", 0)] == 2.5
    assert keys[(0, "actor", RESHARD_OP, "generation", "transition", 1)] == 1.0
    assert not any(key[2] == RESHARD_BACK_OP for key in keys)
    # A way back with no way in before it (a timeline cut after the switch) stays a figure of its own.
    assert call_keys([span(RESHARD_BACK_OP, 0.0, 0.5)]) == {(0, "actor", RESHARD_BACK_OP, "generation", "transition",
                                                             0): 0.5}
