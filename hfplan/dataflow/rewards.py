"""Rule-based rewards, chosen by registered name (never by evaluating user code).

A workload names one as `reward: rule:<name>` (or `cost: rule:<name>`); the controller computes it on
decoded text, so the role needs no GPU.
"""

from __future__ import annotations

from collections.abc import Callable

from hfplan.errors import HfplanError, known_names

RuleFn = Callable[[str, str], float]

_RULES: dict[str, RuleFn] = {}


def register_rule(name: str) -> Callable[[RuleFn], RuleFn]:
    def add(fn: RuleFn) -> RuleFn:
        if name in _RULES:
            raise ValueError(f"rule {name!r} registered twice")
        _RULES[name] = fn
        return fn

    return add


def rule_names() -> list[str]:
    return sorted(_RULES)


def check_rule(name: str) -> None:
    if name not in _RULES:
        raise HfplanError(f"unknown reward rule {name!r}; registered rules: {known_names(_RULES)}")


def get_rule(name: str) -> RuleFn:
    check_rule(name)
    return _RULES[name]


@register_rule("vowel-fraction")
def vowel_fraction(prompt: str, response: str) -> float:
    """Share of the response's characters that are vowels: a signal a tiny model can learn in a few steps."""
    del prompt
    return sum(ch in "aeiouAEIOU" for ch in response) / len(response) if response else 0.0


@register_rule("distinct-chars")
def distinct_chars(prompt: str, response: str) -> float:
    """Share of distinct characters in the response: penalises degenerate repetition."""
    del prompt
    return len(set(response)) / len(response) if response else 0.0


@register_rule("arith-exact")
def arith_exact(prompt: str, response: str) -> float:
    """1 when the response's first word is the answer to an `add A B =` or `sub A B =` prompt, else 0."""
    words = prompt.split()
    if len(words) < 3 or words[0] not in ("add", "sub"):
        return 0.0
    try:
        a, b = int(words[1]), int(words[2])
    except ValueError:
        return 0.0
    answer = a + b if words[0] == "add" else a - b
    given = response.split()
    return 1.0 if given and given[0] == str(answer) else 0.0
