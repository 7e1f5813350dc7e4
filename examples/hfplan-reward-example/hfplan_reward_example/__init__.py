"""Reward functions for hfplan, scored against a reference answer of the prompts file.

hfplan's batched calling convention: `fn(prompts, responses, columns)` gets one entry per sampled sequence
(GRPO's n samples of a prompt are n consecutive rows) and `columns`, the prompts file's columns other than
`prompt`, each a list with one value per row (a prompt's value repeated for each of its samples). It returns
one finite number per row.
"""

from __future__ import annotations

ANSWER_COLUMN = "answer"
SCALE = 40  # partial credit falls to 0 at this distance from the answer


def answer_exact(prompts: list[str], responses: list[str], columns: dict[str, list]) -> list[float]:
    """1 when the response's first word is the row's answer, else 0."""
    return [1.0 if guess == answer else 0.0 for guess, answer in zip(_guesses(responses), _answers(columns),
                                                                      strict=True)]


def answer_close(prompts: list[str], responses: list[str], columns: dict[str, list]) -> list[float]:
    """Partial credit: 1 - |guess - answer| / 40 for a response that starts with a number, else 0."""
    return [0.0 if guess is None else max(0.0, 1.0 - abs(guess - answer) / SCALE)
            for guess, answer in zip(_guesses(responses), _answers(columns), strict=True)]


def _answers(columns: dict[str, list]) -> list[int]:
    if ANSWER_COLUMN not in columns:
        raise ValueError(f"the prompts file needs an {ANSWER_COLUMN!r} column (it has: {', '.join(columns) or 'none'})")
    return [int(value) for value in columns[ANSWER_COLUMN]]


def _guesses(responses: list[str]) -> list[int | None]:
    out: list[int | None] = []
    for response in responses:
        words = response.split()
        try:
            out.append(int(words[0]) if words else None)
        except ValueError:
            out.append(None)
    return out
