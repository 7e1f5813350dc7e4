"""What the executor's calls cost between their spans, read off a real run of it.

A probe plan (PPO on the demo's tiny models, shorter responses than the demo's, one device) is executed for a
few iterations in the profiler's Ray session, and its measured timelines give these Runtime fields:

- call_dispatch_us: the median gap between two calls of one Ray task on the set (the first call's outputs
  stored, the next one started and its arguments read: what the worker's wrapper costs each call). The simulator
  charges it inside every role call's span.
- task_dispatch_us: the median gap before a call that opens a Ray task with no controller step before it (the
  probe's log-prob call after its generation: Ray's switch between the worker's tasks, the new one's start, its
  arguments read), the calls that open one named by the simulator's rule (schedule.task_openers). The simulator
  charges the calls that open a task the difference on top.
- controller_call_us: the median gap around the controller's advantage step, from the end of the last call
  that feeds it to its start plus from its end to the start of the next call on the set (the results reach the
  controller, the calls that need the advantages are sent and started).
- controller_send_us: the median of that gap's second side alone (sent and started on an idle worker). The
  simulator charges an edge into the controller the round trip less its sending side, an edge out of it the
  sending side less a call's dispatch, and the call its dispatch: the gap in all.
- controller_step_us: the median seconds of that step itself, as the executor's controller runs it.
- rank_dispatch_us (where the profiled world has two devices): the probe again on one set of two ranks (data
  parallel), and the median spread between its ranks' starts of each Ray task the controller sent to both: the
  second rank's task reaches its worker that much after the first's, and the call ends that much later.
- controller_task_cpu_us: the controller's CPU (this process's, where the probe's controller runs) from the end
  of the first measured iteration to the end of the last, per iteration, less its own steps' and rules' spans,
  over the Ray tasks it sends an iteration (one per rank of each call that opens a task, schedule.task_openers).
- weight_sync_us (two devices as well): the probe with a separate rollout set beside the actor's, and the median
  of its weight syncs less what the simulator prices of them besides (the engines' cost per tensor, the bytes'
  transfer), taken once those are fitted (runtime.fit_runtime): what moving the buckets through Ray's object
  store and the controller costs.

On a CPU profile it also gives memory.worker_resident_gib: the worker's measured peak (resident memory less Ray's
object store's shared pages, executor.host_memory) less the simulator's peak for the probe plan (what a worker
process holds beyond the model states the simulator counts: the interpreter, torch, Ray's buffers of its calls).

Measured through the executor rather than through a bare Ray actor, because a bare actor's round trip left out
the controller's bookkeeping and the worker's wrapper (validate found such gaps 2-4x the bare figure).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hfplan.measure import typical
from hfplan.plan import RESHARD_BACK_OP, WEIGHT_SYNC_OP, Plan, Span, colocated_plan
from hfplan.profiles.hardware import HardwareProfile, Runtime
from hfplan.spec import BUILTIN_WORKLOADS, Workload, make_cluster, workload_from_dict

# The Runtime fields it measures.
CALL_FIELDS = ("call_dispatch_us", "task_dispatch_us", "controller_call_us", "controller_step_us", "controller_send_us",
               "rank_dispatch_us", "weight_sync_us", "controller_task_cpu_us")
PROBE_ITERATIONS = 8  # the first a warm-up
ADVANTAGE_STEP = ("controller", "gae")  # the controller step whose gaps are read (PPO's)


@dataclass(frozen=True)
class CallGaps:
    call_dispatch_s: float
    controller_call_s: float
    controller_step_s: float
    controller_send_s: float
    worker_resident_gib: float | None = None  # on a CPU profile; None on a GPU (its peak is allocated memory)
    rank_dispatch_s: float | None = None  # None: not measured (a world of one device)
    # The separate-rollout probe's median weight sync (None: not measured) and that plan, to price the rest of it.
    weight_sync_s: float | None = None
    weight_sync_plan: Plan | None = None
    task_dispatch_s: float | None = None  # None: no call opened a task after another call with nothing between
    controller_task_cpu_s: float | None = None  # None: not measured


def probe_workload() -> Workload:
    """PPO on the demo's models and batch, with 8-token responses (the gaps do not depend on the length)."""
    return workload_from_dict(dict(BUILTIN_WORKLOADS["demo"], response_len=8), "call-gap-probe")


def _probe_hardware(profile: HardwareProfile, folder: Path) -> str:
    """`profile` as a file, its rates fitted, its runtime not yet (a probe plan only has to run, on the device
    kind the profile names)."""
    path = folder / "probe-hardware.yaml"
    path.write_text(profile.model_copy(update={"runtime": Runtime()}).to_yaml())
    return str(path)


def probe_plan(profile: HardwareProfile, folder: Path) -> Plan:
    """The search's plan for the probe on one device of `profile`."""
    from hfplan.planner.search import search

    return search(probe_workload(), make_cluster(1, _probe_hardware(profile, folder))).best


def spread_probe_plan(profile: HardwareProfile, folder: Path) -> Plan:
    """The probe on one set of two devices, every role data parallel over both."""
    return colocated_plan(probe_workload(), 1, 1, 2, _probe_hardware(profile, folder))


def rollout_probe_plan(profile: HardwareProfile, folder: Path) -> Plan:
    """The search's plan for the probe with every model role on one device and a separate rollout set on another."""
    from hfplan.dataflow.registry import ROLLOUT
    from hfplan.planner.search import search
    from hfplan.planner.strategies import Rules

    workload = probe_workload()
    rules = Rules(name="rollout probe", rollout=True, placements=((tuple(workload.model_roles), (ROLLOUT,)),))
    return search(workload, make_cluster(2, _probe_hardware(profile, folder)), rules=rules).best


def weight_sync(iterations: Sequence[Sequence[Span]]) -> float:
    """The median weight sync of the measured iterations (one transition span each)."""
    syncs = [s.end - s.start for spans in iterations for s in spans if s.op == WEIGHT_SYNC_OP]
    if not syncs:
        raise ValueError("the rollout probe recorded no weight sync")
    return typical(syncs)


def _openers(plan: Plan) -> list[tuple[tuple[str, str], int]]:
    """(role, op) and ranks of each call of `plan` that opens a Ray task on its workers (PlanCosts.opening_tasks)."""
    from hfplan.simulator.mapping import PlanCosts
    from hfplan.simulator.trace import trace

    dag = trace(plan.workload)
    return [((dag.nodes[i].role, dag.nodes[i].op), ranks) for i, ranks in PlanCosts.of_plan(plan).opening_tasks(dag)]


def opening_calls(plan: Plan) -> frozenset[tuple[str, str]]:
    """(role, op) of the calls of `plan` that open a Ray task on their workers."""
    return frozenset(label for label, _ in _openers(plan))


def tasks_per_iteration(plan: Plan) -> int:
    """The Ray tasks the controller sends in one iteration of `plan`: one per rank of each call that opens one."""
    return sum(ranks for _, ranks in _openers(plan))


def controller_task_cpu(cpu_at_ends: Sequence[float], iterations: Sequence[Sequence[Span]], tasks: int) -> float:
    """The controller's CPU per task sent: its CPU seconds between the ends of the first and the last measured
    iteration (`cpu_at_ends`, one reading at each iteration's end), per iteration, less its own compute spans (its
    steps and rules, which the simulator prices as calls), over `tasks` tasks an iteration."""
    if len(cpu_at_ends) < 2 or tasks < 1:
        raise ValueError("the controller's CPU needs two measured iterations and a task sent in each")
    per_iteration = (cpu_at_ends[-1] - cpu_at_ends[0]) / (len(cpu_at_ends) - 1)
    own = typical([sum(s.end - s.start for s in spans if s.set < 0 and s.kind == "compute") for spans in iterations])
    return max(0.0, per_iteration - own) / tasks


def _calls(spans: Sequence[Span]) -> list[tuple[float, float, tuple[str, str]]]:
    """(start, end, (role, op)) of each call on the sets, in order: a call begins with its input transfer span (the
    worker records one first for every call), or with the hybrid engine's way back that its worker runs first, and
    ends with the last span before the next call's."""
    ordered = sorted((s for s in spans if s.set >= 0), key=lambda s: (s.start, s.end))
    calls: list[list] = []
    for span in ordered:
        if span.kind == "transfer" and calls and calls[-1][2] is None:  # the call the way back opened
            calls[-1][1], calls[-1][2] = span.end, (span.role, span.op)
        elif span.op == RESHARD_BACK_OP:
            calls.append([span.start, span.end, None])
        elif span.kind == "transfer" or not calls:
            calls.append([span.start, span.end, (span.role, span.op)])
        else:
            calls[-1][1] = max(calls[-1][1], span.end)
    return [(start, end, label) for start, end, label in calls]


def gaps_of(spans: Sequence[Span], openers: frozenset[tuple[str, str]] = frozenset()
            ) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """One iteration's gaps between two calls of one task, gaps before a call opening a task (`openers`: their
    (role, op)) with no controller step between, gaps around the advantage step (one figure: both sides), their
    sending sides and the step's seconds. Spans of one set on one rank (the probe's single device)."""
    calls = _calls(spans)
    controller = [s for s in spans if s.set < 0 and s.kind == "compute"]
    queued, opened = [], []
    for before, after in zip(calls, calls[1:], strict=False):
        if not any(c.start < after[0] and c.end > before[1] for c in controller):
            (opened if after[2] in openers else queued).append(after[0] - before[1])
    around, sends, steps = [], [], []
    for step in (s for s in controller if (s.role, s.op) == ADVANTAGE_STEP):
        fed = [end for _, end, _ in calls if end <= step.start]
        next_starts = [start for start, _, _ in calls if start >= step.end]
        if fed and next_starts:
            sends.append(min(next_starts) - step.end)
            around.append((step.start - max(fed)) + sends[-1])
            steps.append(step.end - step.start)
    return queued, opened, around, sends, steps


def call_gaps(iterations: Sequence[Sequence[Span]], openers: frozenset[tuple[str, str]] = frozenset()) -> CallGaps:
    """The medians over the measured iterations."""
    queued, opened, around, sends, steps = [], [], [], [], []
    for spans in iterations:
        q, o, a, sent, s = gaps_of(spans, openers)
        queued += q
        opened += o
        around += a
        sends += sent
        steps += s
    if not queued or not around:
        raise ValueError("the probe's timeline has no queued calls or no advantage step between calls")
    return CallGaps(typical(queued), typical(around), typical(steps), typical(sends),
                    task_dispatch_s=typical(opened) if opened else None)


def rank_dispatch(iterations: Sequence[Sequence[float]]) -> float:
    """The median start spread of the measured iterations' tasks on two ranks (IterationReport.rank_start_spreads)."""
    spreads = [spread for spreads in iterations for spread in spreads]
    if not spreads:
        raise ValueError("the two-rank probe recorded no task sent to both ranks")
    return typical(spreads)


def _run_probe(plan: Plan, out: Path) -> tuple[list, object, list[float]]:
    """The measured iterations' reports (the first, a warm-up, left out), the run's summary, and this process's CPU
    seconds at the end of each measured iteration (the controller runs here)."""
    import time

    from hfplan.executor.controller import ExecuteOptions, execute

    reports: list = []
    cpu: list[float] = []

    def keep(report) -> None:
        cpu.append(time.process_time())
        reports.append(report)

    options = ExecuteOptions(iterations=PROBE_ITERATIONS, out=out, call_timeout_s=300, start_timeout_s=300)
    summary = execute(plan, options, keep)
    return reports[1:], summary, cpu[1:]


def measure_call_gaps(profile: HardwareProfile, ranks: int = 1) -> CallGaps:
    """Execute the probe plan in the Ray session this process holds and read its gaps (and, on CPU, the
    worker's own resident memory); with `ranks` >= 2 (the session has room for two workers), the two-rank probe
    too."""
    from hfplan.simulator.engine import simulate_plan

    with tempfile.TemporaryDirectory(prefix="hfplan-profile-probe-") as folder:
        plan = probe_plan(profile, Path(folder))
        reports, summary, cpu = _run_probe(plan, Path(folder) / "run-one-rank")
        spans = [r.spans for r in reports]
        gaps = dataclasses.replace(call_gaps(spans, opening_calls(plan)),
                                   controller_task_cpu_s=controller_task_cpu(cpu, spans, tasks_per_iteration(plan)))
        if ranks >= 2:
            spread_reports, _, _ = _run_probe(spread_probe_plan(profile, Path(folder)),
                                              Path(folder) / "run-two-ranks")
            gaps = dataclasses.replace(gaps, rank_dispatch_s=rank_dispatch([r.rank_start_spreads
                                                                            for r in spread_reports]))
            synced = rollout_probe_plan(profile, Path(folder))
            sync_reports, _, _ = _run_probe(synced, Path(folder) / "run-rollout")
            gaps = dataclasses.replace(gaps, weight_sync_s=weight_sync([r.spans for r in sync_reports]),
                                       weight_sync_plan=synced)
        if not profile.on_host:
            return gaps
        measured_gib = max(summary.peak_memory_bytes.values()) / 2**30
        predicted_gib = simulate_plan(plan).estimate.peak_memory_gib[0]
    return dataclasses.replace(gaps, worker_resident_gib=max(0.0, measured_gib - predicted_gib))
