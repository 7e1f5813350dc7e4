"""torch FSDP1's own memory passes (Compute.fsdp_engine fsdp1, sharding.fsdp1_passes), by hand on toy_hw: the
flat-gradient copy on the compute stream, the shard casts before each gather and the divisions and casts around the
reduce-scatter beside it. The MPT cases of bench/published.py price them; FSDP2 (the default) pays none."""

from __future__ import annotations

import pytest

from hfplan.plan import TrainConfig
from hfplan.simulator import sharding
from hfplan.simulator.costs import SetShape, train_step_parts

# small_arch (conftest): 2 layers of 36992, embedding 16640, final norm 64, LM head 16640; 3 FSDP units.
P = 2 * 36992 + 16640 + 64 + 16640
UNITS = 3
MEMORY, KERNEL = 5e11, 5e-6  # toy_hw's achievable memory rate (B/s) and fixed cost of one kernel (s)
ALPHA, BW = 1e-6, 5e10  # toy_hw's intra-node link


def _passes(bytes_per_param: float) -> float:
    """One pass over the stage, a kernel per FSDP unit."""
    return UNITS * KERNEL + bytes_per_param * P / MEMORY


def _with(hw, **fields):
    return hw.model_copy(update={"compute": hw.compute.model_copy(update=fields)})


@pytest.mark.parametrize(("ranks", "factor"), [(2, 2), (4, 2), (8, 4), (16, 4), (64, 8)])
def test_gradient_predivide_factor_by_hand(ranks, factor):
    # doubling from 1 while it divides the ranks and is below ranks / itself
    assert sharding.gradient_predivide_factor(ranks) == factor


def test_fsdp2_pays_no_passes_of_its_own(toy_hw, small_arch):
    assert sharding.fsdp1_passes(toy_hw, small_arch, 1, 1, 4, "lm") == (0.0, 0.0, 0.0)


def test_fsdp1_passes_by_hand_fp32_reduction(toy_hw, small_arch):
    hw = _with(toy_hw, fsdp_engine="fsdp1")  # bf16 values, fp32 reduction (gradient_reduce_bytes 4)
    copy, before_gather, around_scatter = sharding.fsdp1_passes(hw, small_arch, 1, 1, 4, "lm")
    assert copy == pytest.approx(_passes(2 * 2))  # the bf16 gradients read and written into the flat gradient
    assert before_gather == pytest.approx(_passes((4 + 2) / 4))  # the rank's fp32 quarter cast to bf16
    # before: the flat gradient cast bf16 -> fp32 (2 + 4) and predivided by 2 (4 + 4); after: the fp32 quarter
    # postdivided by 4 / 2 = 2 (4 + 4), no cast back
    assert around_scatter == pytest.approx(_passes(2 + 4 + 2 * 4) + _passes(2 * 4 / 4))


def test_fsdp1_passes_by_hand_bf16_reduction(toy_hw, small_arch):
    hw = _with(toy_hw, fsdp_engine="fsdp1", gradient_reduce_bytes=2)  # the MPT runs' stack
    copy, before_gather, around_scatter = sharding.fsdp1_passes(hw, small_arch, 1, 1, 8, "lm")
    assert copy == pytest.approx(_passes(2 * 2))
    assert before_gather == pytest.approx(_passes((4 + 2) / 8))
    # before: no cast, predivided by 4 (2 + 2); after: postdivided by 8 / 4 = 2 (2 + 2), cast back to fp32 (2 + 4)
    assert around_scatter == pytest.approx(_passes(2 * 2) + _passes((2 * 2 + 2 + 4) / 8))


def _ring(ranks: int, nbytes: float) -> float:
    return (ranks - 1) * ALPHA + (ranks - 1) / ranks * nbytes / BW


def test_fsdp1_side_passes_go_with_the_collectives_they_precede(toy_hw, small_arch):
    # Nothing hidden (forward = backward = 0), full sharding over 4 ranks, 2 micro-batches: each micro-batch's two
    # gathers wait for their casts, its reduce-scatter comes with its divisions and casts.
    hw = _with(toy_hw, fsdp_engine="fsdp1")
    _, before_gather, around_scatter = sharding.fsdp1_passes(hw, small_arch, 1, 1, 4, "lm")
    gather, scatter = UNITS * _ring(4, 2 * P / UNITS), UNITS * _ring(4, 4 * P / UNITS)
    got = sharding.exposed_step_comm(hw, small_arch, TrainConfig(dp=4, shard="full"), SetShape(4, 8), "lm",
                                     0.0, 0.0, 2)
    assert got == pytest.approx(2 * (2 * (gather + before_gather) + scatter + around_scatter), rel=1e-12)


@pytest.mark.parametrize(("shard", "group", "copies"), [("full", None, True), ("hybrid", 2, True),
                                                         ("zero2", None, False), ("replicated", None, False)])
def test_flat_gradient_copy_runs_on_the_compute_stream(toy_hw, small_arch, shard, group, copies):
    # A step of 3 micro-batches a rank: FSDP1's copy adds to each micro-batch's memory-bound kernels, in the fully
    # sharded modes only (its flat parameters' views); the other modes' steps are FSDP2's.
    cfg = TrainConfig(dp=4, micro_batch=1, shard=shard, shard_group=group)
    fsdp2 = train_step_parts(toy_hw, small_arch, cfg, SetShape(4, 8), 12, 16, "lm")
    fsdp1 = train_step_parts(_with(toy_hw, fsdp_engine="fsdp1"), small_arch, cfg, SetShape(4, 8), 12, 16, "lm")
    expected = 3 * _passes(2 * 2) if copies else 0.0
    assert fsdp1["elementwise"] - fsdp2["elementwise"] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    if not copies:
        assert fsdp1.total == pytest.approx(fsdp2.total, rel=1e-12)


def test_one_rank_has_no_flat_gradient_copy(toy_hw, small_arch):
    hw = _with(toy_hw, fsdp_engine="fsdp1")
    assert sharding.flat_gradient_copy(hw, small_arch, TrainConfig(dp=1, shard="full"), "lm") == 0.0
