"""Batch: the named fields that flow between RLHF calls (prompts, responses, log-probs, rewards...).

A mapping whose values are whatever the backend uses: numpy arrays or tensors (one row per sequence),
lists (decoded text), mappings (an update's metrics), futures of any of these in the executor, and
symbolic placeholders in the tracer. Programs merge batches with `|` and hand each call only the
fields it needs with `select`, which is also what tells the tracer the call's data dependencies.

Values may be futures: a role call may return before its result exists, so that in
`batch | a.log_prob(s) | b.values(s)` both calls are dispatched before either is awaited. Merging,
selecting and renaming never wait; `len`, `chunk`, `concat` and `resolve` do.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Future(Protocol):
    """What a batch value that may not exist yet must offer: the subset of concurrent.futures.Future
    every backend can provide (the executor wraps Ray ObjectRefs in a class of its own)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


def is_future(value: object) -> bool:
    """isinstance(value, Future): typing's check walks the protocol's classes on every call (38 us a call on Python
    3.11, once per field a program merges or resolves: the controller's most frequent check), so its class half is
    asked once per class; the instance half (both methods present and not None) is cheap."""
    return _future_class(type(value)) or (getattr(value, "done", None) is not None
                                          and getattr(value, "result", None) is not None)


@functools.lru_cache(maxsize=256)
def _future_class(cls: type) -> bool:
    return issubclass(cls, Future)


def resolved(value: object, timeout: float | None = None) -> Any:
    """The value itself, waiting for it if it is a future."""
    return value.result(timeout) if is_future(value) else value


def row_split(rows: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` consecutive pieces of `rows` rows, the first `rows % parts` one row
    longer (as np.array_split): how Batch.chunk and the executor's data-parallel dispatch split a batch."""
    if parts < 1:
        raise ValueError(f"a split needs at least one part, got {parts}")
    small, bigger = divmod(rows, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + small + (part < bigger)
        bounds.append((start, end))
        start = end
    return bounds


def _rows(value: object) -> int | None:
    """Sequences a field holds along its first axis; None for values without one (metrics, scalars)."""
    if isinstance(value, Mapping | str | bytes) or not hasattr(value, "__len__") or getattr(value, "ndim", 1) == 0:
        return None
    return len(value)  # type: ignore[arg-type]


def _concat(values: Sequence[Any], name: str) -> Any:
    first = values[0]
    if isinstance(first, list | tuple):
        return [item for value in values for item in value]
    if isinstance(first, np.ndarray):
        return np.concatenate(values)
    raise TypeError(f"cannot concatenate field {name!r} of type {type(first).__name__}")


class Batch(dict):
    def __or__(self, other: Mapping[str, Any]) -> Batch:  # type: ignore[override]
        merged = Batch(self)
        merged.update(other)
        return merged

    def select(self, *names: str) -> Batch:
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"batch lacks field(s) {', '.join(missing)}; it has {', '.join(sorted(self))}")
        return Batch({n: self[n] for n in names})

    def rename(self, **new_names: str) -> Batch:
        """rename(rewards="baseline_rewards") returns the batch with `rewards` called `baseline_rewards`."""
        return Batch({new_names.get(k, k): v for k, v in self.items()})

    def resolve(self, timeout: float | None = None) -> Batch:
        """The batch with every future replaced by its value (waits for them)."""
        return Batch({k: resolved(v, timeout) for k, v in self.items()})

    def __len__(self) -> int:
        """Sequences in the batch: the common first-axis length of its per-sequence fields (0 if it has
        none). Waits for futures."""
        rows = {name: n for name, value in self.items() if (n := _rows(resolved(value))) is not None}
        if len(set(rows.values())) > 1:
            raise ValueError(f"batch fields disagree on the number of sequences: {rows}")
        return next(iter(rows.values()), 0)

    def __bool__(self) -> bool:
        return dict.__len__(self) > 0

    def chunk(self, n: int) -> list[Batch]:
        """n consecutive pieces of near-equal size (the first len % n one sequence longer), as a
        data-parallel dispatch splits a batch; fields without a sequence axis go to every piece."""
        if n < 1:
            raise ValueError(f"chunk needs n >= 1, got {n}")
        concrete = self.resolve()
        return [Batch({k: v[start:stop] if _rows(v) is not None else v for k, v in concrete.items()})
                for start, stop in row_split(len(concrete), n)]

    @staticmethod
    def concat(batches: Sequence[Mapping[str, Any]]) -> Batch:
        """The inverse of chunk: per-sequence fields joined in order; other fields must agree."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        parts = [Batch(b).resolve() for b in batches]
        names = list(parts[0])
        for part in parts[1:]:
            if set(part) != set(names):
                raise ValueError(f"cannot concatenate batches with fields {sorted(names)} and {sorted(part)}")
        out = Batch()
        for name in names:
            values = [part[name] for part in parts]
            if _rows(values[0]) is not None:
                out[name] = _concat(values, name)
            elif all(v == values[0] for v in values[1:]):
                out[name] = values[0]
            else:
                raise ValueError(f"field {name!r} has no sequence axis and differs between the batches")
        return out
