"""GEMM efficiency by shape (tile, wave and short-K quantization), by hand, on small tilings."""

import pytest

from hfplan.profiles.hardware import GemmTiling, load_hardware
from hfplan.simulator.kernels import gemm_shape_efficiency, gemm_time

ONE_TILE = GemmTiling(sm_count=4, tiles=((128, 128),), tile_k=64, stages=1)


def test_no_tiling_is_full_efficiency():
    assert gemm_shape_efficiency(None, 1, 7, 3) == 1.0


def test_aligned_shape_filling_one_wave_loses_nothing():
    # 256 x 256 output = 4 tiles of 128 x 128 on 4 SMs, one wave; K = 640 = 10 whole blocks, no fill stage.
    assert gemm_shape_efficiency(ONE_TILE, 256, 640, 256) == pytest.approx(1.0)


def test_tile_quantization():
    # M = 100 pads to one 128-row tile: 100/128 of the tile's work is useful; 4 tiles fill the wave.
    assert gemm_shape_efficiency(ONE_TILE, 100, 64, 512) == pytest.approx(100 / 128)


def test_wave_quantization():
    # 5 tiles on 4 SMs run in 2 waves, the second with one tile: 5/8 of the SM slots do work.
    assert gemm_shape_efficiency(ONE_TILE, 5 * 128, 64, 128) == pytest.approx(5 / 8)


def test_short_k_pays_the_pipeline_fill():
    # 3 stages: each tile walks 10 K blocks plus 2 that fill the pipeline: 10/12.
    tiling = ONE_TILE.model_copy(update={"stages": 3})
    assert gemm_shape_efficiency(tiling, 256, 640, 256) == pytest.approx(10 / 12)
    # K = 100 pads to 2 blocks of 64 (128), plus 2 fill blocks: 100 / 256.
    assert gemm_shape_efficiency(tiling, 256, 100, 256) == pytest.approx(100 / 256)


def test_the_library_picks_the_tile_with_least_padding():
    # One SM. 256 x 64 output: 128 x 128 tiles need 2 tiles (half of each padded) -> 0.5; a 256 x 64 tile fits it.
    tiling = GemmTiling(sm_count=1, tiles=((128, 128), (256, 64)), tile_k=64, stages=1)
    assert gemm_shape_efficiency(tiling, 256, 64, 64) == pytest.approx(1.0)
    only_square = tiling.model_copy(update={"tiles": ((128, 128),)})
    assert gemm_shape_efficiency(only_square, 256, 64, 64) == pytest.approx(0.5)


def test_gemm_time_charges_the_shape_efficiency(toy_hw):
    # toy_hw: 5e13 FLOP/s, 5 us per kernel. 5 tiles on 4 SMs: the math runs at 5/8 of the rate.
    hw = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={"gemm": ONE_TILE})})
    m, k, n = 5 * 128, 8192, 128
    assert gemm_time(hw, m, k, n) == pytest.approx(5e-6 + 2 * m * k * n / (5e13 * 5 / 8), rel=1e-12)


def test_a100_square_gemm_by_hand():
    # 4096^3 on 108 SMs: 256 x 128 tiles -> 16 x 32 = 512 tiles = 4.74 waves -> 5 waves (512/540);
    # K = 4096 = 64 blocks plus 2 fill blocks of the 3-stage pipeline (64/66).
    tiling = load_hardware("a100-80g").compute.gemm
    assert gemm_shape_efficiency(tiling, 4096, 4096, 4096) == pytest.approx(512 / 540 * 64 / 66)


def test_cpu_profile_keeps_its_plain_matmul_rate():
    assert load_hardware("cpu").compute.gemm is None
