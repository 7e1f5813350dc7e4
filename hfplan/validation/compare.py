"""Matching simulated and measured spans and the errors between them. Pure: no torch, no ray.

A call is matched by its role, operation, phase, kind and set, and by its place among the calls with those
(the second `actor.generate` of ReMax is the greedy one in both timelines; the simulator names it
`generate(greedy)`, the executor's worker `generate`). The simulator's dispatch spans are not matched: the
executor records no span for a call's dispatch (it is the gap before the call), so it counts in the stages and
the iteration only. Errors are signed fractions of the
measured value: (simulated - measured) / measured, so +0.10 means the simulator predicts 10% too long.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from hfplan.measure import typical
from hfplan.plan import EDGE, GREEDY_MARK, RESHARD_BACK_OP, RESHARD_OP, Span, phase_seconds

Key = tuple[int, str, str, str, str, int]  # set, role, op, phase, kind, occurrence


def signed_error(simulated: float, measured: float) -> float | None:
    """(simulated - measured) / measured; None when nothing was measured (a zero-length span)."""
    if measured <= 0.0:
        return None
    return (simulated - measured) / measured


def transfer_target(span: Span) -> str:
    """The call a transfer feeds: the simulator names an edge `src.op->role.op`, the executor records the input
    transfer under the receiving call's op."""
    if span.kind != "transfer" or EDGE not in span.op:
        return span.op
    target = span.op.rsplit(EDGE, 1)[1]
    return target.removeprefix(f"{span.role}.")


def call_keys(spans: Sequence[Span]) -> dict[Key, float]:
    """Each span's seconds under its key (occurrence counted in start order). The transfers into one call are
    one figure under that call's op, occurrence 0: the one that arrived last, which the call waited for (the
    simulator draws one per edge, in parallel; the executor records one, from the last producer's end). A hybrid
    engine's way back counts with its way in before it (`reshard`: the round trip, which the simulator prices
    with the way in and marks the way back where the executor runs it, at no cost)."""
    seen: dict[tuple, int] = defaultdict(int)
    out: dict[Key, float] = defaultdict(float)
    last_in: dict[Key, Span] = {}
    for span in sorted(spans, key=lambda s: (s.start, s.end)):
        if span.kind == "dispatch":
            continue
        base = (span.set, span.role, transfer_target(span).removesuffix(GREEDY_MARK), span.phase, span.kind)
        if span.kind == "transfer":
            key = (*base, 0)
            if key not in last_in or span.end > last_in[key].end:
                last_in[key] = span
            continue
        if span.kind == "transition" and span.op == RESHARD_BACK_OP:
            way_in = (span.set, span.role, RESHARD_OP, span.phase, span.kind)
            if seen[way_in]:  # the round trip is one figure: the simulator prices both ways with the way in
                out[(*way_in, seen[way_in] - 1)] += span.end - span.start
                continue
        out[(*base, seen[base])] += span.end - span.start
        seen[base] += 1
    out.update({key: span.end - span.start for key, span in last_in.items()})
    return dict(out)


def typical_calls(iterations: Sequence[Sequence[Span]]) -> dict[Key, float]:
    """Each key's typical (median) seconds over the iterations it appears in."""
    seen: dict[Key, list[float]] = defaultdict(list)
    for spans in iterations:
        for key, seconds in call_keys(spans).items():
            seen[key].append(seconds)
    return {key: typical(values) for key, values in seen.items()}


def iteration_seconds(spans: Sequence[Span]) -> float:
    if not spans:
        return 0.0
    return max(s.end for s in spans) - min(s.start for s in spans)


@dataclass(frozen=True)
class Figure:
    """One simulated and measured quantity and its signed error."""

    simulated: float
    measured: float
    error: float | None

    @classmethod
    def of(cls, simulated: float, measured: float) -> Figure:
        return cls(simulated, measured, signed_error(simulated, measured))


@dataclass(frozen=True)
class CallFigure(Figure):
    set: int = -1
    role: str = ""
    op: str = ""
    phase: str = ""
    kind: str = "compute"
    occurrence: int = 0


@dataclass(frozen=True)
class Comparison:
    calls: list[CallFigure]
    stages: dict[str, Figure]
    iteration: Figure
    memory_gib: dict[str, Figure]  # set label -> predicted and measured peak per GPU
    unmatched: dict[str, list[str]] = field(default_factory=dict)  # "simulated"/"measured" -> call names

    def to_json(self) -> dict:
        return {"iteration": asdict(self.iteration), "stages": {k: asdict(v) for k, v in self.stages.items()},
                "calls": [asdict(c) for c in self.calls],
                "memory_gib": {k: asdict(v) for k, v in self.memory_gib.items()}, "unmatched": self.unmatched}


def _name(key: Key) -> str:
    set_, role, op, phase, kind, index = key
    return f"set {set_} {role}.{op} ({phase}, {kind}) #{index}"


def compare(simulated: Sequence[Span], measured: Sequence[Sequence[Span]], predicted_gib: Sequence[float],
            measured_gib: Sequence[float], set_labels: Sequence[str]) -> Comparison:
    """The simulated iteration against the measured ones (each a list of spans): each call, stage and the
    iteration against its typical (median) measured seconds, hfplan.measure's statistic, as the profile's.
    Transfers that take no time in both timelines are left out of the calls."""
    if not measured:
        raise ValueError("no measured iteration to compare with")
    sim_calls, run_calls = call_keys(simulated), typical_calls(measured)
    calls = []
    for key in sorted(sim_calls.keys() & run_calls.keys(), key=lambda k: (k[0], k[3], k[1], k[2], k[5])):
        sim, run = sim_calls[key], run_calls[key]
        if sim <= 0.0 and run <= 0.0:
            continue
        set_, role, op, phase, kind, index = key
        calls.append(CallFigure(sim, run, signed_error(sim, run), set_, role, op, phase, kind, index))
    sim_stages = phase_seconds(simulated)
    run_stages = _typical_dicts([phase_seconds(spans) for spans in measured])
    stages = {phase: Figure.of(sim_stages.get(phase, 0.0), run_stages.get(phase, 0.0))
              for phase in dict.fromkeys([*sim_stages, *run_stages])}
    iteration = Figure.of(iteration_seconds(simulated), typical([iteration_seconds(s) for s in measured]))
    memory = {label: Figure.of(p, m) for label, p, m in zip(set_labels, predicted_gib, measured_gib, strict=True)}
    unmatched = {"simulated": [_name(k) for k in sorted(sim_calls.keys() - run_calls.keys()) if sim_calls[k] > 0],
                 "measured": [_name(k) for k in sorted(run_calls.keys() - sim_calls.keys()) if run_calls[k] > 0]}
    return Comparison(calls, stages, iteration, memory, unmatched)


def _typical_dicts(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: typical([row[k] for row in rows if k in row]) for k in keys}


def kendall_tau(xs: Sequence[float], ys: Sequence[float],
                 spans: Sequence[tuple[float, float]] | None = None) -> float:
    """Kendall's tau-a between two rankings (ties count as neither concordant nor discordant). `spans`: each
    y's (lowest, highest) measured value; then only the pairs whose spans do not overlap count (the pairs whose
    order the measurements settle). NaN when no pair counts."""
    if len(xs) != len(ys) or (spans is not None and len(spans) != len(ys)):
        raise ValueError("rankings of different lengths")
    pairs = concordant = discordant = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            if spans is not None and not (spans[i][1] < spans[j][0] or spans[j][1] < spans[i][0]):
                continue
            pairs += 1
            sign = (xs[i] - xs[j]) * (ys[i] - ys[j])
            concordant += sign > 0
            discordant += sign < 0
    return (concordant - discordant) / pairs if pairs else math.nan
