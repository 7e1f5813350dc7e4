"""The algorithms hfplan knows: each registered once, with its program and the facts of its roles.

Built-in algorithms are registered here; a user's come from the Python entry-point group
`hfplan.algorithms` of a package they install (each entry point names an `Algorithm`), so every
process, Ray workers included, finds them the same way. Everything that needs a role list or a role's
nature (the workload schema, the catalog, the plan's checks, the simulator, the planner) asks here
instead of testing role names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hfplan.dataflow import algorithms as programs
from hfplan.dataflow.plugins import installed, load_entry_point
from hfplan.dataflow.roles import ACTOR, COST, COST_CRITIC, CRITIC, REFERENCE, REWARD, RoleFacts
from hfplan.errors import HfplanError, known_names

ENTRY_POINT_GROUP = "hfplan.algorithms"
# The pseudo-role of a separate generation engine; no algorithm may name a role so.
ROLLOUT = "rollout"


Program = Callable[[Mapping[str, Any], Any, Any], dict]


@dataclass(frozen=True)
class Algorithm:
    """One RLHF algorithm: its single-controller program and its roles (in a stable order)."""

    name: str
    program: Program
    roles: Mapping[str, RoleFacts]
    min_samples_per_prompt: int = 1  # e.g. group-normalised advantages need two responses per prompt
    # Whether the program reads the actor's log-probs only in the actor's loss (not in rewards or advantages),
    # so that a workload with one optimizer step per iteration may skip the call (reuse_policy_log_probs).
    policy_log_probs_only_in_loss: bool = False
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        generators = [r for r, f in self.roles.items() if f.generates]
        if len(generators) != 1:
            raise ValueError(f"algorithm {self.name!r}: exactly one role must generate, found {generators}")
        facts = self.roles[generators[0]]
        if not facts.trains or facts.head != "lm" or facts.may_be_rule:
            raise ValueError(f"algorithm {self.name!r}: the generating role must be a trained language model")
        if ROLLOUT in self.roles:
            raise ValueError(f"algorithm {self.name!r}: {ROLLOUT!r} is reserved for a separate generation engine")
        for role, f in self.roles.items():
            if f.may_be_rule and (f.trains or f.head != "scalar"):
                raise ValueError(f"algorithm {self.name!r}: role {role!r} may be a rule only if untrained with a "
                                 "scalar head")

    @property
    def generator(self) -> str:
        """The role that generates (the actor)."""
        return next(r for r, f in self.roles.items() if f.generates)


_REGISTRY: dict[str, Algorithm] = {}
_entry_points_loaded = False


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in _REGISTRY and _REGISTRY[algorithm.name] != algorithm:
        raise ValueError(f"algorithm {algorithm.name!r} registered twice")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def unregister_algorithm(name: str) -> None:
    """Drop a registered algorithm (tests that register a temporary one)."""
    _REGISTRY.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in installed(ENTRY_POINT_GROUP).values():
        loaded = load_entry_point(point)
        if not isinstance(loaded, Algorithm):
            raise HfplanError(f"entry point {point.name!r} of {ENTRY_POINT_GROUP}: {point.value} is a "
                              f"{type(loaded).__name__}, not an hfplan.dataflow.registry.Algorithm")
        register_algorithm(loaded)


def algorithms() -> dict[str, Algorithm]:
    """Every registered algorithm, built-in and installed, by name."""
    _load_entry_points()
    return dict(_REGISTRY)


def get_algorithm(name: str) -> Algorithm:
    found = _REGISTRY.get(name)
    if found is None:
        _load_entry_points()
        found = _REGISTRY.get(name)
    if found is None:
        raise HfplanError(f"unknown algorithm {name!r}; registered algorithms: {known_names(_REGISTRY)}")
    return found


def role_facts(algorithm: str, role: str) -> RoleFacts:
    try:
        return get_algorithm(algorithm).roles[role]
    except KeyError:
        raise ValueError(f"algorithm {algorithm!r} has no role {role!r}") from None


BUILTIN_ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("ppo", programs.ppo, {"actor": ACTOR, "critic": CRITIC, "reference": REFERENCE, "reward": REWARD},
              description="PPO with GAE (a critic) and a KL penalty against the reference"),
    Algorithm("grpo", programs.grpo, {"actor": ACTOR, "reference": REFERENCE, "reward": REWARD},
              min_samples_per_prompt=2, policy_log_probs_only_in_loss=True,
              description="GRPO: advantages normalised within each prompt's group"),
    Algorithm("remax", programs.remax, {"actor": ACTOR, "reference": REFERENCE, "reward": REWARD},
              description="ReMax: a greedy response's reward as the baseline"),
    Algorithm("safe-rlhf", programs.safe_rlhf,
              {"actor": ACTOR, "critic": CRITIC, "reference": REFERENCE, "reward": REWARD, "cost": COST,
               "cost_critic": COST_CRITIC},
              description="Safe-RLHF: a cost model and cost critic under a Lagrange multiplier"),
)}
_REGISTRY.update(BUILTIN_ALGORITHMS)
