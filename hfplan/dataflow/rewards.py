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


ARITH_MAX = 40  # the arithmetic prompts' numbers and answers lie in 0..ARITH_MAX


def _arith_answer_and_guess(prompt: str, response: str) -> tuple[int, int] | None:
    """The answer to an `add A B =` or `sub A B =` prompt and the number the response starts with."""
    words, given = prompt.split(), response.split()
    if len(words) < 3 or words[0] not in ("add", "sub") or not given:
        return None
    try:
        a, b, guess = int(words[1]), int(words[2]), int(given[0])
    except ValueError:
        return None
    return (a + b if words[0] == "add" else a - b), guess


@register_rule("arith-exact")
def arith_exact(prompt: str, response: str) -> float:
    """1 when the response's first word is the answer to an `add A B =` or `sub A B =` prompt, else 0."""
    found = _arith_answer_and_guess(prompt, response)
    return 1.0 if found is not None and found[0] == found[1] else 0.0


@register_rule("arith-close")
def arith_close(prompt: str, response: str) -> float:
    """Partial credit: 1 - |guess - answer| / 40 when the response starts with a number (0 otherwise), so a
    random model's samples differ in reward and GRPO's advantages are not all zero; 1 only for the answer."""
    found = _arith_answer_and_guess(prompt, response)
    if found is None:
        return 0.0
    answer, guess = found
    return max(0.0, 1.0 - abs(guess - answer) / ARITH_MAX)
