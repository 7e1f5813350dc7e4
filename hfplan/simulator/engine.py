"""The simpy engine: schedule a traced DAG on a mapping and produce its timeline.

It runs the schedule rule of hfplan.simulator.schedule (program order per set, inputs first, layout
switches at the switch points) with simpy events, and records every call, transfer and switch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import simpy

from hfplan.dataflow.ops import GENERATION, PHASES
from hfplan.errors import HfplanError
from hfplan.layout import ON_CONTROLLER, ROLLOUT, generating_role, kv_heads_per_rank, model_role
from hfplan.plan import EDGE, GREEDY_MARK, RESHARD_BACK_OP, WEIGHT_SYNC_OP, Estimate, Plan, Span, switch_op
from hfplan.profiles.hardware import HardwareProfile
from hfplan.simulator import costs
from hfplan.simulator.mapping import PlanCosts
from hfplan.simulator.memory import gib
from hfplan.simulator.pipeline import PREVIOUS, window_dag
from hfplan.simulator.schedule import Precedence, controller_fetches, switch_points, way_back_points
from hfplan.simulator.sharing import Ranks, SharedHosts
from hfplan.simulator.trace import Dag, Node, trace


@dataclass(frozen=True)
class Timeline:
    spans: tuple[Span, ...]
    tokens: int
    critical: tuple[tuple[str, float], ...] = ()  # (phase, seconds) of each call on the critical path

    @property
    def iteration_s(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.iteration_s if self.iteration_s > 0 else 0.0

    def stages(self) -> dict[str, float]:
        """Seconds of each phase along the critical path (a call's phase covers the call, its switch and
        the transfer it waited for last): they add up to the iteration. Every phase with calls is listed,
        at 0 when none of them is on the path."""
        present = {s.phase for s in self.spans if s.kind != "transfer"}
        out = {phase: 0.0 for phase in PHASES if phase in present}
        for phase, secs in self.critical:
            out[phase] = out.get(phase, 0.0) + secs
        return out

    def busy(self, sets: int) -> list[float]:
        """Seconds each set computes (calls, their dispatch and layout switches; transfers and the controller's
        sending excluded), by set index."""
        out = [0.0] * sets
        for s in self.spans:
            if s.set >= 0 and s.kind != "transfer" and not (s.kind == "dispatch" and EDGE in s.op):
                out[s.set] += s.end - s.start
        return out

    def estimate(self, peak_memory_gib: list[float], idle_gpus: int = 0) -> Estimate:
        return Estimate(iteration_s=self.iteration_s, tokens_per_s=self.tokens_per_s, stages=self.stages(),
                        busy_s=self.busy(len(peak_memory_gib)), idle_gpus=idle_gpus,
                        peak_memory_gib=peak_memory_gib, timeline=list(self.spans))


@dataclass(frozen=True)
class Scheduled:
    """One call with everything the engine needs: where it runs, how long, and the switch before it."""

    node: Node
    set: int
    seconds: float
    switch: float
    switch_role: str | None
    dispatch: float = 0.0  # the part of `seconds` that is the call's dispatch on its worker, drawn before it
    way_back: str | None = None  # the role whose hybrid engine goes back to training after this call's dispatch


def schedule(dag: Dag, plan_costs: PlanCosts) -> list[Scheduled]:
    """Durations and layout switches of every call, in program order, with the inputs that reach each one
    (schedule.controller_fetches)."""
    dag = controller_fetches(dag, [plan_costs.set_of(node) for node in dag.nodes])
    points = switch_points(dag, plan_costs.layout_role, generating_role(plan_costs.workload))
    backs = way_back_points(dag, plan_costs.layout_role, plan_costs.set_of, points)
    openings = plan_costs.task_openings(dag)
    out = []
    for node in dag.nodes:
        role = points.get(node.id)
        switch = plan_costs.switch_seconds(role) if role is not None else 0.0
        index = plan_costs.set_of(node)
        opening = openings[node.id]
        dispatch = costs.call_dispatch(plan_costs.hw) + opening if index >= 0 else 0.0
        out.append(Scheduled(node, index, plan_costs.node_seconds(node) + opening, switch, role, dispatch,
                             backs.get(node.id)))
    return out


EdgeSeconds = Callable[[int, int, float], float]
Wake = Callable[[float], float]  # idle seconds of a set before a call -> the call's extra seconds


@dataclass(frozen=True)
class Hosts:
    """Sets that share a host's cores (PlanCosts.host_ranks) and how much its ranks slow when all compute;
    `controller_s`: the controller's own CPU of the iteration (PlanCosts.controller_cpu_seconds), which it computes
    on its host from the iteration's start, beside the calls there (the previous iteration's results and report
    while the next generation runs, then the sends)."""

    ranks: Ranks
    slowdown: Callable[[int], float]
    controller_s: float = 0.0

    @classmethod
    def of(cls, plan_costs: PlanCosts, dag: Dag) -> Hosts | None:
        ranks = plan_costs.host_ranks()
        if ranks is None:
            return None
        controller = plan_costs.controller_cpu_seconds(dag) if ON_CONTROLLER in ranks else 0.0
        return cls(ranks, plan_costs.hw.compute.host_slowdown, controller)


def wake_of(plan_costs: PlanCosts) -> Wake | None:
    """The profile's cost of a call after its process idled (Compute.idle_wake), None where it has none."""
    compute = plan_costs.hw.compute
    return compute.wake_seconds if compute.idle_wake is not None else None


def run(dag: Dag, plan_costs: PlanCosts) -> Timeline:
    return run_calls(schedule(dag, plan_costs), plan_costs.edge_seconds, plan_costs.workload.tokens_per_iteration,
                     Hosts.of(plan_costs, dag), wake_of(plan_costs))


def run_pipelined(dag: Dag, plan_costs: PlanCosts) -> Timeline:
    """One steady-state iteration of an asynchronous plan (hfplan.simulator.pipeline): the window's calls on the
    simpy engine, their generate calls without the weight sync, which follows the window on the rollout set."""
    return run_window(schedule(dag, plan_costs), plan_costs.edge_seconds, plan_costs.workload.tokens_per_iteration,
                      Hosts.of(plan_costs, dag), wake_of(plan_costs))


def run_window(calls: Sequence[Scheduled], edge_seconds: EdgeSeconds, tokens: int, hosts: Hosts | None = None,
               wake: Wake | None = None) -> Timeline:
    """The pipelined window of calls costed for the synchronous schedule (their one layout switch, the weight
    sync before the first generation, moves to the window's end)."""
    window = window_dag(Dag("", tuple(c.node for c in calls)))
    rollout = next(c.set for c in calls if c.node.op == "generate")
    sync = sum(c.switch for c in calls)
    moved = [Scheduled(window.nodes[0], rollout, 0.0, 0.0, None)]
    moved += [Scheduled(node, c.set, c.seconds, 0.0, None, c.dispatch)
              for node, c in zip(window.nodes[1:], calls, strict=True)]
    ran = run_calls(moved, edge_seconds, tokens, hosts, wake)
    end = ran.iteration_s
    spans = [s for s in ran.spans if s.role != PREVIOUS]
    spans.append(Span(role=ROLLOUT, op=WEIGHT_SYNC_OP, phase=GENERATION, set=rollout, start=end, end=end + sync,
                      kind="transition"))
    return Timeline(tuple(spans), tokens, (*ran.critical, (GENERATION, sync)))


def run_calls(calls: Sequence[Scheduled], edge_seconds: EdgeSeconds, tokens: int, hosts: Hosts | None = None,
              wake: Wake | None = None) -> Timeline:
    """The simpy run of calls already costed: (source set, destination set, bytes) -> transfer seconds. `hosts`:
    sets that share a host's cores compute slower while they compute at once (sharing.py); None: each alone.
    `wake`: the seconds a call runs longer after its set idled so long before it (Compute.wake_seconds); a set's
    first call of the iteration follows its last of the previous one, so with `wake` the iteration runs twice, the
    second time with each set's idle tail of the first (the steady state)."""
    if wake is None:
        return _run_calls(calls, edge_seconds, tokens, hosts, None, {})[0]
    first, ends = _run_calls(calls, edge_seconds, tokens, hosts, wake, {})
    tails = {index: first.iteration_s - end for index, end in ends.items()}
    return _run_calls(calls, edge_seconds, tokens, hosts, wake, tails)[0]


def _run_calls(calls: Sequence[Scheduled], edge_seconds: EdgeSeconds, tokens: int, hosts: Hosts | None,
               wake: Wake | None, tails: dict[int, float]) -> tuple[Timeline, dict[int, float]]:
    """run_calls' one pass; `tails`: each set's idle seconds before the iteration starts. Also returns the end of
    each set's last call."""
    by_id = {c.node.id: c for c in calls}
    env = simpy.Environment()
    done = {c.node.id: env.event() for c in calls}
    spans: list[Span] = []
    elapsed = {}  # each call's seconds from its dispatch to its end (its switch included)
    shared = SharedHosts(env, hosts.ranks, hosts.slowdown) if hosts is not None else None
    ends: dict[int, float] = {}  # set -> end of its last call so far

    def work(index: int, seconds: float):
        if shared is not None and index in shared.ranks:
            yield from shared.compute(index, seconds)
        else:
            yield env.timeout(seconds)

    def transfer(src: Scheduled, dst: Scheduled, nbytes: float):
        yield done[src.node.id]
        seconds = edge_seconds(src.set, dst.set, nbytes)
        if seconds > 0:
            start = env.now
            yield env.timeout(seconds)
            # A field the controller sends travels with the call it feeds: the call's way out (sent, started).
            kind = "dispatch" if src.set == ON_CONTROLLER and dst.set >= 0 else "transfer"
            spans.append(Span(role=dst.node.role, op=f"{src.node.label}{EDGE}{dst.node.label}", phase=dst.node.phase,
                              set=dst.set, start=start, end=env.now, kind=kind))

    def call(c: Scheduled, previous_on_set: simpy.Event | None):
        arrivals = [env.process(transfer(by_id[e.src], c, e.nbytes)) for e in c.node.deps]
        if previous_on_set is not None:
            arrivals.append(previous_on_set)
        if arrivals:
            yield env.all_of(arrivals)
        begin = env.now
        if c.dispatch > 0:
            start = env.now
            yield from work(c.set, c.dispatch)
            spans.append(Span(role=c.node.role, op=c.node.op, phase=c.node.phase, set=c.set, start=start,
                              end=env.now, kind="dispatch"))
        if c.way_back is not None:
            # Where the executor's hybrid engine goes back to training, a generation stretch: priced with the way in
            # (the profile times the round trip), it takes no time here, but it closes generation's window after
            # this call's dispatch in both timelines.
            spans.append(Span(role=c.way_back, op=RESHARD_BACK_OP, phase=GENERATION, set=c.set, start=env.now,
                              end=env.now, kind="transition"))
        if c.switch > 0:
            start = env.now
            yield from work(c.set, c.switch)
            role = c.switch_role or c.node.role
            spans.append(Span(role=role, op=switch_op(role), phase=c.node.phase, set=c.set,
                              start=start, end=env.now, kind="transition"))
        start = env.now
        cold = 0.0
        if wake is not None and c.set >= 0:
            cold = wake(begin - ends[c.set] if c.set in ends else begin + tails.get(c.set, 0.0))
        yield from work(c.set, c.seconds - c.dispatch + cold)
        ends[c.set] = env.now
        spans.append(Span(role=c.node.role, op=c.node.op + (GREEDY_MARK if c.node.greedy else ""),
                          phase=c.node.phase, set=c.set, start=start, end=env.now))
        elapsed[c.node.id] = env.now - begin
        done[c.node.id].succeed()

    if shared is not None and hosts.controller_s > 0:
        env.process(shared.compute(ON_CONTROLLER, hosts.controller_s))  # its own CPU, drawn as no span
    last_on_set: dict[int, simpy.Event] = {}
    for c in calls:
        env.process(call(c, last_on_set.get(c.set)))
        last_on_set[c.set] = done[c.node.id]
    env.run()
    spans.sort(key=lambda s: (s.start, s.set, s.end))
    index = {c.node.id: i for i, c in enumerate(calls)}
    precedence = Precedence(tuple(c.set for c in calls), tuple(
        tuple((index[e.src], edge_seconds(by_id[e.src].set, c.set, e.nbytes)) for e in c.node.deps) for c in calls))
    path = precedence.critical_path([elapsed[c.node.id] for c in calls])
    return Timeline(tuple(spans), tokens, tuple((calls[i].node.phase, secs) for i, secs in path)), ends


def critical_path(dag: Dag, plan_costs: PlanCosts) -> float:
    """The iteration time the engine must reproduce, as the schedule rule's longest path (without simpy); where sets
    share a host's cores or a call after an idle wait costs more (Compute.idle_wake), a lower bound of it."""
    calls = schedule(dag, plan_costs)
    precedence = Precedence.of(dag, [c.set for c in calls], plan_costs.edge_seconds)
    return precedence.makespan([c.switch + c.seconds for c in calls])


@dataclass(frozen=True)
class Simulation:
    timeline: Timeline
    costs: PlanCosts
    estimate: Estimate


def unsplittable_kv_heads(plan: Plan) -> str | None:
    """Which layout's tp splits no model's KV heads (neither divides nor is a multiple of them): the cost
    model has no per-rank attention for it."""
    for role, par in plan.parallelism.items():
        arch = plan.workload.arch(model_role(plan.workload, role))
        for kind in ("train", "infer", "gen"):
            layout = getattr(par, kind)
            try:
                if layout is not None:
                    kv_heads_per_rank(arch.kv_heads, layout.tp)
            except ValueError as problem:
                return f"{role} {kind} layout: {problem}"
    return None


def simulate_plan(plan: Plan, hw: HardwareProfile | None = None) -> Simulation:
    """Trace the plan's algorithm and run it on the plan's mapping (on `hw` instead of the cluster's profile if
    given). Raises HfplanError when a layout's tp splits no KV heads or a set does not fit in memory."""
    problem = unsplittable_kv_heads(plan)
    if problem:
        raise HfplanError(f"plan cannot be costed: {problem}")
    plan_costs = PlanCosts.of_plan(plan, hw)
    reason = plan_costs.infeasible_reason
    if reason:
        raise HfplanError(f"plan does not fit: {reason}")
    dag = trace(plan.workload)
    timeline = run_pipelined(dag, plan_costs) if plan.workload.staleness else run(dag, plan_costs)
    idle = plan.cluster.gpus - sum(group.gpus for group in plan.placement)
    return Simulation(timeline, plan_costs, timeline.estimate([round(gib(m.peak), 3) for m in plan_costs.memory], idle))
