"""Sets of one plan computing at once on a shared host: processor sharing in the simpy engine.

On CPU processes (Compute.host_parallelism) the ranks of one host share its cores. A call's seconds are priced with
its own set's ranks computing at once (costs.on_shared_host); where another set on the same host computes at the
same moment, both slow further, and so do they beside the controller's process (the set ON_CONTROLLER, one rank on
the first host: its steps, and its own CPU of the iteration, engine.Hosts.controller_s). Each stretch of computing
(a call, its dispatch, a layout switch) is work that advances at host_slowdown(own ranks) / host_slowdown(ranks of
the host computing now) per second, the rates recomputed whenever a stretch on the host starts or ends. Alone on
its host a stretch takes its priced seconds. Sharing only slows, so a schedule priced with every set alone
(schedule.Precedence) is a lower bound of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field

import simpy

Ranks = Mapping[int, Mapping[int, int]]  # set index -> {node: ranks of the set on it}


@dataclass(eq=False)
class _Stretch:
    remaining: float  # seconds of work left at `rate` 1
    done: simpy.Event
    since: float = 0.0
    rate: float = 1.0
    version: int = 0
    nodes: tuple[tuple[int, int], ...] = field(default=())


class SharedHosts:
    """The hosts of one simulated iteration: `ranks` for every set, `slowdown(k)` how much slower each of k ranks
    of a host computes while all of them do (Compute.host_slowdown)."""

    def __init__(self, env: simpy.Environment, ranks: Ranks, slowdown: Callable[[int], float]) -> None:
        self.env, self.slowdown = env, slowdown
        self.ranks = {index: tuple(per_node.items()) for index, per_node in ranks.items()}
        self.busy: dict[int, int] = {}  # node -> ranks computing on it now
        self.active: dict[int, _Stretch] = {}
        self._ids = itertools.count()

    def compute(self, set_index: int, seconds: float) -> Generator[simpy.Event, None, None]:
        """Run `seconds` of the set's work (priced with the set alone on its hosts) as the hosts allow."""
        if seconds <= 0:
            return
        stretch = _Stretch(seconds, self.env.event(), self.env.now, nodes=self.ranks[set_index])
        self._advance()
        self.active[next(self._ids)] = stretch
        for node, ranks in stretch.nodes:
            self.busy[node] = self.busy.get(node, 0) + ranks
        self._reschedule()
        yield stretch.done

    def _advance(self) -> None:
        """Every active stretch's work done since its last rate change."""
        now = self.env.now
        for stretch in self.active.values():
            stretch.remaining = max(0.0, stretch.remaining - (now - stretch.since) * stretch.rate)
            stretch.since = now

    def _rate(self, stretch: _Stretch) -> float:
        return min(self.slowdown(ranks) / self.slowdown(self.busy[node]) for node, ranks in stretch.nodes)

    def _reschedule(self) -> None:
        for key, stretch in self.active.items():
            stretch.rate = self._rate(stretch)
            stretch.version += 1
            timer = self.env.timeout(stretch.remaining / stretch.rate)
            timer.callbacks.append(lambda _event, key=key, version=stretch.version: self._finish(key, version))

    def _finish(self, key: int, version: int) -> None:
        stretch = self.active.get(key)
        if stretch is None or stretch.version != version:  # rescheduled since: a later timer ends it
            return
        self._advance()
        del self.active[key]
        for node, ranks in stretch.nodes:
            self.busy[node] -= ranks
        self._reschedule()
        stretch.done.succeed()
