"""planner/pareto.py's pareto against its definition, checked pair by pair."""

from __future__ import annotations

import numpy as np
import pytest

from hfplan.planner.pareto import pareto


def by_definition(vectors: np.ndarray, keys: list[int] | None) -> list[int]:
    """Row i stays unless a row j with its key is <= it everywhere and differs from it or comes first."""
    n = len(vectors)
    below = np.all(vectors[:, None, :] <= vectors[None, :, :], axis=2)  # below[j, i]: row j <= row i
    differs = np.any(vectors[:, None, :] != vectors[None, :, :], axis=2)
    first = np.arange(n)[:, None] < np.arange(n)[None, :]  # first[j, i]: j comes before i
    same = np.ones((n, n), dtype=bool) if keys is None else np.equal.outer(keys, keys)
    drops = below & same & (differs | first) & ~np.eye(n, dtype=bool)
    return [i for i in range(n) if not drops[:, i].any()]


@pytest.mark.parametrize("seed", range(12))
def test_pareto_keeps_exactly_the_undominated_rows(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 600))  # up to a few blocks of rows
    columns = int(rng.integers(1, 6))
    vectors = rng.integers(0, 6, size=(n, columns)).astype(float)  # few values: ties and duplicates
    if seed % 3 == 0:
        vectors[:, 0] = -vectors[:, 1:].sum(axis=1)  # a trade-off: many rows survive
    if seed % 4 == 1:
        vectors[rng.random((n, columns)) < 0.1] = np.inf
    keys = [int(k) for k in rng.integers(0, 3, n)] if seed % 2 else None
    assert pareto(vectors, keys) == by_definition(vectors, keys)


def test_pareto_of_a_hand_made_front():
    rows = np.array([[3.0, 1.0], [1.0, 3.0], [2.0, 2.0], [2.0, 2.0], [3.0, 3.0], [1.0, 4.0]])
    # (3, 3) is above (2, 2); (1, 4) above (1, 3); the second (2, 2) duplicates the first
    assert pareto(rows) == [0, 1, 2]
    assert pareto(rows, [0, 0, 0, 1, 1, 1]) == [0, 1, 2, 3, 5]
