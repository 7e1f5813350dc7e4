"""The schedule rule: when each traced call may start, stated once for every timing of a program.

- Each placement set (and the controller) runs its calls one after another, in program order; calls on
  disjoint sets overlap.
- A call starts when its inputs have arrived: an input made elsewhere first crosses the link between
  the two places (hfplan.layout.transfer_path), as a transfer of the edge's bytes.
- The controller fetches a call's outputs once (`controller_fetches`): its first step or rule that reads them
  waits for them; a later one reads them where they are, with no transfer.
- A layout switch is paid by the set right before the call that needs it (`switch_points`): the hybrid
  engine's resharding at every change of the generating role into its generation layout, wherever it
  happens in the program; a separate rollout engine's weight sync before its first generation after
  each update of the generating role (and before its first generation of the iteration).
- A call that opens a Ray task on its workers (`task_openers`, the executor's Dispatch: calls held for a set go as
  one task when something waits) pays the task's opening on top of its dispatch; the calls after it in the task
  pay their dispatch alone.

The simpy engine runs this rule with events; `makespan` and `makespan_many` compute the same finish
time as a longest path (for checking the engine, and as the planner's fast schedule and bounds), and
`critical_path` names that path: the stage times of an estimate are its seconds by phase, so they
partition the iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hfplan.layout import ON_CONTROLLER, ROLLOUT
from hfplan.simulator.trace import Dag, Node

RunsOn = Callable[[Node], "str | None"]  # the placed role whose GPUs run a call (None: the controller)


def controller_fetches(dag: Dag, sets: Sequence[int]) -> Dag:
    """`dag` with the inputs of the controller's steps and rules as they reach it: the executor fetches all of a
    worker call's outputs when the first of them reads any (roles.PendingCall.outputs), so a later one's inputs
    from that call are already in its memory and cross nothing (the controller runs its steps in program order,
    so the first one's wait orders the later one too). `sets`: each node's set (ON_CONTROLLER for the
    controller's own)."""
    fetched: set[int] = set()
    nodes = []
    for node in dag.nodes:
        if sets[node.id] == ON_CONTROLLER:
            from_workers = {e.src for e in node.deps if sets[e.src] != ON_CONTROLLER}
            if from_workers & fetched:
                node = replace(node, deps=tuple(e for e in node.deps if e.src not in fetched))
            fetched |= from_workers
        nodes.append(node)
    return replace(dag, nodes=tuple(nodes))


def task_openers(dag: Dag, sets: Sequence[int]) -> tuple[int, ...]:
    """The calls (node ids) that open a Ray task on their set's workers in a steady-state iteration, as the
    executor's Dispatch groups them (executor/roles.py): a role call is held until something needs it sent, then
    every call held goes, one task per set, the first of each opening it. A send happens when the controller waits
    for a worker's outputs (a step or rule reading them: all held calls go, whichever it reads), when a call reads
    the outputs of a call still held on another set (through a Ray reference), around every generation (it goes
    alone, at once; in steady state the next iteration's is made before the updates' results are read), and at the
    iteration's end. `sets`: each node's set (ON_CONTROLLER for the controller's own)."""
    held: dict[int, list[int]] = {}
    openers: list[int] = []
    dag = controller_fetches(dag, sets)  # a step reading outputs the controller holds already waits for nothing

    def send() -> None:
        openers.extend(calls[0] for calls in held.values())
        held.clear()

    for node in dag.nodes:
        where = sets[node.id]
        producers = [e.src for e in node.deps if sets[e.src] != ON_CONTROLLER]
        if where == ON_CONTROLLER:
            if producers:
                send()
            continue
        if node.op == "generate":
            send()
            held[where] = [node.id]
            send()
            continue
        held_ids = {i for calls in held.values() for i in calls}
        if any(sets[src] != where and src in held_ids for src in producers):
            send()
        held.setdefault(where, []).append(node.id)
    send()
    return tuple(sorted(openers))


def switch_points(dag: Dag, runs_on: RunsOn, trained_generator: str) -> dict[int, str]:
    """Calls before which a role switches layout, with that role. `trained_generator`: the workload role
    whose weights generation uses (its updates make a rollout engine's copy stale)."""
    current: dict[str, str] = {}
    stale = True  # a rollout engine starts the iteration without this iteration's weights
    points: dict[int, str] = {}
    for node in dag.nodes:
        role = runs_on(node)
        if role is None:
            continue
        if role == ROLLOUT:
            if stale:
                points[node.id] = role
                stale = False
            continue
        if node.layout == "gen" and current.get(role, "train") != "gen":
            points[node.id] = role
        current[role] = node.layout
        if role == trained_generator and node.layout == "train":
            stale = True
    return points


def way_back_points(dag: Dag, runs_on: RunsOn, set_of: Callable[[Node], int], switches: dict[int, str]
                    ) -> dict[int, str]:
    """Calls before which a hybrid engine goes back to its training layout, with the role going back: the first
    call on the set, after a role of it switched into generation (switch_points), that is not one more of that
    role's generation calls (executor.runtime.leave_generation_before: the worker leaves generation at the start of
    its next call, once that call's task has reached it). A rollout engine never goes back."""
    generating: dict[int, str] = {}  # set -> its role in the generation layout
    points: dict[int, str] = {}
    for node in dag.nodes:
        index = set_of(node)
        role = generating.get(index)
        if role is not None and not (runs_on(node) == role and node.layout == "gen"):
            points[node.id] = role
            del generating[index]
        switched = switches.get(node.id)
        if switched is not None and switched != ROLLOUT:
            generating[index] = switched
    return points


@dataclass(frozen=True)
class Precedence:
    """What orders the calls of one placement: the set of each call, and the (producer, transfer
    seconds) of each of its inputs."""

    sets: tuple[int, ...]
    deps: tuple[tuple[tuple[int, float], ...], ...]

    @classmethod
    def of(cls, dag: Dag, sets: Sequence[int], edge_seconds: Callable[[int, int, float], float] | None = None
           ) -> Precedence:
        """edge_seconds(source set, destination set, bytes); None: transfers are free (a lower bound). The traced
        `dag`'s inputs reach each call as controller_fetches says."""
        return cls.of_inputs(controller_fetches(dag, sets), sets, edge_seconds)

    @classmethod
    def of_inputs(cls, dag: Dag, sets: Sequence[int], edge_seconds: Callable[[int, int, float], float] | None = None
                  ) -> Precedence:
        """`of` for a dag whose inputs are already those that reach each call (a pipelined window built from the
        traced program after controller_fetches: the window merges the generations, whose outputs the controller
        fetched apart)."""
        deps = tuple(tuple((e.src, edge_seconds(sets[e.src], sets[n.id], e.nbytes) if edge_seconds else 0.0)
                           for e in n.deps) for n in dag.nodes)
        return cls(tuple(sets), deps)

    def makespan(self, durations: Sequence[float]) -> float:
        """Finish time of the last call; durations include each call's switch."""
        finish = [0.0] * len(durations)
        last: dict[int, float] = {}
        for i, secs in enumerate(durations):
            s = self.sets[i]
            ready = last.get(s, 0.0)
            for src, edge in self.deps[i]:
                ready = max(ready, finish[src] + edge)
            finish[i] = ready + secs
            last[s] = finish[i]
        return max(finish, default=0.0)

    def critical_path(self, durations: Sequence[float]) -> list[tuple[int, float]]:
        """The calls of the longest path, last first, each with the seconds of the path it covers: its
        duration (switch included) and the transfer that delivered the input it waited for last (or, for
        the first call, everything before it). The seconds add up to makespan(durations)."""
        finish = [0.0] * len(durations)
        via: list[tuple[int, float]] = []  # (call whose end released this one, transfer seconds); -1: none
        last: dict[int, int] = {}
        for i, secs in enumerate(durations):
            before = last.get(self.sets[i], -1)
            ready, why = (finish[before], (before, 0.0)) if before >= 0 else (0.0, (-1, 0.0))
            for src, edge in self.deps[i]:
                if finish[src] + edge > ready:
                    ready, why = finish[src] + edge, (src, edge)
            finish[i] = ready + secs
            via.append(why)
            last[self.sets[i]] = i
        if not finish:
            return []
        i = max(range(len(finish)), key=finish.__getitem__)
        path = []
        while True:
            src, edge = via[i]
            if src < 0:
                path.append((i, finish[i]))
                return path
            path.append((i, finish[i] - finish[src]))
            i = src

    def makespan_many(self, durations: np.ndarray) -> np.ndarray:
        """makespan() of many rows of durations at once (rows x calls)."""
        finish = np.zeros_like(durations)
        last: dict[int, np.ndarray] = {}
        zero = np.zeros(len(durations))
        for i in range(durations.shape[1]):
            ready = last.get(self.sets[i], zero)
            for src, edge in self.deps[i]:
                ready = np.maximum(ready, finish[:, src] + edge)
            finish[:, i] = ready + durations[:, i]
            last[self.sets[i]] = finish[:, i]
        return finish.max(axis=1) if durations.shape[1] else zero
