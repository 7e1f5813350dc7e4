"""Execute a plan, simulate the same plan with the run's response lengths, and compare the two."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hfplan.errors import HfplanError
from hfplan.measure import typical
from hfplan.plan import Plan, Span
from hfplan.spec import HistogramBin
from hfplan.validation import machine
from hfplan.validation.compare import Comparison, compare

GIB = 2**30


@dataclass(frozen=True)
class Validation:
    comparison: Comparison
    plan: Plan  # the plan as simulated: the profile and the measured response lengths filled in
    simulated: list[Span]
    measured: list[Span]  # the last measured iteration, from 0
    # The compared iterations' sampled response lengths: (tokens, responses) by length, what the plan is costed with.
    response_len_counts: tuple[tuple[int, int], ...]
    other_cpu_cores: float | None = None  # CPU other processes used during the compared iterations (machine.py)
    pace: machine.Pace | None = None  # the machine's speed around the run against the profile's (machine.py)
    # The median spread between the first and last rank's start of the compared iterations' tasks sent to every
    # rank of a multi-rank set (None: no such set), beside what the simulator charges per rank past the first.
    rank_start_spread_s: float | None = None

    @property
    def response_len_mean(self) -> float:
        return self.plan.workload.response_lengths.mean


def with_profile(plan: Plan, profile: Path | None) -> Plan:
    """The plan costed on `profile` (a profile YAML) instead of the hardware it names."""
    if profile is None:
        return plan
    if not profile.is_file():
        raise HfplanError(f"--profile {profile}: file not found")
    from hfplan.profiles.hardware import load_hardware

    load_hardware(str(profile))  # a bad profile fails here, before any worker starts
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"hardware": str(profile)})})


def on_this_machine(plan: Plan) -> Plan:
    """The plan as a run that starts its own Ray places it: every process on this machine, one node of them all
    (the plan's cluster may describe several nodes; the local run shares one host's cores or GPUs' links)."""
    gpus_per_node = 1 << (plan.cluster.gpus - 1).bit_length()  # Cluster's nodes are a power of two: one partial
    if gpus_per_node <= plan.cluster.gpus_per_node:
        return plan
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpus_per_node": gpus_per_node})})


def length_counts(lengths: Sequence[int], longest: int) -> tuple[tuple[int, int], ...]:
    """(tokens, responses) for each measured response length, each taken between 1 and `longest` (the workload's
    response_len: a response whose first token ended it still holds that token, sampled from its prefill)."""
    return tuple(sorted(Counter(min(longest, max(1, int(length))) for length in lengths).items()))


def with_response_lengths(plan: Plan, counts: Sequence[tuple[int, int]]) -> Plan:
    """The plan's workload with responses of the measured lengths, as a histogram: a static batch is costed at the
    expected longest of its draws and a continuous one at their mean square (spec.ResponseLengths), where a mean
    alone would cost a static batch at response_len."""
    histogram = [HistogramBin(length=length, weight=float(count)) for length, count in counts]
    workload = plan.workload.model_copy(update={"response_len_mean": None, "response_len_histogram": histogram})
    return plan.model_copy(update={"workload": workload})


def with_prompt_len(plan: Plan, widths: Sequence[int]) -> Plan:
    """The plan's workload with the prompt length the run padded its prompts to: each iteration's prompts are as
    wide as its longest (TextCodec.encode, at most prompt_len), costed at the compared iterations' median width."""
    workload = plan.workload.model_copy(update={"prompt_len": max(1, round(typical(widths)))})
    return plan.model_copy(update={"workload": workload})


def from_zero(spans: Sequence[Span]) -> list[Span]:
    origin = min((s.start for s in spans), default=0.0)
    return [s.model_copy(update={"start": s.start - origin, "end": s.end - origin}) for s in spans]


def peak_gib_per_set(peak_bytes: dict[str, int], sets: int) -> list[float]:
    """The highest peak of any rank of each set ("set S rank R" -> bytes), in GiB."""
    peaks = [0.0] * sets
    for name, value in peak_bytes.items():
        index = int(name.split()[1])
        peaks[index] = max(peaks[index], value / GIB)
    return peaks


def predicted_gib(plan: Plan, peak_gib: Sequence[float]) -> list[float]:
    """What the measured peak per device is compared with: the plan's peak per GPU, and on a CPU profile, where
    the executor measures a worker's resident set, the worker process's own resident memory beside it."""
    memory = plan.cluster.profile.memory
    base = memory.worker_resident_gib if plan.cluster.profile.on_host else 0.0
    return [gib + base for gib in peak_gib]


def validate(plan: Plan, options, labels: Sequence[str],
             on_iteration: Callable[[object], None] | None = None) -> Validation:
    """Run `options.iterations` iterations (the first a warm-up, not compared) and compare the rest with the
    simulated iteration. `options` is the executor's ExecuteOptions."""
    from hfplan.executor.controller import execute
    from hfplan.profiler.pace import profiled_split_seconds, profiled_step_seconds
    from hfplan.simulator.engine import simulate_plan

    if options.iterations < 2:
        raise HfplanError("--iterations must be at least 2 (the first is a warm-up)")
    as_run = on_this_machine(plan) if options.on_this_machine else plan
    simulate_plan(as_run)  # a plan the simulator cannot cost is refused before any worker starts
    reports: list = []
    readings: dict[str, machine.CpuSample | None] = {}

    def keep(report) -> None:
        reports.append(report)
        if report.iteration in (0, options.iterations - 1):  # the warm-up's end and the last compared one's
            readings["after" if readings else "before"] = machine.sample()
        if on_iteration is not None:
            on_iteration(report)

    profile = plan.cluster.profile
    sharing = profile.compute.host_parallelism  # measured with the profile's processes of one host at once
    world = profile.gpus_per_node if sharing else 1
    with machine.PaceProbe(profiled_step_seconds(profile), world, sharing,
                           profiled_split_seconds(profile, world)) as probe:
        summary = execute(plan, options, keep, on_start=lambda done, resumed: probe.measure_before())
        pace = probe.finish()
    timed = reports[1:]
    measured = [from_zero(r.spans) for r in timed]
    lengths = [int(n) for r in timed for n in r.sampled["response_mask"].sum(axis=1)]
    counts = length_counts(lengths, plan.workload.response_len)
    costed = with_prompt_len(with_response_lengths(as_run, counts), [r.sampled["prompts"].shape[1] for r in timed])
    result = simulate_plan(costed)
    simulated = list(result.estimate.timeline)
    measured_gib = peak_gib_per_set(summary.peak_memory_bytes, len(plan.placement))
    comparison = compare(simulated, measured, predicted_gib(costed, result.estimate.peak_memory_gib), measured_gib,
                         labels)
    spreads = [spread for r in timed for spread in r.rank_start_spreads]
    return Validation(comparison, costed, simulated, measured[-1], counts,
                      machine.other_cores(readings.get("before"), readings.get("after")), pace,
                      typical(spreads) if spreads else None)


def side_by_side(simulated: Sequence[Span], measured: Sequence[Span], labels: Sequence[str]
                 ) -> tuple[list[Span], list[str]]:
    """Both timelines as one: the simulated sets (and controller) as rows above the measured ones."""
    n = len(labels)
    rows = [f"simulated: {label}" for label in labels] + ["simulated: controller"]
    rows += [f"measured: {label}" for label in labels] + ["measured: controller"]

    def moved(span: Span, offset: int) -> Span:
        index = n if span.set < 0 else span.set
        return span.model_copy(update={"set": index + offset})

    return [moved(s, 0) for s in simulated] + [moved(s, n + 1) for s in measured], rows
