"""The rows no other row dominates: the search's one rule for dropping what can never be needed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pareto(vectors: np.ndarray, keys: Sequence[object] | None = None) -> list[int]:
    """Indices of rows not dominated by another row with the same key (<= everywhere, < somewhere).
    Exact duplicates keep their first occurrence."""
    n = len(vectors)
    if n <= 1:
        return list(range(n))
    groups: dict[object, list[int]] = {None: list(range(n))} if keys is None else {}
    if keys is not None:
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
    keep: list[int] = []
    for members in groups.values():
        if len(members) == 1:
            keep.extend(members)
            continue
        sub = vectors[members]
        rest = _not_below_minima(sub)
        sub = sub[rest]
        order = np.lexsort(sub.T[::-1])
        keep.extend(members[k] for k in rest[order[_first_undominated(sub[order])]].tolist())
    return sorted(keep)


def _not_below_minima(rows: np.ndarray) -> np.ndarray:
    """Positions of the rows that no minimum row (the first holding a column's least value) is <= everywhere
    while differing from or coming before it. The others are off the front, often nearly all rows, and dropping
    them before the sort changes no other row's fate: whatever they are below, the minimum row is below too."""
    firsts = np.unique(rows.argmin(axis=0))
    below = np.ones((len(firsts), len(rows)), dtype=bool)
    equal = np.ones((len(firsts), len(rows)), dtype=bool)
    for c in range(rows.shape[1]):
        below &= rows[firsts, c, None] <= rows[None, :, c]
        equal &= rows[firsts, c, None] == rows[None, :, c]
    return np.flatnonzero(~(below & (~equal | (firsts[:, None] < np.arange(len(rows))[None, :]))).any(axis=0))


def _first_undominated(rows: np.ndarray, block: int = 256) -> np.ndarray:
    """Positions of the lexicographically sorted rows that no earlier row is <= everywhere. A row <= another
    everywhere, and not equal, sorts before it, so these are the undominated rows (a duplicate's first copy).
    A block of rows at a time, column by column: within the block (a row below a dropped one is below what
    dropped it, so any earlier row of the block may drop it), then every later row against the block's kept."""
    columns = range(rows.shape[1])
    at = np.arange(len(rows))
    out = []
    while len(rows):
        here = rows[:block]
        below = np.ones((len(here), len(here)), dtype=bool)  # below[i, j]: row i <= row j everywhere
        for c in columns:
            below &= here[:, None, c] <= here[None, :, c]
        alive = ~np.triu(below, 1).any(axis=0)
        kept, rows = here[alive], rows[block:]
        out.append(at[:block][alive])
        at = at[block:]
        if len(rows):
            dropped = np.ones((len(rows), len(kept)), dtype=bool)  # dropped[j, i]: kept row i <= row j
            for c in columns:
                dropped &= kept[None, :, c] <= rows[:, c, None]
            alive = ~dropped.any(axis=1)
            rows, at = rows[alive], at[alive]
    return np.concatenate(out)
