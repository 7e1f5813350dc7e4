"""The context of one search: its facts (planner/facts.py) and its three jobs, each caching its work by the facts'
keys: a role's options on A GPUs (planner/options.py), the memory of a colocated set (planner/fit.py), and the
floors bounds are made of (planner/bounds.py)."""

from __future__ import annotations

from typing import NamedTuple

from hfplan.planner.bounds import Floor, Floors
from hfplan.planner.facts import SearchFacts
from hfplan.planner.fit import SetFit
from hfplan.planner.options import Family, RoleChoices, RoleOptions
from hfplan.planner.strategies import Rules
from hfplan.profiles.hardware import HardwareProfile
from hfplan.simulator.costs import CostMemo
from hfplan.simulator.trace import Dag
from hfplan.spec import Workload


class Costed(NamedTuple):
    """What costing one (role, GPU count) cached, for a worker process to hand back (planner/pool.py)."""

    families: list[Family] | None
    choices: RoleChoices | None
    floor: Floor | None


class SearchContext(SearchFacts):
    """One search's facts with its three jobs: options (a role's strategies on A GPUs), fit (the memory of a
    colocated set) and bounds (floors of calls)."""

    def __init__(self, workload: Workload, hw: HardwareProfile, gpus_per_node: int, dag: Dag,
                 rules: Rules | None = None, shared: SearchContext | None = None) -> None:
        """shared: a context of the same search with the other generation engine (same rules otherwise),
        whose cost tables and caches this one uses too: only the generating role's strategies and the sets
        holding it depend on the engine, and their keys say which."""
        super().__init__(workload, hw, gpus_per_node, dag, rules, CostMemo() if shared is None else shared.memo)
        self.options = RoleOptions(self, None if shared is None else shared.options.caches)
        self.fit = SetFit(self, self.options, None if shared is None else shared.fit.caches)
        self.bounds = Floors(self, self.options, None if shared is None else shared.bounds.caches)

    def costed(self, role: str, gpus: int) -> Costed:
        """Cost one (role, GPU count) and return what it cached."""
        floor = self.bounds.floor(role, gpus)
        key = self.role_key(role, gpus)
        return Costed(self.options.caches.families.get(key), self.options.caches.choices.get(key), floor)

    def adopt(self, role: str, gpus: int, costed: Costed) -> None:
        """Take what `costed` computed in another process."""
        key = self.role_key(role, gpus)
        if costed.families is not None:
            self.options.caches.families[key] = costed.families
        if costed.choices is not None:
            self.options.caches.choices[key] = costed.choices
        self.bounds.caches.floors[key] = costed.floor
