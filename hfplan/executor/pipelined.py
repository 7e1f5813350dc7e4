"""The asynchronous loop (Workload.staleness = k > 0): generation on the rollout set runs k iterations ahead.

It runs the simulator's pipelined window (hfplan.simulator.pipeline) for real. Window j starts by sending the
rollout set the generate calls of iteration j + k (Ray runs them there while the other sets work), then runs
iteration j's program, whose generate calls are handed the responses generated k windows before (on weights k
updates older than the actor's, which the actor's loss corrects for: hfplan.dataflow.algorithms.off_policy). Once
iteration j's updates are in and the rollout set has finished, the actor's new weights go to the rollout set
through the hybrid engine's bucketed sync, once per update (ActorRole.sync_rollout), and window j ends. So the
rollout of iteration i uses the weights after update i - 1 - k (the initial ones while that is negative).

The first window learns the program's generate calls (their n and greedy) as the program makes them and sends
each for iterations 0..k at once. A window's measured spans are those that ran in it: iteration j's preparation
and training, the generation of iteration j + k, the weight sync; its metrics are iteration j's (its responses,
scores and updates). Everything is sent to the workers in one order, so a seed gives the same run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from hfplan.dataflow.batch import Batch, resolved
from hfplan.dataflow.registry import get_algorithm
from hfplan.executor import preflight
from hfplan.executor.controller import (
    ExecuteOptions,
    IterationReport,
    Progress,
    finish_iteration_report,
    start_progress,
)
from hfplan.executor.data import PromptBatch
from hfplan.executor.roles import ActorRole, ExecutionController, PendingCall, Recorder
from hfplan.plan import Plan

Signature = tuple[int, bool]  # (n, greedy) of one generate call of the program


class Generations:
    """The generate calls sent ahead: by (iteration, k-th generate call of its program)."""

    def __init__(self, actor: ActorRole, staleness: int, last: int) -> None:
        self.actor, self.staleness, self.last = actor, staleness, last
        self.signatures: list[Signature] | None = None  # learned in the first window
        self.sent: dict[tuple[int, int], Batch] = {}
        self.prompts: dict[int, tuple[PromptBatch, object]] = {}  # iteration -> (its prompts, encoded)

    def send(self, iteration: int, k: int, signature: Signature) -> None:
        if iteration < self.last:
            n, greedy = signature
            self.sent[(iteration, k)] = self.actor.generate(Batch(prompts=self.prompts[iteration][1]), n, greedy)

    def take(self, iteration: int, k: int, signature: Signature, first: int) -> Batch:
        """The k-th generate call of iteration `iteration`'s program; in the first window (`first`), sent now for
        it and the `staleness` iterations after it."""
        if iteration == first:
            if k == 0:
                self.signatures = []
            self.signatures.append(signature)
            for ahead in range(iteration, iteration + self.staleness + 1):
                self.send(ahead, k, signature)
        elif self.signatures is None or k >= len(self.signatures) or self.signatures[k] != signature:
            raise RuntimeError(f"the program's generate call {k} of iteration {iteration} ({signature}) is not one "
                               "its first iteration made: an asynchronous run needs the same generate calls each "
                               "iteration")
        return self.sent.pop((iteration, k))

    def first_call_id(self) -> int | None:
        """The first call id of the generations sent and not yet taken (None: none)."""
        return min((call_of(batch).call_id for batch in self.sent.values()), default=None)

    def calls_of(self, iteration: int) -> list[PendingCall]:
        """The pending calls of the generations sent for `iteration` that its program has not taken yet."""
        return [call_of(batch) for (i, _), batch in self.sent.items() if i == iteration]


def call_of(batch: Batch) -> PendingCall:
    """The generate call whose outputs a batch of futures holds."""
    return next(iter(batch.values())).call


class _ProgramActor:
    """The actor as one iteration's program sees it: its generate calls take the generations sent ahead."""

    def __init__(self, actor: ActorRole, generations: Generations, iteration: int, first: int) -> None:
        self._actor, self._generations, self._iteration, self._first = actor, generations, iteration, first
        self.calls: list[PendingCall] = []  # the generations it was handed, in the program's order

    def generate(self, batch: Batch, n: int = 1, greedy: bool = False) -> Batch:
        out = self._generations.take(self._iteration, len(self.calls), (n, greedy), self._first)
        self.calls.append(call_of(out))
        return out

    def __getattr__(self, name: str):
        return getattr(self._actor, name)


def run_pipelined(plan: Plan, roles: dict, checked: preflight.Checked, options: ExecuteOptions, recorder: Recorder,
                  progress: Progress | None = None) -> Iterator[IterationReport]:
    """controller.run_iterations for a plan whose workload has staleness > 0 (and so a rollout set)."""
    progress = progress or start_progress(plan, checked, options)
    controller = ExecutionController(progress.state, recorder)
    algorithm = get_algorithm(plan.workload.algorithm)
    generator = algorithm.generator
    actor = roles[generator]
    staleness, first = plan.workload.staleness, progress.iteration
    generations = Generations(actor, staleness, options.iterations)

    def draw(iteration: int) -> None:
        if iteration < options.iterations and iteration not in generations.prompts:
            handed = progress.stream.next_batch()
            generations.prompts[iteration] = (handed, checked.encode(handed.prompts))

    for ahead in range(first, first + staleness + 1):
        draw(ahead)
    while progress.iteration < options.iterations:
        iteration = progress.iteration
        handed, prompts = generations.prompts[iteration]
        recorder.start_iteration(handed.columns)
        if iteration > first:
            draw(iteration + staleness)
            for k, signature in enumerate(generations.signatures):
                generations.send(iteration + staleness, k, signature)
        program_actor = _ProgramActor(actor, generations, iteration, first)
        updates = algorithm.program({**roles, generator: program_actor}, Batch(prompts=prompts), controller)
        update_metrics = {name: resolved(value) for name, value in updates.items()}
        del generations.prompts[iteration]
        # the workers keep the generations sent ahead for the iterations that read them (an evaluation between)
        recorder.hold_from = generations.first_call_id()
        for call in generations.calls_of(iteration + staleness):
            call.outputs()  # the generation that ran in this window: its spans, before the sync's
        if iteration + 1 < options.iterations:
            actor.sync_rollout()
        elapsed = time.time() - recorder.origin
        recorder.finish_iteration()
        for call in program_actor.calls:  # the metrics read this iteration's responses, not the window's generation
            recorder.observed[call.label] = call.outputs()
        yield finish_iteration_report(plan, options, checked, roles, recorder, progress, iteration, elapsed,
                                      update_metrics)
