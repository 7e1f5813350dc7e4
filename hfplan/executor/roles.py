"""Worker-group roles: the dataflow's Role protocol over Ray actors.

A call splits its batch across the data-parallel ranks of the call's layout (every rank of one
data-parallel group gets the same share), dispatches to every worker of the set without waiting, and
returns a Batch of futures. The results are collected from one rank per data-parallel group, in
data-parallel order, when something reads them: so calls on disjoint sets overlap, as the simulator
assumes. Batch fields move through the controller (Ray's object store), the path the simulator costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.controller import STEPS, ControllerState
from hfplan.dataflow.ops import ROLE_OPS, output_field
from hfplan.executor.errors import RunFailed
from hfplan.plan import Layout, Span

CONTROLLER_SET = -1


def dp_index(layout: Layout, rank: int) -> int:
    """The data-parallel group of a rank (ranks are pipeline-major, then data-parallel, then tensor-parallel)."""
    return (rank // layout.tp) % layout.dp


def collecting_ranks(layout: Layout) -> list[int]:
    """One rank per data-parallel group, in data-parallel order: tensor rank 0 of the last pipeline stage."""
    last_stage = (layout.pp - 1) * layout.dp * layout.tp
    return [last_stage + d * layout.tp for d in range(layout.dp)]


@dataclass
class Recorder:
    """Spans of the current iteration on the controller's clock, and the fields the metrics read."""

    clock_offsets: dict[tuple[int, int], float]  # (set, rank) -> worker clock minus controller clock
    origin: float = 0.0
    spans: list[Span] = field(default_factory=list)
    observed: dict[tuple[str, str, bool], dict] = field(default_factory=dict)

    def start_iteration(self) -> None:
        self.origin = time.time()
        self.spans = []
        self.observed = {}

    def span(self, role: str, op: str, set_index: int, start: float, end: float, kind: str = "compute") -> None:
        phase = ROLE_OPS[op].phase if op in ROLE_OPS else "preparation"
        self.spans.append(Span(role=role, op=op, phase=phase, set=set_index, start=max(0.0, start - self.origin),
                               end=max(0.0, end - self.origin), kind=kind))

    def worker_spans(self, role: str, set_index: int, dispatched: float, results: list[dict]) -> None:
        """One span per stretch of the call, from the first rank's start to the last rank's end."""
        timed = [[(t, self.clock_offsets[(set_index, rank)]) for t in result["spans"]]
                 for rank, result in enumerate(results)]
        first_start = min(t.start - off for per_rank in timed for t, off in per_rank[:1])
        self.span(role, timed[0][0][0].op, set_index, dispatched, first_start, kind="transfer")
        for i, (t, _) in enumerate(timed[0]):
            start = min(per_rank[i][0].start - per_rank[i][1] for per_rank in timed)
            end = max(per_rank[i][0].end - per_rank[i][1] for per_rank in timed)
            self.span(role, t.op, set_index, start, end, kind=t.kind)


class PendingCall:
    """The outputs of one dispatched role call, fetched and merged on first use."""

    def __init__(self, label: tuple[str, str, bool], set_index: int, refs: list, collect: list[int],
                 recorder: Recorder, describe_failure: Callable[[Exception], str], timeout_s: float) -> None:
        self.label, self.set_index, self.refs, self.collect = label, set_index, refs, collect
        self.recorder, self.describe_failure, self.timeout_s = recorder, describe_failure, timeout_s
        self.dispatched = time.time()
        self._outputs: dict | None = None

    @property
    def greedy(self) -> bool:
        return self.label[2]

    def outputs(self) -> dict:
        if self._outputs is None:
            import ray

            try:
                results = ray.get(self.refs, timeout=self.timeout_s)
            except Exception as failure:  # a dead worker, a failed call, or a timeout: name who
                raise RunFailed(self.describe_failure(failure)) from failure
            role = self.label[0]
            self.recorder.worker_spans(role, self.set_index, self.dispatched, results)
            self._outputs = merge_outputs([results[r]["fields"] for r in self.collect])
            self.recorder.observed[self.label] = self._outputs
        return self._outputs


def merge_outputs(per_group: list[dict]) -> dict:
    """Concatenate array fields in data-parallel order; average metric dicts over the groups."""
    merged = {}
    for name, first in per_group[0].items():
        if isinstance(first, dict):
            merged[name] = {key: float(np.mean([group[name][key] for group in per_group])) for key in first}
        else:
            merged[name] = np.concatenate([group[name] for group in per_group], axis=0)
    return merged


class FieldFuture:
    """One field of a pending call: what a role returns before the call has finished."""

    __slots__ = ("call", "name")

    def __init__(self, call: PendingCall, name: str) -> None:
        self.call, self.name = call, name

    def result(self):
        return self.call.outputs()[self.name]


def resolve(batch: Batch) -> dict:
    return {name: value.result() if isinstance(value, FieldFuture) else value for name, value in batch.items()}


def from_greedy(batch: Batch) -> bool:
    responses = batch.get("responses")
    return isinstance(responses, FieldFuture) and responses.call.greedy


@dataclass
class WorkerSet:
    """The Ray actors of one placement set, rank by rank."""

    index: int
    roles: tuple[str, ...]
    workers: list
    describe_failure: Callable[[str, str, Exception], str]
    placement_group: object = None


class WorkerGroupRole:
    """A model role placed on a set of workers."""

    def __init__(self, name: str, workers: WorkerSet, layouts: dict[str, Layout], recorder: Recorder,
                 timeout_s: float) -> None:
        self.name, self.workers, self.layouts = name, workers, layouts
        self.recorder, self.timeout_s = recorder, timeout_s

    def dispatch(self, op: str, batch: Batch, writes: tuple[str, ...], greedy: bool = False, **options) -> Batch:
        layout = self.layouts[ROLE_OPS[op].layout]
        fields = resolve(batch)
        shares = {name: np.array_split(value, layout.dp, axis=0) for name, value in fields.items()}
        refs = []
        for rank, worker in enumerate(self.workers.workers):
            share = {name: parts[dp_index(layout, rank)] for name, parts in shares.items()}
            refs.append(worker.call.remote(self.name, op, share, options | {"greedy": greedy}))
        label = (self.name, op, greedy)

        def describe(failure: Exception, op: str = op) -> str:
            return self.workers.describe_failure(self.name, op, failure)

        call = PendingCall(label, self.workers.index, refs, collecting_ranks(layout), self.recorder, describe,
                           self.timeout_s)
        return Batch({name: FieldFuture(call, name) for name in writes})

    def generate(self, batch: Batch, n: int = 1, greedy: bool = False) -> Batch:
        return self.dispatch("generate", batch.select("prompts"), ("prompts", "responses", "response_mask"),
                             greedy=greedy, n=n)

    def _forward(self, op: str, batch: Batch) -> Batch:
        return self.dispatch(op, batch, (output_field(self.name, op),), greedy=from_greedy(batch))

    def log_prob(self, batch: Batch) -> Batch:
        return self._forward("log_prob", batch)

    def values(self, batch: Batch) -> Batch:
        return self._forward("values", batch)

    def score(self, batch: Batch) -> Batch:
        return self._forward("score", batch)

    def update(self, batch: Batch) -> Batch:
        return self.dispatch("update", batch, (f"{self.name}_metrics",))


class ActorRole(WorkerGroupRole):
    """The actor: trains on its own set; generates there through the hybrid engine, or on a separate
    rollout set that receives the actor's weights before its first generation after an update."""

    def __init__(self, *args, rollout: WorkerGroupRole | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rollout = rollout
        self.rollout_stale = rollout is not None

    def generate(self, batch: Batch, n: int = 1, greedy: bool = False) -> Batch:
        if self.rollout is None:
            return super().generate(batch, n, greedy)
        if self.rollout_stale:
            self._sync_rollout()
        out = self.rollout.generate(batch, n, greedy)
        for value in out.values():
            value.call.label = (self.name, "generate", greedy)
        return out

    def update(self, batch: Batch) -> Batch:
        self.rollout_stale = self.rollout is not None
        return super().update(batch)

    def _sync_rollout(self) -> None:
        """The actor's full weights (gathered on its rank 0) go to every rollout worker through the object
        store; the rollout workers run their generation after the load, in submission order."""
        import ray

        start = time.time()
        gathered = [w.full_weights.remote(self.name) for w in self.workers.workers]
        loads = [w.load_weights.remote(self.rollout.name, gathered[0]) for w in self.rollout.workers.workers]
        try:
            ray.get(loads, timeout=self.timeout_s)
        except Exception as failure:
            raise RunFailed(self.rollout.workers.describe_failure(self.rollout.name, "weight sync", failure)) \
                from failure
        self.recorder.span(self.rollout.name, "generate", self.rollout.workers.index, start, time.time(),
                           kind="transfer")
        self.rollout_stale = False


class RuleRole:
    """A `rule:` reward or cost, computed on the controller from the decoded text."""

    def __init__(self, name: str, rule: Callable[[str, str], float], decode: Callable[[np.ndarray, np.ndarray],
                 list[str]], decode_prompts: Callable[[np.ndarray], list[str]], recorder: Recorder) -> None:
        self.name, self.rule, self.decode, self.decode_prompts = name, rule, decode, decode_prompts
        self.recorder = recorder

    def score(self, batch: Batch) -> Batch:
        greedy = from_greedy(batch)
        fields = resolve(batch)
        start = time.time()
        prompts = self.decode_prompts(fields["prompts"])
        responses = self.decode(fields["responses"], fields["response_mask"])
        scores = np.array([self.rule(p, r) for p, r in zip(prompts, responses, strict=True)], dtype=np.float32)
        out = {output_field(self.name, "score"): scores}
        self.recorder.span(self.name, "score", CONTROLLER_SET, start, time.time())
        self.recorder.observed[(self.name, "score", greedy)] = out
        return Batch(out)


class ExecutionController:
    """The dataflow's controller: runs registered steps (advantages, the Lagrange multiplier) on numpy."""

    def __init__(self, state: ControllerState, recorder: Recorder) -> None:
        self.state, self.recorder = state, recorder

    @property
    def samples_per_prompt(self) -> int:
        return self.state.samples_per_prompt

    def step(self, name: str, batch: Batch) -> Batch:
        fields = resolve(batch)
        start = time.time()
        out = STEPS[name].run({k: np.asarray(v, dtype=np.float64) for k, v in fields.items()}, self.state)
        self.recorder.span("controller", name, CONTROLLER_SET, start, time.time())
        return Batch({k: np.asarray(v, dtype=np.float32) for k, v in out.items()})
