"""The spawned worlds (tests/support/worlds.py): results in rank order, failures and hangs raise and replace the
world, and a call starts from a fresh process's state whatever the call before it did."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.worlds import run_world

pytestmark = pytest.mark.slow  # it spawns processes


def _sum_and_draw(rank: int, world: int, seed: int | None) -> dict:
    """All-reduces the ranks' numbers; then seeds (if told), makes a subgroup and draws."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    groups = dist.get_process_group_ranks(dist.new_group(list(range(world))))
    if seed is not None:
        torch.manual_seed(seed)
    return {"total": float(total), "draw": torch.rand(3), "groups": groups, "pid": os.getpid()}


def _fails_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own failure")


def _hangs(rank: int, world: int) -> None:
    time.sleep(60)


def test_results_come_back_in_rank_order_and_each_call_starts_fresh():
    seeded = run_world(_sum_and_draw, 2, 7, timeout=120)
    assert [r["total"] for r in seeded] == [3.0, 3.0] and [r["groups"] for r in seeded] == [[0, 1]] * 2
    after = run_world(_sum_and_draw, 2, None, timeout=120)
    again = run_world(_sum_and_draw, 2, None, timeout=120)
    for got, other in zip(after, again, strict=True):
        torch.testing.assert_close(got["draw"], other["draw"])  # the previous call's seed did not carry over
        assert got["pid"] != other["pid"]  # a process of its own per call
    assert not torch.equal(after[0]["draw"], seeded[0]["draw"])


def test_a_failing_rank_raises_with_its_traceback_and_the_next_call_runs():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*ValueError: rank one's own failure"):
        run_world(_fails_on_rank_1, 2, timeout=60)
    assert [r["total"] for r in run_world(_sum_and_draw, 2, None, timeout=120)] == [3.0, 3.0]


def test_a_hanging_world_is_killed_and_replaced():
    with pytest.raises(TimeoutError, match="world of 2 did not finish"):
        run_world(_hangs, 2, timeout=3)
    assert [r["total"] for r in run_world(_sum_and_draw, 2, None, timeout=120)] == [3.0, 3.0]
