"""Worker-group roles: the dataflow's Role protocol over Ray actors.

A call splits its batch across the data-parallel replicas of the call's layout (hfplan.layout's
replica groups: every rank of a replica gets the same share), dispatches to every worker of the set
without waiting, and returns a Batch of futures. Outputs are read from one rank per replica (tensor
rank 0 of the last pipeline stage), in data-parallel order.

Data movement follows hfplan.layout.transfer_path: a field made by a role call reaches the next call
directly, worker to worker through Ray's object store (the controller passes references and row ranges
on, and never fetches the data); a field the controller made (a controller step's output, a rule's
score) is sent from the controller. Rows a rank made itself in an earlier call of the iteration are read
where they are: the worker keeps its calls' outputs for the iteration, and Ray runs one caller's calls to an
actor in the order they were sent, so no Ray reference (no wait, no fetch) is needed for them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from hfplan.dataflow.batch import Batch, resolved, row_split
from hfplan.dataflow.controller import STEPS, ControllerState
from hfplan.dataflow.ops import ROLE_OPS
from hfplan.dataflow.rewards import Reward, RewardFailed, columns_per_row, score_rows
from hfplan.dataflow.roles import CallingRole, RoleFacts, call_writes
from hfplan.executor import wire
from hfplan.executor.errors import RunFailed
from hfplan.executor.generation_order import collector_ranks, replica_ranks
from hfplan.layout import CONTROLLER, ON_CONTROLLER, rank_of, replica_groups
from hfplan.plan import RESHARD_BACK_OP, WEIGHT_SYNC_OP, Layout, Span


def collecting_ranks(layout: Layout) -> list[int]:
    """One rank per replica, in data-parallel order: the replica's tensor rank 0 of its last stage."""
    return [rank_of(layout, layout.pp - 1, replica, 0) for replica in range(layout.dp)]


@dataclass
class Recorder:
    """Spans of the current iteration on the controller's clock, the fields the metrics read, and the data's
    other columns for its prompts (what a controller reward reads)."""

    clock_offsets: dict[tuple[int, int], float]  # (set, rank) -> worker clock minus controller clock
    origin: float = 0.0
    spans: list[Span] = field(default_factory=list)
    observed: dict[tuple[str, str, bool], dict] = field(default_factory=dict)
    calls: list[PendingCall] = field(default_factory=list)
    next_call_id: int = 0  # numbers every role call of the run, in dispatch order
    first_call_id: int = 0  # the current iteration's first: workers keep the outputs of its calls and later
    hold_from: int | None = None  # an earlier call whose outputs (and later ones) workers keep across recordings
    prompt_columns: dict[str, list] = field(default_factory=dict)  # one value per prompt of the iteration
    # (prompts, responses) as a controller reward decoded them, by greedy: what --samples shows without decoding
    texts: dict[bool, tuple[list[str], list[str]]] = field(default_factory=dict)
    deferred: list[Callable[[], None]] = field(default_factory=list)  # spans taken when the iteration finishes
    # Seconds from the first to the last rank's start of each Ray task sent to every rank of a multi-rank set
    # (its first call's first stretch): what the profiler reads as Runtime.rank_dispatch_us.
    rank_start_spreads: list[float] = field(default_factory=list)

    def call_timings(self) -> list[CallTiming]:
        """When each of the recording's calls was sent, and its workers started and ended it, in the order the
        calls were made (its outputs fetched: after finish_iteration)."""
        return [CallTiming(call.label[0], call.label[1], call.call_id, call.sent_at, call.started, call.ended)
                for call in self.calls]

    def start_iteration(self, prompt_columns: dict[str, list] | None = None, origin: float | None = None) -> None:
        """A new recording (a training iteration, or an evaluation): spans from now (or from `origin`, where its
        first call was sent before), nothing observed yet."""
        self.origin = time.time() if origin is None else origin
        self.spans = []
        self.observed = {}
        self.texts = {}
        self.calls = []
        self.rank_start_spreads = []
        self.start_batch(prompt_columns)

    def start_batch(self, prompt_columns: dict[str, list] | None = None) -> None:
        """The next batch of prompts of this recording (an evaluation's next chunk): a controller reward reads its
        columns, and the workers no longer keep the outputs of the calls before it (nor before `hold_from`: an
        asynchronous run's generations sent ahead, which later iterations read)."""
        self.prompt_columns = prompt_columns or {}
        self.first_call_id = self.next_call_id if self.hold_from is None else min(self.next_call_id, self.hold_from)

    def new_call_id(self) -> int:
        self.next_call_id += 1
        return self.next_call_id - 1

    def finish_iteration(self) -> None:
        """Fetch what no later call or step fetched (fields only workers read): their spans and the
        fields the metrics read, and record what waited for the end (a weight sync). Every call has finished by
        then: the updates waited for them."""
        for call in self.calls:
            call.outputs()
        deferred, self.deferred = self.deferred, []
        for record in deferred:
            record()

    def span(self, role: str, op: str, set_index: int, start: float, end: float, kind: str = "compute",
             phase: str | None = None) -> None:
        """`phase` defaults to the op's own (a role call's), else preparation."""
        if phase is None:
            phase = ROLE_OPS[op].phase if op in ROLE_OPS else "preparation"
        self.spans.append(Span(role=role, op=op, phase=phase, set=set_index, start=max(0.0, start - self.origin),
                               end=max(0.0, end - self.origin), kind=kind))

    def fetched(self, role: str, op: str, batch: Batch) -> dict:
        """The arrays of a controller step's or rule's inputs, fetched from the calls that made them. Their transfer
        is recorded as the simulator prices an edge into the controller: from the end of the last producer (or from
        when the controller asked, if later: it was busy before) until the data is here."""
        asked = time.time()
        fields = batch.resolve()
        ends = [value.call.ended for value in batch.values() if isinstance(value, FieldFuture)]
        if ends:
            now = time.time()
            self.span(role, op, ON_CONTROLLER, min(max(asked, *ends), now), now, kind="transfer")
        return fields

    def worker_spans(self, role: str, op: str, set_index: int, results: list[dict], opens_task: bool = False
                     ) -> None:
        """One span per stretch of call `op`, from the first rank's start to the last rank's end; every
        stretch (its input transfer, its layout switches) in the call's phase (timed_phase). `opens_task`: the
        call was the first of the Ray task each rank got (its ranks' start spread is the dispatch's)."""
        per_rank = [[(t, self.clock_offsets[(set_index, rank)]) for t in result["spans"]]
                    for rank, result in enumerate(results)]
        if opens_task and len(per_rank) > 1 and all(per_rank):
            starts = [timed[0][0].start - timed[0][1] for timed in per_rank]
            self.rank_start_spreads.append(max(starts) - min(starts))
        for i, (first, _) in enumerate(per_rank[0]):
            start = min(timed[i][0].start - timed[i][1] for timed in per_rank)
            end = max(timed[i][0].end - timed[i][1] for timed in per_rank)
            self.span(role, first.op, set_index, start, end, kind=first.kind, phase=timed_phase(op, first.op))


@dataclass(frozen=True)
class CallTiming:
    """One role call on the controller's clock (time.time()): `sent` (the Ray task that carried it submitted),
    `start` (its first rank's first stretch), `end` (its last rank's last). What bench/dispatch_gaps.py reads: how
    long before a worker was free each call was there."""

    role: str
    op: str
    call_id: int
    sent: float
    start: float
    end: float


def timed_phase(call_op: str, timed_op: str) -> str:
    """The phase of a stretch of work inside a call: the call's, but a hybrid engine's way back from generation
    is generation's wherever it runs (before the first call after a run of generate calls)."""
    return ROLE_OPS["generate"].phase if timed_op == RESHARD_BACK_OP else ROLE_OPS[call_op].phase


@dataclass(frozen=True)
class KeptOutputs:
    """The outputs of call `call_id` that the receiving worker made itself and kept."""

    call_id: int


@dataclass(frozen=True)
class RowsFrom:
    """Rows of a field that a worker reads itself from other calls' outputs: (source, first row, end row)
    pieces, concatenated in order; a source is a Ray reference to fetch, or KeptOutputs of this worker."""

    name: str
    pieces: tuple[tuple[object, int, int], ...]


@dataclass(frozen=True)
class OutputPiece:
    """Rows [lo, hi) of the outputs rank `rank` of its set made in `call` (the controller's view)."""

    call: PendingCall
    lo: int
    hi: int
    rank: int

    def source_for(self, set_index: int, rank: int) -> object:
        """How the worker at (set_index, rank) reads these rows: from itself when it made them, else through the Ray
        reference to them (which sends the call if it is still held)."""
        if (set_index, rank) == (self.call.set_index, self.rank):
            return KeptOutputs(self.call.call_id)
        return self.call.handed_refs()[self.rank]


@dataclass(frozen=True)
class PendingRows:
    """Rows of field `name` of dispatched calls, as the controller passes them on; RowsFrom per receiver."""

    name: str
    pieces: tuple[OutputPiece, ...]

    def to(self, set_index: int, rank: int) -> RowsFrom:
        return RowsFrom(self.name, tuple((p.source_for(set_index, rank), p.lo, p.hi) for p in self.pieces))


class Dispatch:
    """Role calls made and not yet sent to their workers. A call is held until something needs it sent: a wait on
    any call's results, a call that reads its rows through a Ray reference, or other work on the workers (`send`).
    Then each worker gets the calls held for it as one Ray task (SetWorker.calls), run back to back: each call past
    the first saves a Ray task's overhead on both sides (on the worker alone about 1 ms on the CPU demo: Ray's
    argument deserialisation, result store and switch between tasks, as ray.timeline() shows them). `sends` counts
    the sends: PendingCall.sent_in and waited_after read it, what was sent before which results were waited for."""

    def __init__(self) -> None:
        self.held: list[PendingCall] = []
        self.sends = 0

    def send(self) -> None:
        held, self.held = self.held, []
        by_set: dict[int, list[PendingCall]] = {}
        now = time.time()
        for call in held:
            by_set.setdefault(call.set_index, []).append(call)
            call.sent_in, call.sent_at = self.sends, now
        self.sends += 1
        for calls in by_set.values():
            # Every rank's arguments are packed before the first rank's task goes, so that the ranks' tasks leave
            # back to back: a collective waits for the set's last rank to start.
            tasks = []
            for rank, worker in enumerate(calls[0].workers):
                mine = [call for call in calls if rank in call.args]
                if not mine:
                    continue
                mine[0].opens_task = True
                tasks.append((rank, worker, mine, wire.arguments(wire.pack([call.args.pop(rank) for call in mine]))))
            for rank, worker, mine, arguments in tasks:
                refs = worker.calls.options(num_returns=len(mine)).remote(*arguments)
                for call, ref in zip(mine, refs if len(mine) > 1 else [refs], strict=True):
                    call.refs[rank] = ref


class PendingCall:
    """One role call: held until the Dispatch sends it, then references to each rank's outputs, fetched and merged
    on first use."""

    def __init__(self, label: tuple[str, str, bool], set_index: int, workers: list, args: dict[int, tuple],
                 collect: list[int], rows: list[int], recorder: Recorder, dispatch: Dispatch,
                 describe_failure: Callable[[Exception], str], timeout_s: float, call_id: int,
                 recorded: bool = True) -> None:
        """`args`: SetWorker.run_call's arguments by rank; `recorded`: part of the current recording (else the caller
        adds it to a later one)."""
        self.label, self.set_index, self.workers, self.args = label, set_index, workers, args
        self.collect, self.rows, self.recorder, self.dispatch = collect, rows, recorder, dispatch
        self.describe_failure, self.timeout_s, self.call_id = describe_failure, timeout_s, call_id
        self.refs: list = [None] * len(workers)
        self.opens_task = False  # the first call of a Ray task its ranks got (Dispatch.send)
        self.sent_in: int | None = None  # which of the Dispatch's sends sent it
        self.sent_at = 0.0  # when (the controller's clock)
        self.waited_after: int | None = None  # how many sends there had been when its outputs were first waited for
        self._outputs: dict | None = None
        self.started = self.ended = 0.0  # when its first rank started and its last finished (the controller's
        # clock), once its outputs are fetched
        dispatch.held.append(self)
        if recorded:
            recorder.calls.append(self)

    def sent_refs(self) -> list:
        """The references to each rank's outputs, every held call sent first: whoever asks is about to wait on
        them."""
        if self.dispatch.held:
            self.dispatch.send()
        return self.refs

    def handed_refs(self) -> list:
        """The references to each rank's outputs, for a call that reads them: this call sent first if it is still
        held (with every held call). Once it is sent, the calls held since stay held, to go with the calls made
        after them: a set's forward calls on one generation's outputs (PPO's reference log-probs and values) then
        reach their worker as one task, run back to back, not one task each."""
        return self.sent_refs() if self in self.dispatch.held else self.refs

    @property
    def greedy(self) -> bool:
        return self.label[2]

    def done(self) -> bool:
        if self._outputs is not None:
            return True
        import ray

        refs = self.sent_refs()
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def outputs(self, timeout: float | None = None) -> dict:
        if self._outputs is None:
            import ray

            try:
                refs = self.sent_refs()
                self.waited_after = self.dispatch.sends
                packed = ray.get(refs, timeout=self.timeout_s if timeout is None else timeout)
            except Exception as failure:  # a dead worker, a failed call, or a timeout: name who
                raise RunFailed(self.describe_failure(failure)) from failure
            results = [wire.unpack_packed(result) for result in packed]
            for result in results:
                if isinstance(result, wire.CallFailed):  # the worker's own error, as Ray's would read
                    raise RunFailed(self.describe_failure(RuntimeError(result.error)))
            self.recorder.worker_spans(self.label[0], self.label[1], self.set_index, results, self.opens_task)
            offsets = self.recorder.clock_offsets
            timed = [(t, offsets[(self.set_index, rank)])
                     for rank, result in enumerate(results) for t in result["spans"]]
            self.started = min(t.start - offset for t, offset in timed)
            self.ended = max(t.end - offset for t, offset in timed)
            self._outputs = merge_outputs([results[r]["fields"] for r in self.collect])
            self.recorder.observed[self.label] = self._outputs
        return self._outputs

    def rows_from(self, name: str, start: int, end: int) -> PendingRows:
        """Rows [start, end) of output `name` as pieces of the replicas' outputs that hold them."""
        pieces, offset = [], 0
        for rank, count in zip(self.collect, self.rows, strict=True):
            lo, hi = max(start, offset), min(end, offset + count)
            if lo < hi:
                pieces.append(OutputPiece(self, lo - offset, hi - offset, rank))
            offset += count
        return PendingRows(name, tuple(pieces))


def merge_outputs(per_replica: list[dict]) -> dict:
    """Concatenate array fields in data-parallel order; average metric dicts over the replicas."""
    merged = {}
    for name, first in per_replica[0].items():
        if isinstance(first, dict):
            merged[name] = {key: float(np.mean([group[name][key] for group in per_replica])) for key in first}
        else:
            merged[name] = np.concatenate([group[name] for group in per_replica], axis=0)
    return merged


class FieldFuture:
    """One field of a pending call: what a role returns before the call has finished."""

    __slots__ = ("call", "name")

    def __init__(self, call: PendingCall, name: str) -> None:
        self.call, self.name = call, name

    def done(self) -> bool:
        return self.call.done()

    def result(self, timeout: float | None = None):
        return self.call.outputs(timeout)[self.name]

    @property
    def rows(self) -> int:
        return sum(self.call.rows)


def from_greedy(batch: Batch) -> bool:
    responses = batch.get("responses")
    return isinstance(responses, FieldFuture) and responses.call.greedy


@dataclass(frozen=True)
class SentAhead:
    """A generation sent before the iteration that reads it (ActorRole.send_ahead)."""

    prompts: np.ndarray
    n: int
    greedy: bool
    outputs: Batch

    @property
    def call_id(self) -> int:
        return next(iter(self.outputs.values())).call.call_id


@dataclass
class WorkerSet:
    """The Ray actors of one placement set, rank by rank."""

    index: int
    roles: tuple[str, ...]
    workers: list
    describe_failure: Callable[[str, str, Exception], str]
    placement_group: object = None


class WorkerGroupRole(CallingRole):
    """A model role placed on a set of workers."""

    def __init__(self, name: str, facts: RoleFacts, workers: WorkerSet, layouts: dict[str, Layout],
                 recorder: Recorder, timeout_s: float, dispatch: Dispatch) -> None:
        self.name, self.facts, self.workers, self.layouts = name, facts, workers, layouts
        self.recorder, self.timeout_s, self.dispatch = recorder, timeout_s, dispatch

    def call(self, op: str, batch: Batch, greedy: bool = False, n: int = 1, recorded: bool = True) -> Batch:
        if op != "generate":
            greedy = from_greedy(batch)  # a forward call on greedy responses is labelled so (ReMax's baseline)
        else:  # a generation goes alone, at once: the controller reads its outputs first (rewards, the next prompts)
            self.dispatch.send()
        layout = self.layouts[ROLE_OPS[op].layout]
        rows = _rows_of(batch)
        bounds = row_split(rows, layout.dp)
        shares = [{name: _share(value, start, end) for name, value in batch.items()} for start, end in bounds]
        args: dict[int, tuple] = {}
        train = self.layouts.get("train")
        groups = replica_ranks(train, layout) if op == "generate" else replica_groups(layout)
        collectors = collector_ranks(train, layout) if op == "generate" else collecting_ranks(layout)
        call_id, keep_from = self.recorder.new_call_id(), self.recorder.first_call_id
        for replica, ranks in enumerate(groups):
            for rank in ranks:
                fields = {name: value.to(self.workers.index, rank) if isinstance(value, PendingRows) else value
                          for name, value in shares[replica].items()}
                args[rank] = (self.name, op, fields, {"greedy": greedy, "n": n}, call_id, keep_from)

        def describe(failure: Exception, op: str = op) -> str:
            return self.workers.describe_failure(self.name, op, failure)

        out_rows = [(end - start) * (n if op == "generate" else 1) for start, end in bounds]
        call = PendingCall((self.name, op, greedy), self.workers.index, self.workers.workers, args, collectors,
                           out_rows, self.recorder, self.dispatch, describe, self.timeout_s, call_id, recorded)
        if op == "generate":
            self.dispatch.send()
        return Batch({name: FieldFuture(call, name) for name in call_writes(self.name, self.facts, op)})


def _rows_of(batch: Batch) -> int:
    counts = {value.rows if isinstance(value, FieldFuture) else len(value) for value in batch.values()}
    if len(counts) != 1:
        raise ValueError(f"batch fields disagree on their number of sequences: {sorted(counts)}")
    return counts.pop()


def _share(value, start: int, end: int):
    if isinstance(value, FieldFuture):
        return value.call.rows_from(value.name, start, end)
    return np.ascontiguousarray(value[start:end])


class ActorRole(WorkerGroupRole):
    """The actor: trains on its own set; generates there through the hybrid engine, or on a separate
    rollout set that receives the actor's weights before its first generation after an update."""

    def __init__(self, *args, rollout: WorkerGroupRole | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rollout = rollout
        self.rollout_stale = rollout is not None
        self.ahead: SentAhead | None = None

    def send_ahead(self, prompts: np.ndarray, n: int, greedy: bool) -> None:
        """Send the next iteration's first generation now, while this iteration's calls still run: its workers run
        it right after them, with the weights the update leaves, so the controller's work between the iterations
        (the update's results, the report, the next prompts) no longer holds the set idle. Only for a generation
        through the hybrid engine (a separate rollout set is synced first); joins the recording that asks for it
        (generate)."""
        if self.rollout is not None:
            raise ValueError("a generation on a separate rollout set waits for its weight sync: it is not sent ahead")
        self.ahead = SentAhead(prompts, n, greedy,
                               self.call("generate", Batch(prompts=prompts), greedy=greedy, n=n, recorded=False))

    def generate(self, batch: Batch, n: int = 1, greedy: bool = False) -> Batch:
        if self.ahead is not None:
            return self._take_ahead(batch, n, greedy)
        if self.rollout is None:
            return super().generate(batch, n, greedy)
        if self.rollout_stale:
            self.sync_rollout()
        out = self.rollout.generate(batch, n, greedy)
        for value in out.values():
            value.call.label = (self.name, "generate", greedy)
        return out

    def _take_ahead(self, batch: Batch, n: int, greedy: bool) -> Batch:
        ahead, self.ahead = self.ahead, None
        if (ahead.n, ahead.greedy) != (n, greedy) or not np.array_equal(ahead.prompts, resolved(batch["prompts"])):
            raise RuntimeError(f"the generation sent ahead (n={ahead.n}, greedy={ahead.greedy}) is not the one the "
                               f"iteration asks for first (n={n}, greedy={greedy}, or other prompts)")
        self.recorder.calls.append(next(iter(ahead.outputs.values())).call)  # every field's call is the one
        return ahead.outputs

    def update(self, batch: Batch) -> Batch:
        self.rollout_stale = self.rollout is not None
        return super().update(batch)

    @contextlib.contextmanager
    def outside_training(self) -> Iterator[None]:
        """Generations in the block (an evaluation's) leave the next training generation as it would have been: a
        separate rollout set they synced is synced again then, so each training iteration keeps its weight sync."""
        stale = self.rollout_stale
        try:
            yield
        finally:
            self.rollout_stale = stale
            if self.rollout is None:
                self.leave_generation()

    def leave_generation(self) -> None:
        """The actor's workers go back to their training layout now (runtime.RoleRuntime.leave_generation), so
        generations in a block apart (an evaluation's) leave the next training iteration its own switch."""
        import ray

        self.dispatch.send()  # the calls made before run first
        try:
            results = ray.get([w.leave_generation.remote() for w in self.workers.workers], timeout=self.timeout_s)
        except Exception as failure:
            raise RunFailed(self.workers.describe_failure(self.name, "reshard back", failure)) from failure
        self.recorder.worker_spans(self.name, "generate", self.workers.index, [{"spans": s} for s in results],
                                   opens_task=True)

    def sync_rollout(self) -> None:
        """Each rank of the actor puts, per rollout rank, the slices of that rank's generation shard it holds
        into the object store in buckets (a pipelined actor's ranks their stages' slices), and each rollout worker
        takes only its own, straight from the actor's ranks: the controller sends both calls at once and waits for
        neither (no round trip through it between them), and the rollout workers run their generation after the
        load, in submission order. The sync's span (and a failure of it) is taken when the iteration finishes."""
        self.dispatch.send()  # the update before the weights leave
        rollout_workers = self.rollout.workers.workers
        ranks = len(rollout_workers)
        sent = [w.weight_buckets.options(num_returns=ranks + 1).remote(self.name, self.rollout.name, ranks)
                for w in self.workers.workers]
        loads = [w.load_shards.remote(self.rollout.name, *(refs[1 + i] for refs in sent))
                 for i, w in enumerate(rollout_workers)]
        self.recorder.deferred.append(lambda: self._record_sync([refs[0] for refs in sent], loads))
        self.rollout_stale = False

    def _record_sync(self, started, loads) -> None:
        """The sync's span: from the first actor rank's start on the buckets to the last rollout rank's load, on
        the controller's clock."""
        import ray

        try:
            starts, ends = ray.get(started, timeout=self.timeout_s), ray.get(loads, timeout=self.timeout_s)
        except Exception as failure:
            raise RunFailed(self.rollout.workers.describe_failure(self.rollout.name, "weight sync", failure)) \
                from failure
        offsets, actor, rollout = self.recorder.clock_offsets, self.workers.index, self.rollout.workers.index
        start = min(t - offsets[(actor, rank)] for rank, t in enumerate(starts))
        end = max(t - offsets[(rollout, rank)] for rank, t in enumerate(ends))
        self.recorder.span(self.rollout.name, WEIGHT_SYNC_OP, rollout, start, max(start, end), kind="transition",
                           phase=ROLE_OPS["generate"].phase)


class RuleRole:
    """A reward or cost computed on the controller from the decoded text (hfplan.dataflow.rewards: `rule:<name>`
    or `module:function`), with the data's other columns of each sequence's prompt."""

    def __init__(self, name: str, facts: RoleFacts, reward: Reward,
                 decode: Callable[[np.ndarray, np.ndarray], list[str]], decode_prompts: Callable[[np.ndarray],
                 list[str]], recorder: Recorder) -> None:
        self.name, self.facts, self.reward = name, facts, reward
        self.decode, self.decode_prompts, self.recorder = decode, decode_prompts, recorder

    def score(self, batch: Batch) -> Batch:
        greedy = from_greedy(batch)
        fields = self.recorder.fetched(self.name, "score", batch)
        start = time.time()
        prompts = self.decode_prompts(fields["prompts"])
        responses = self.decode(fields["responses"], fields["response_mask"])
        try:
            columns = columns_per_row(self.recorder.prompt_columns, len(prompts))
            scores = score_rows(self.reward, prompts, responses, columns)
        except (RewardFailed, ValueError) as failure:
            raise RunFailed(f"role {self.name}: {failure}") from failure
        out = {self.facts.output: scores}
        self.recorder.span(self.name, "score", ON_CONTROLLER, start, time.time())
        self.recorder.observed[(self.name, "score", greedy)] = out
        self.recorder.texts[greedy] = (prompts, responses)
        return Batch(out)


class ExecutionController:
    """The dataflow's controller: runs registered steps (advantages, the Lagrange multiplier) on numpy."""

    def __init__(self, state: ControllerState, recorder: Recorder) -> None:
        self.state, self.recorder = state, recorder

    @property
    def samples_per_prompt(self) -> int:
        return self.state.samples_per_prompt

    @property
    def reuse_policy_log_probs(self) -> bool:
        return self.state.reuse_policy_log_probs

    @property
    def staleness(self) -> int:
        return self.state.staleness

    def step(self, name: str, batch: Batch) -> Batch:
        step = STEPS[name]
        fields = self.recorder.fetched(CONTROLLER, name, batch.select(*step.reads))
        start = time.time()
        out = step({k: np.asarray(v, dtype=np.float64) for k, v in fields.items()}, self.state)
        self.recorder.span(CONTROLLER, name, ON_CONTROLLER, start, time.time())
        return Batch({k: np.asarray(v, dtype=np.float32) for k, v in out.items()})
