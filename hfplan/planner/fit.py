"""Whether the roles of a colocated set fit one GPU's memory together, and the least memory some of them take."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hfplan.planner.facts import SearchFacts, SetKey
from hfplan.planner.options import RoleOptions
from hfplan.planner.strategies import RoleChoices, RoleOption


@dataclass(frozen=True)
class MemoryFront:
    """Joint choices of some colocated roles, none needing more of both than another: the resident bytes they
    hold together and their largest transient, row by row, sorted by resident."""

    resident: np.ndarray
    transient: np.ndarray

    @property
    def empty(self) -> bool:
        return not len(self.resident)


NO_ROLES = MemoryFront(np.zeros(1), np.zeros(1))  # the front of no roles: one row of zeros


@dataclass
class FitCaches:
    """What SetFit computed, by set; a search's two contexts (hybrid engine, rollout set) share one."""

    fits: dict[SetKey, bool] = field(default_factory=dict)
    fronts: dict[SetKey, MemoryFront] = field(default_factory=dict)


class SetFit:
    """Memory of colocated sets: whether a set fits at all, and the least memory the roles of a set still to
    choose can take beside those chosen."""

    def __init__(self, facts: SearchFacts, options: RoleOptions, caches: FitCaches | None = None) -> None:
        self.facts, self.options = facts, options
        self.caches = FitCaches() if caches is None else caches

    def set_fits(self, roles: tuple[str, ...], gpus: int) -> bool:
        """Whether some choice of strategies for these colocated roles fits one GPU's memory (their
        resident states, the largest call, and for the generating role one sequence's KV cache)."""
        key = self.facts.set_key(roles, gpus)
        if key not in self.caches.fits:
            choices = [self.options.choices(r, gpus) for r in roles]
            self.caches.fits[key] = all(c.options for c in choices) and self._fits_from(roles, choices, 0, 0.0, 0.0,
                                                                                         None)
        return self.caches.fits[key]

    def _fits_from(self, roles: tuple[str, ...], choices: list[RoleChoices], depth: int, held: float,
                   transient: float, gen: RoleOption | None) -> bool:
        usable = self.facts.usable
        if depth == len(roles):
            return gen is None or usable - held - gen.memory.gen_extra >= gen.memory.kv_per_sequence
        rest = choices[depth + 1:]
        rest_resident = sum(float(c.resident.min()) for c in rest)
        rest_transient = max((float(c.transient.min()) for c in rest), default=0.0)
        here = choices[depth]
        total = held + here.resident + rest_resident
        fits = total + np.maximum(np.maximum(transient, here.transient), rest_transient) <= usable
        is_gen = roles[depth] == self.facts.generator
        for k in np.flatnonzero(fits):
            option = here.options[k]
            chosen_gen = option if is_gen else gen
            if chosen_gen is not None and (usable - total[k] - chosen_gen.memory.gen_extra
                                           < chosen_gen.memory.kv_per_sequence):
                continue
            if self._fits_from(roles, choices, depth + 1, held + option.memory.resident,
                               max(transient, option.memory.transient), chosen_gen):
                return True
        return False

    def memory_front(self, roles: tuple[str, ...], gpus: int) -> MemoryFront:
        """The least memory these colocated roles can take together: their joint choices, none needing more of
        both than another, none over a GPU. No roles: one row of zeros. A partial choice whose held bytes leave
        room for no row cannot be completed, so the search drops it (an exact cut: it prunes only choices that
        cannot fit)."""
        key = self.facts.set_key(roles, gpus)
        if key not in self.caches.fronts:
            front = NO_ROLES
            for role in roles:
                c = self.options.choices(role, gpus)
                resident = (c.resident[:, None] + front.resident[None, :]).ravel()
                transient = np.maximum(c.transient[:, None], front.transient[None, :]).ravel()
                keep = resident + transient <= self.facts.usable
                front = _front_2d(resident[keep], transient[keep])
            self.caches.fronts[key] = front
        return self.caches.fronts[key]


def _front_2d(resident: np.ndarray, transient: np.ndarray) -> MemoryFront:
    """The rows of (resident, transient) no other row beats on both (ties: one kept), sorted by resident."""
    order = np.lexsort((transient, resident))
    resident, transient = resident[order], transient[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], transient)))[:-1]
    keep = transient < best_before
    return MemoryFront(resident[keep], transient[keep])
