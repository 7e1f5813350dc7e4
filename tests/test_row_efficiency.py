"""A GEMM's rate by its rows and its weight's bytes where the profile has no tiling model (CPU BLAS):
Compute.row_efficiency, its use in kernels.gemm_time, and its fit from the profiler's matmul rows."""

from dataclasses import replace

import pytest
from pydantic import ValidationError

from hfplan.profiler.fit import fit_row_efficiency
from hfplan.profiles.hardware import GemmTiling
from hfplan.simulator import kernels


def _with_rows(hw, points):
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"row_efficiency": points})})


def test_log_interpolation_between_points_and_the_ends_beyond():
    points = ((1, 0.05), (16, 0.25), (256, 1.0))
    assert kernels.log_interpolated(points, 4) == pytest.approx(0.05 + 0.5 * 0.2)  # log 4 is half of log 16
    assert kernels.log_interpolated(points, 64) == pytest.approx(0.25 + 0.5 * 0.75)
    assert kernels.log_interpolated(points, 0.5) == 0.05 and kernels.log_interpolated(points, 4096) == 1.0


# 8192 x 8192 bf16 weights: 128 MiB.
BIG = 2 * 8192 * 8192


def test_a_gemm_of_few_rows_runs_at_its_fraction_of_the_matmul_rate(toy_hw):
    # toy_hw: matmul 5e13 FLOP/s, memory 5e11 B/s, 5 us a kernel; bf16 values.
    hw = _with_rows(toy_hw, ((1, BIG, 0.01), (16, BIG, 0.1), (256, BIG, 1.0)))
    # One row at 0.002: 2kn = 134.2 MFLOP at 1e11 FLOP/s = 1342 us, above the read of 2(k + kn + n) = 134.2 MB in
    # 268.5 us (at the matmul rate it would be that read).
    k = n = 8192
    flops = 2.0 * k * n
    slow = _with_rows(toy_hw, ((1, BIG, 0.002), (256, BIG, 1.0)))
    assert kernels.gemm_time(slow, 1, k, n) == pytest.approx(5e-6 + flops / 1e11)
    assert kernels.gemm_time(toy_hw, 1, k, n) == pytest.approx(5e-6 + 2.0 * (k + k * n + n) / 5e11)
    # 64 rows: fraction 0.1 + 0.5 x 0.9 = 0.55; math 64 x 134.2 MFLOP / 2.75e13 = 312.3 us, above the read of
    # 2(64k + kn + 64n) = 136.3 MB in 272.6 us.
    assert kernels.gemm_time(hw, 64, k, n) == pytest.approx(5e-6 + 64 * flops / (0.55 * 5e13))
    # At and beyond the last point: the plain roofline.
    assert kernels.gemm_time(hw, 4096, k, n) == pytest.approx(kernels.gemm_time(toy_hw, 4096, k, n))
    assert kernels.gemm_time(hw, 16, k, n) > kernels.gemm_time(toy_hw, 16, k, n)


def test_the_fraction_goes_between_weight_sizes_in_log_bytes(toy_hw):
    """A weight the cache holds loses less at few rows than one streamed: between two sizes measured, in log bytes;
    beyond either, the end's."""
    small, large = 2**18, 2**24  # 256 KiB and 16 MiB: 4 MiB is two thirds of the way in log bytes
    hw = _with_rows(toy_hw, ((1, small, 0.4), (16, small, 1.0), (1, large, 0.1), (16, large, 0.4), (256, large, 1.0)))
    assert kernels.row_fraction(hw, 1, 2**22) == pytest.approx(0.4 + (2 / 3) * (0.1 - 0.4))
    assert kernels.row_fraction(hw, 4, 2**22) == pytest.approx(0.7 + (2 / 3) * (0.25 - 0.7))  # both at half of log 16
    assert kernels.row_fraction(hw, 1, 2**10) == 0.4 and kernels.row_fraction(hw, 1, 2**30) == 0.1
    assert kernels.row_fraction(hw, 64, 2**18) == 1.0 and kernels.row_fraction(hw, 64, 2**24) == pytest.approx(0.7)
    assert kernels.row_fraction(toy_hw, 1, 2**22) == 1.0  # no table


def test_a_tiling_model_takes_precedence_over_the_rows(toy_hw):
    tiling = GemmTiling(sm_count=108, tiles=((128, 128),), tile_k=32, stages=3)
    tiled = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={"gemm": tiling})})
    assert kernels.gemm_time(_with_rows(tiled, ((1, BIG, 0.01), (256, BIG, 1.0))), 8, 4096, 4096) == \
        kernels.gemm_time(tiled, 8, 4096, 4096)


def test_a_backward_measured_by_rows_prices_both_gradients_at_its_fraction(toy_hw):
    """Compute.backward_row_efficiency: the input and weight gradients of an (m x k)(k x n) product, their 4mkn
    FLOPs at the measured fraction, two kernels' overhead; without it, each GEMM at its own shape's fraction."""
    k = n = 8192
    forward_only = _with_rows(toy_hw, ((16, BIG, 0.1), (256, BIG, 1.0)))
    both = forward_only.model_copy(update={"compute": forward_only.compute.model_copy(
        update={"backward_row_efficiency": ((16, BIG, 0.2), (256, BIG, 0.8))})})
    # 64 rows: 0.2 + 0.5 x 0.6 = 0.5 of 5e13; 4 x 64 x k x n = 17.2 GFLOP in 687.2 us, above the two GEMMs' reads
    # and writes of 2 x 2(64n + nk + 64k) = 272.6 MB in 545.3 us.
    assert kernels.gemm_backward_time(both, 64, k, n) == pytest.approx(2 * 5e-6 + 4.0 * 64 * k * n / (0.5 * 5e13))
    # Without the backward's table: the input gradient (64 x n)(n x k) at 64 rows' forward fraction, the weight
    # gradient (k x 64)(64 x n) at k rows': the rate.
    assert kernels.gemm_backward_time(forward_only, 64, k, n) == pytest.approx(
        kernels.gemm_time(forward_only, 64, n, k) + kernels.gemm_time(forward_only, k, 64, n))
    assert kernels.gemm_time(forward_only, k, 64, n) == kernels.gemm_time(toy_hw, k, 64, n)
    assert kernels.gemm_backward_time(both, 0, k, n) == 0.0


def test_a_layer_s_backward_is_its_gemms_backward_pairs(toy_hw, small_arch):
    """LayerCost.backward charges each projection's input and weight gradients (gemm_backward_time), not twice its
    forward: a backward table slower than the forward's makes the backward, and only it, slower."""
    forward_only = _with_rows(toy_hw, ((16, BIG, 0.1), (4096, BIG, 1.0)))
    slow = forward_only.model_copy(update={"compute": forward_only.compute.model_copy(
        update={"backward_row_efficiency": ((16, BIG, 0.05), (4096, BIG, 0.5))})})
    arch = replace(small_arch, hidden=2048, heads=16, kv_heads=8, ffn=8192)  # 256 rows of it: compute-bound
    plain, slower = (kernels.layer_forward(hw, arch, 256, 128.5, 1) for hw in (forward_only, slow))
    assert plain.gemm == slower.gemm and slower.gemm_backward > 1.5 * plain.gemm_backward
    h, f = arch.hidden, arch.ffn
    kv = kernels.kv_width(arch, 1)
    shapes = ((h, arch.q_dim + 2 * kv), (arch.q_dim, h), (h, 2 * f), (f, h))
    assert slower.gemm_backward == pytest.approx(sum(kernels.gemm_backward_time(slow, 256, k, n) for k, n in shapes))
    assert slower.backward() - plain.backward() == pytest.approx(slower.gemm_backward - plain.gemm_backward)


@pytest.mark.parametrize("points, problem", [
    (((16, BIG, 0.2), (1, BIG, 0.05)), "increasing"),
    (((1, BIG, 0.0), (16, BIG, 0.2)), "(0, 1]"),
    (((1, BIG, 0.5), (16, BIG, 1.2)), "(0, 1]"),
    (((1, 0, 0.5), (16, 0, 1.0)), "weight bytes must be positive"),
    ((), "at least one"),
])
def test_bad_row_tables_are_refused(toy_hw, points, problem):
    with pytest.raises(ValidationError, match=problem.replace("(", r"\(").replace("]", r"\]")):
        toy_hw.compute.model_validate(toy_hw.compute.model_dump() | {"row_efficiency": points})


def _row(m, k, n, rate, overhead=1e-6):
    flops = 2.0 * m * k * n
    return {"m": m, "k": k, "n": n, "flops": flops, "seconds": overhead + flops / rate}


MIB4 = 4 * 1024 * 1024  # a 1024 x 1024 fp32 weight
MIB16 = 4 * MIB4


def test_the_fit_reads_each_row_count_s_rate_over_the_matmul_rate_per_weight_size():
    rows = [_row(1, 1024, 1024, 5e9), _row(16, 1024, 1024, 3e10), _row(128, 1024, 1024, 8e10),
            _row(1, 1024, 4096, 4e9), _row(1, 4096, 1024, 6e9),  # 16 MiB either way round: one weight size
            _row(16, 4096, 1024, 2e10), _row(16, 1024, 4096, 2.5e10),
            _row(256, 256, 256, 1.2e11), _row(512, 512, 512, 1e11),  # one row count each: no table of their own
            _row(16, 64, 64, 1e8)]  # narrow: overhead-bound, not a row count's rate
    assert fit_row_efficiency(rows, 1e11, 1e-6, 4) == (
        (1, MIB4, 0.05), (16, MIB4, 0.3), (128, MIB4, 1.0),  # the largest measured is the rate's own
        (1, MIB16, 0.05), (16, MIB16, 1.0))


def test_the_fit_never_falls_with_more_rows_and_ends_at_the_rate():
    noisy = [_row(1, 1024, 1024, 5e9, 0.0), _row(16, 1024, 1024, 3e10, 0.0), _row(32, 1024, 1024, 2e10, 0.0),
             _row(64, 1024, 1024, 1.1e11, 0.0), _row(128, 1024, 1024, 9e10, 0.0)]
    # 32 rows measured below 16 rows: taken as 16's; 128 rows below 64's rate: 64's; the largest ends at the rate.
    assert fit_row_efficiency(noisy, 1e11, 0.0, 4) == ((1, MIB4, 0.05), (16, MIB4, 0.3), (32, MIB4, 0.3),
                                                        (64, MIB4, 1.0), (128, MIB4, 1.0))


def test_the_backward_s_fit_keeps_its_largest_row_count_s_measured_fraction():
    """The backward pairs run below the forward's rate even at many rows: their table is what was measured, not
    ended at the rate (never above it, never falling with more rows)."""
    rows = [_row(16, 1024, 1024, 2e10, 0.0), _row(128, 1024, 1024, 7e10, 0.0), _row(512, 1024, 1024, 6e10, 0.0),
            _row(16, 4096, 1024, 3e10, 0.0), _row(512, 4096, 1024, 1.3e11, 0.0)]
    assert fit_row_efficiency(rows, 1e11, 0.0, 4, ends_at_rate=False) == (
        (16, MIB4, 0.2), (128, MIB4, 0.7), (512, MIB4, 0.7), (16, MIB16, 0.3), (512, MIB16, 1.0))


def test_no_table_where_every_row_count_reaches_the_rate_or_one_alone_was_measured():
    assert fit_row_efficiency([_row(1, 1024, 1024, 2e11, 0.0), _row(64, 1024, 1024, 1e11, 0.0)], 1e11, 0.0, 4) is None
    assert fit_row_efficiency([_row(1, 1024, 1024, 5e9, 0.0)], 1e11, 0.0, 4) is None


def test_the_products_the_row_table_prices_leave_the_rate_s_fit():
    """Of each weight size measured at two row counts or more, every row count below its largest; a square alone at
    its size, and narrow products, stay in the roofline's fit."""
    from hfplan.profiler.fit import row_limited

    rows = [_row(1, 1024, 1024, 5e9), _row(16, 1024, 1024, 3e10), _row(1024, 1024, 1024, 1.4e11),
            _row(128, 256, 256, 1.2e11), _row(256, 256, 256, 1.2e11),
            _row(512, 512, 512, 1e11), _row(16, 64, 64, 1e8)]
    limited = row_limited(rows, 4)
    assert [(r["m"], r["k"], r["n"]) for r in limited] == [(1, 1024, 1024), (16, 1024, 1024), (128, 256, 256)]
