"""Asynchronous RLHF's steady state: one window of the pipelined schedule (Workload.staleness > 0).

With a separate rollout set and staleness k >= 1, the controller runs the traced program in windows. Window j
starts with the generation of iteration j + k on the rollout set (its weights are those after update j - 1) and,
at the same time, the rest of iteration j (preparation and training) on the other sets, whose responses the
window j - k generated; when every call of the window has finished, the actor's new weights go to the rollout
set (the weight sync, one per update), and the next window starts. So the rollout set never waits for training
and training never waits for generation, except at the sync: one window is

    max(generation, the rest of the iteration) + the weight sync

when the two sides share no GPUs (and their longest path, when some role shares the rollout set). A longer
staleness keeps more generations in flight but has the same window, so the search proposes 1.

The window is the traced program itself with one change: the generate calls' outputs come from an earlier
window, so the edges from them start at the window's start. They are drawn from a zero-second call on the
rollout set, `PREVIOUS`, placed first; the generate calls run in the window for a later iteration, their
outputs read by no call of it. Its schedule is the schedule rule's (hfplan.simulator.schedule), run by the same
simpy engine (hfplan.simulator.engine.run_pipelined) and, as a longest path, by the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hfplan.simulator.schedule import Precedence, controller_fetches
from hfplan.simulator.trace import Dag, Edge, Node

PREVIOUS = "previous window"  # the role of the zero-second call whose outputs are the earlier generations'


def window_dag(dag: Dag) -> Dag:
    """The traced program as one window: a PREVIOUS call first (id 0), then every traced call (ids shifted by
    one) with its inputs from generate calls taken from PREVIOUS instead."""
    generated = {n.id for n in dag.nodes if n.op == "generate"}
    first = next(n for n in dag.nodes if n.op == "generate")
    previous = Node(0, PREVIOUS, "generate", first.phase, first.sequences, (), first.writes)
    nodes = [previous]
    for n in dag.nodes:
        deps = tuple(Edge(0 if e.src in generated else e.src + 1, e.nbytes, e.fields) for e in n.deps)
        nodes.append(replace(n, id=n.id + 1, deps=deps))
    return Dag(dag.algorithm, tuple(nodes))


def generation_set(dag: Dag, sets: Sequence[int]) -> int:
    """The set the generate calls run on (the rollout set): where PREVIOUS's outputs are."""
    return sets[next(n.id for n in dag.nodes if n.op == "generate")]


@dataclass(frozen=True)
class Pipelined:
    """The window's schedule as a longest path: durations of the traced calls (no layout switch in them), and
    the weight sync after the window."""

    precedence: Precedence

    @classmethod
    def of(cls, dag: Dag, sets: Sequence[int], edge_seconds: Callable[[int, int, float], float] | None = None
           ) -> Pipelined:
        """sets: the set of each traced call; edge_seconds as Precedence.of's. The controller's fetches are those
        of the traced program (as the engine's window takes them from its scheduled calls)."""
        window = window_dag(controller_fetches(dag, sets))
        return cls(Precedence.of_inputs(window, [generation_set(dag, sets), *sets], edge_seconds))

    def window(self, durations: Sequence[float], sync: float) -> float:
        """Seconds of one steady-state iteration: the window's makespan plus the weight sync."""
        return self.precedence.makespan([0.0, *durations]) + sync

    def window_many(self, rows: np.ndarray, syncs: np.ndarray) -> np.ndarray:
        """window() of many rows of durations at once (rows x calls), with one sync per row."""
        return self.precedence.makespan_many(np.hstack([np.zeros((len(rows), 1)), rows])) + syncs
