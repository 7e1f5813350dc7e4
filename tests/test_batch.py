"""Batch: merging never waits, length and chunks by sequences, concat undoes chunk, futures resolve."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from hfplan.dataflow.batch import Batch, is_future, row_split
from hfplan.dataflow.batch import Future as FutureProtocol


def _batch(n: int) -> Batch:
    return Batch(prompts=np.arange(n * 2).reshape(n, 2), rewards=np.arange(n, dtype=float),
                 text=[f"r{i}" for i in range(n)], metrics={"loss": 1.0})


def test_length_is_sequences_not_fields():
    assert len(_batch(5)) == 5
    assert len(Batch(metrics={"a": 1})) == 0
    assert bool(Batch(metrics={"a": 1})) and not Batch()


def test_length_refuses_fields_that_disagree():
    with pytest.raises(ValueError, match="disagree"):
        len(Batch(a=np.zeros(3), b=np.zeros(4)))


def test_chunk_splits_like_a_data_parallel_dispatch():
    pieces = _batch(5).chunk(2)
    assert [len(p) for p in pieces] == [3, 2]  # the first 5 % 2 pieces one longer
    assert pieces[0]["text"] == ["r0", "r1", "r2"] and pieces[1]["rewards"].tolist() == [3.0, 4.0]
    assert all(p["metrics"] == {"loss": 1.0} for p in pieces)  # no sequence axis: every piece gets it
    assert [len(p) for p in _batch(2).chunk(3)] == [1, 1, 0]


@pytest.mark.parametrize(("rows", "parts"), [(0, 1), (5, 2), (2, 3), (7, 3), (12, 4), (13, 8)])
def test_row_split_is_numpy_array_split(rows, parts):
    want = [(int(piece[0]), int(piece[0]) + len(piece)) if len(piece) else None
            for piece in np.array_split(np.arange(rows), parts)]
    got = row_split(rows, parts)
    assert [b if b[1] > b[0] else None for b in got] == want
    assert got[0][0] == 0 and got[-1][1] == rows and all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))


def test_row_split_needs_a_part():
    with pytest.raises(ValueError, match="at least one part"):
        row_split(3, 0)


def test_concat_undoes_chunk():
    whole = _batch(7)
    again = Batch.concat(whole.chunk(3))
    assert set(again) == set(whole)
    np.testing.assert_array_equal(again["prompts"], whole["prompts"])
    np.testing.assert_array_equal(again["rewards"], whole["rewards"])
    assert again["text"] == whole["text"] and again["metrics"] == whole["metrics"]


def test_concat_refuses_mismatched_batches():
    with pytest.raises(ValueError, match="fields"):
        Batch.concat([Batch(a=np.zeros(1)), Batch(b=np.zeros(1))])
    with pytest.raises(ValueError, match="differs"):
        Batch.concat([Batch(m={"x": 1}), Batch(m={"x": 2})])


def test_futures_merge_without_waiting_and_resolve_on_demand():
    pending: Future = Future()
    batch = Batch(prompts=np.zeros((2, 3))) | Batch(values=pending)
    assert is_future(batch["values"]) and isinstance(pending, FutureProtocol)
    assert set(batch.select("values")) == {"values"} and not pending.done()  # nothing waited
    pending.set_result(np.ones(2))
    assert len(batch) == 2
    np.testing.assert_array_equal(batch.resolve()["values"], np.ones(2))
    assert [len(p) for p in batch.chunk(2)] == [1, 1]


def test_is_future_agrees_with_the_protocol_check():
    class OnlyDone:
        def done(self) -> bool:
            return True

    class Cleared:  # both methods on the class (which decides), one switched off on an instance
        def done(self) -> bool:
            return True

        def result(self, timeout=None):
            return 1

    cleared = Cleared()
    cleared.result = None
    values = [Future(), Cleared(), cleared, OnlyDone(), np.zeros(2), {"done": 1, "result": 2}, [1], None, "text"]
    assert [is_future(v) for v in values] == [isinstance(v, FutureProtocol) for v in values]
    assert [is_future(v) for v in values] == [True, True, True, False, False, False, False, False, False]


def test_resolve_times_out_on_a_future_that_never_comes():
    with pytest.raises(TimeoutError):
        Batch(values=Future()).resolve(timeout=0.01)
