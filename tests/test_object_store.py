"""The executor's handover of tensors between worker processes through Ray's object store (Links.object_store)."""

from __future__ import annotations

import pytest

from hfplan.profiler.object_store import measure_object_store, object_store_link


def test_the_handover_is_fitted_to_latency_plus_bytes_over_bandwidth():
    """Rows timed as 5 ms + bytes / 0.3 GB/s give that link back; fewer than two sizes give none."""
    sizes = [2**20, 2**22, 2**24, 2**26]
    rows = [dict(kind="object_store", steps=1, moved_bytes=n, seconds=5e-3 + n / 0.3e9) for n in sizes]
    link = object_store_link(rows)
    assert link.bandwidth_gbytes_per_s == pytest.approx(0.3, rel=1e-3)
    assert link.latency_us == pytest.approx(5000, rel=1e-3) and link.efficiency == 1.0
    assert object_store_link(rows[:1]) is None


def test_tensors_handed_between_two_ray_workers_take_longer_the_more_bytes(ray_driver):
    """The real handover in the test session's Ray cluster: a row per size, every one positive, the largest
    slower than the smallest (16x the bytes), and a link fitted from them."""
    import ray

    rows = measure_object_store(ray, sizes=(2**18, 2**22), reps=2)
    assert [r["moved_bytes"] for r in rows] == [2**18, 2**22]
    assert all(r["kind"] == "object_store" and r["seconds"] > 0 for r in rows)
    assert rows[1]["seconds"] > rows[0]["seconds"]
    assert object_store_link(rows).bandwidth_gbytes_per_s > 0
