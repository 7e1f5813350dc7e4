"""Rewards computed on the controller from decoded text (never by evaluating user code).

A workload names one as `reward:` (or `cost:`) in one of two forms:
- `rule:<name>`: a rule registered by name: built in (below), or from the entry-point group `hfplan.rewards`
  of an installed package (each entry point names a reward function);
- `module:function`: a reward function of an installed package (or of the Python path), imported by name.
Either is trusted code the user chose to install: hfplan imports it, never evaluates text or runs a file.

The calling convention is batched: `fn(prompts, responses, columns)` gets the iteration's decoded prompts and
responses (lists of str, one entry per sampled sequence) and `columns`, the prompts file's other columns (name ->
list, one value per sequence: a prompt's values repeated for each of its samples), and returns one number per
sequence. The built-in rules are per-row functions (prompt, response) -> float, adapted by `per_row`.
Resolving a reference for the planner imports nothing (`check_reward_ref`): the simulator only needs to know
the role runs on the controller; `load_reward` imports it when a run starts.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hfplan.dataflow.plugins import OBJECT_REF, import_object, installed, load_entry_point
from hfplan.errors import HfplanError, known_names

RULE_PREFIX = "rule:"
ENTRY_POINT_GROUP = "hfplan.rewards"

RuleFn = Callable[[str, str], float]  # a per-row rule: (prompt, response) -> score
RewardFn = Callable[[list[str], list[str], dict[str, list]], Sequence[float]]  # the batched convention

_RULES: dict[str, RuleFn] = {}


def register_rule(name: str) -> Callable[[RuleFn], RuleFn]:
    def add(fn: RuleFn) -> RuleFn:
        if name in _RULES:
            raise ValueError(f"rule {name!r} registered twice")
        _RULES[name] = fn
        return fn

    return add


def rule_names() -> list[str]:
    """The built-in rules and those the installed packages declare (nothing is imported)."""
    return sorted(set(_RULES) | set(installed(ENTRY_POINT_GROUP)))


def check_rule(name: str) -> None:
    if name not in _RULES and name not in installed(ENTRY_POINT_GROUP):
        raise HfplanError(f"unknown reward rule {name!r}; registered rules: {known_names(rule_names())} (built in, "
                          f"or from the {ENTRY_POINT_GROUP} entry points of installed packages)")


def get_rule(name: str) -> RuleFn:
    """A built-in per-row rule."""
    if name not in _RULES:
        raise HfplanError(f"unknown built-in reward rule {name!r}; built-in rules: {known_names(_RULES)}")
    return _RULES[name]


@functools.lru_cache(maxsize=1024)
def is_rule(ref: str) -> bool:
    """Whether a role's reference is a reward computed on the controller (not a model). Cached: the search and
    the simulator ask it of the same few references millions of times."""
    return ref.startswith(RULE_PREFIX) or OBJECT_REF.fullmatch(ref) is not None


def check_reward_ref(ref: str) -> None:
    """What the planner checks of a controller reward: a rule's name is registered (an installed one by its
    entry point's name); a `module:function` is only well formed (imported when a run starts)."""
    if ref.startswith(RULE_PREFIX):
        check_rule(ref[len(RULE_PREFIX):])
    elif not is_rule(ref):
        raise HfplanError(f"{ref!r} is neither rule:<name> nor module:function (an importable function)")


@dataclass(frozen=True)
class Reward:
    """A loaded controller reward: the reference the workload gives and its batched function."""

    ref: str
    fn: RewardFn


def load_reward(ref: str) -> Reward:
    """Import the reward a reference names (HfplanError in one line naming it: not installed, no such
    function, not callable)."""
    if ref.startswith(RULE_PREFIX):
        name = ref[len(RULE_PREFIX):]
        check_rule(name)
        points = installed(ENTRY_POINT_GROUP)
        if name in _RULES:
            if name in points:
                raise HfplanError(f"reward {ref}: entry point {points[name].value} of {ENTRY_POINT_GROUP} has the "
                                  "name of a built-in rule; rename it")
            return Reward(ref, per_row(_RULES[name]))
        found = load_entry_point(points[name])
    elif is_rule(ref):
        try:
            found = import_object(ref)
        except HfplanError as error:
            raise HfplanError(f"reward function {ref}: {error}") from None
    else:
        raise HfplanError(f"reward {ref!r}: expected rule:<name> or module:function")
    if not callable(found):
        raise HfplanError(f"reward function {ref}: is a {type(found).__name__}, not a function")
    _check_signature(ref, found)
    return Reward(ref, found)


def _check_signature(ref: str, fn: Callable) -> None:
    """A function that cannot take (prompts, responses, columns) is refused before the run, not at its first call."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): its first call will tell
    try:
        signature.bind([], [], {})
    except TypeError:
        raise HfplanError(f"reward function {ref}: takes {signature}, but is called as fn(prompts, responses, "
                          "columns) (a per-row rule (prompt, response) -> float is wrapped with "
                          "hfplan.dataflow.rewards.per_row)") from None


class RewardFailed(Exception):
    """A reward function raised or returned a bad value during a run (one line naming it and the row)."""


class _RowRaised(Exception):
    def __init__(self, row: int, error: Exception) -> None:
        super().__init__(row, error)
        self.row, self.error = row, error


def per_row(rule: RuleFn) -> RewardFn:
    """A per-row rule (prompt, response) -> score behind the batched convention; an exception names its row."""
    def batched(prompts: list[str], responses: list[str], columns: dict[str, list]) -> list[float]:
        del columns
        out = []
        for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            try:
                out.append(rule(prompt, response))
            except Exception as error:
                raise _RowRaised(row, error) from error
        return out

    return batched


def columns_per_row(columns: Mapping[str, Sequence], rows: int) -> dict[str, list]:
    """Per-prompt columns repeated for each of a prompt's samples (generate repeats each prompt n times,
    consecutively): `rows` must be a multiple of the prompts."""
    if not columns:
        return {}
    prompts = len(next(iter(columns.values())))
    if prompts == 0 or rows % prompts:
        raise ValueError(f"{rows} sequences are not samples of {prompts} prompts")
    n = rows // prompts
    return {name: [values[row // n] for row in range(rows)] for name, values in columns.items()}


def score_rows(reward: Reward, prompts: list[str], responses: list[str], columns: Mapping[str, list]) -> np.ndarray:
    """One score per row, each a finite number (RewardFailed: one line naming the function and the row)."""
    try:
        out = reward.fn(list(prompts), list(responses), {name: list(values) for name, values in columns.items()})
    except _RowRaised as raised:
        raise RewardFailed(f"reward {reward.ref} raised on {_row(raised.row, prompts, responses)}: "
                           f"{type(raised.error).__name__}: {raised.error}") from raised.error
    except Exception as error:
        raise RewardFailed(f"reward {reward.ref} raised on a batch of {len(prompts)} rows: "
                           f"{type(error).__name__}: {error}") from error
    if isinstance(out, str | bytes | Mapping) or not isinstance(out, Sequence | np.ndarray):
        raise RewardFailed(f"reward {reward.ref} returned a {type(out).__name__}, not a list of numbers (one per "
                           "row)")
    values = list(out)
    if len(values) != len(prompts):
        raise RewardFailed(f"reward {reward.ref} returned {len(values)} values for {len(prompts)} rows")
    for row, value in enumerate(values):
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            raise RewardFailed(f"reward {reward.ref} returned {value!r} ({type(value).__name__}, not a number) for "
                               f"{_row(row, prompts, responses)}")
        if not math.isfinite(value):
            raise RewardFailed(f"reward {reward.ref} returned {value} for {_row(row, prompts, responses)}")
    return np.array(values, dtype=np.float32)


def _row(row: int, prompts: list[str], responses: list[str]) -> str:
    return f"row {row} of {len(prompts)} (prompt {_short(prompts[row])}, response {_short(responses[row])})"


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


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
