"""GEMM efficiency by shape (tile, wave and short-K quantization), by hand, on small tilings."""

import pytest

from hfplan.profiles.hardware import GemmTiling, load_hardware
from hfplan.simulator.kernels import gemm_plan, gemm_shape_efficiency, gemm_time, split_k_bytes

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


def test_split_k_fills_the_sms_of_a_one_tile_output():
    # M = 1, N = 128: one output tile on 4 SMs. Split-K may split K = 640 (10 blocks) over up to 4 tiles; 4 splits of
    # ceil(10 / 4) = 3 blocks each is the least padded work (4 SM slots x 3 blocks against 10 useful blocks).
    tiling = ONE_TILE.model_copy(update={"split_k": True})
    assert gemm_plan(tiling, 1, 640, 128) == (pytest.approx(1 / 128 * 10 / (4 * 3)), 4)
    assert gemm_plan(ONE_TILE, 1, 640, 128) == (pytest.approx(1 / 128 * 10 / (4 * 10)), 1)  # one SM works
    # An output that fills the SMs is not split: 4 tiles on 4 SMs.
    assert gemm_plan(tiling, 256, 640, 256).splits == 1
    # The partial sums meet in memory: 3 fp32 1 x 128 partials written and read.
    assert split_k_bytes(tiling, 1, 640, 128) == 2 * 3 * 4 * 128
    assert split_k_bytes(ONE_TILE, 1, 640, 128) == 0


def test_gemv_shaped_decode_gemm_is_weight_read_bound_on_h100():
    # One token through a 4096 x 4096 bf16 weight on H100: 32 output tiles of 128 x 128 on 132 SMs, K split 4 ways
    # (4 x 32 = 128 tiles in one wave). Its math is then ~6.6 us, its memory 11 us: the kernel costs its launch and
    # the bytes over the achievable bandwidth (3350 GB/s x 0.9): the weights, the activations, the fp32 partials.
    hw = load_hardware("h100-80g")
    m, k, n = 1, 4096, 4096
    assert gemm_plan(hw.compute.gemm, m, k, n).splits == 4
    nbytes = 2 * (k * n + m * k + m * n) + 2 * 3 * 4 * m * n
    assert gemm_time(hw, m, k, n) == pytest.approx(4e-6 + nbytes / (3350e9 * 0.9), rel=1e-12)
    # Without split-K the same GEMM runs on 32 of the 132 SMs and is priced compute-bound, slower.
    unsplit = hw.model_copy(update={"compute": hw.compute.model_copy(update={
        "gemm": hw.compute.gemm.model_copy(update={"split_k": False})})})
    assert gemm_time(unsplit, m, k, n) > 1.5 * gemm_time(hw, m, k, n)


def _reduction(hw):
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"matrix_vector": "reduction"})})


def test_reduction_matrix_vector_reads_the_weights_without_tile_padding():
    # gpt-fast's batch-1 gate/up GEMM of Llama-2-70B at tp 4 on A100: 1 x 8192 by 8192 x 14336. Tiled, its 112 output
    # tiles of 128 x 128 exceed the 108 SMs (no split-K), so two waves each walk all of K: priced compute-bound.
    # As a reduction it reads the bf16 weights and the row and writes the output at 2039 GB/s x 0.88; its 2kn fp32
    # multiply-adds at 19.5 TFLOP/s (12 us) are hidden under the read (131 us).
    hw = load_hardware("a100-80g")
    m, k, n = 1, 8192, 14336
    expected = 4e-6 + 2 * (k + k * n + n) / (2039e9 * 0.88)
    assert gemm_time(_reduction(hw), m, k, n) == pytest.approx(expected, rel=1e-12)
    assert gemm_time(hw, m, k, n) > 1.5 * expected
    # Only one row is decomposed: two rows keep the tiled kernel.
    assert gemm_time(_reduction(hw), 2, k, n) == gemm_time(hw, 2, k, n)


def test_reduction_matrix_vector_is_math_bound_where_the_cuda_cores_are_slower():
    # A toy with CUDA cores so slow that 2kn fp32 operations outlast the weights' read.
    hw = _reduction(load_hardware("a100-80g"))
    slow = hw.model_copy(update={"compute": hw.compute.model_copy(update={"vector_tflops": 0.01})})
    k, n = 4096, 4096
    assert gemm_time(slow, 1, k, n) == pytest.approx(4e-6 + 2 * k * n / 1e10, rel=1e-12)


def test_shipped_gpu_profiles_split_k():
    assert all(load_hardware(n).compute.gemm.split_k for n in ("a100-80g", "h100-80g", "h200-141g"))


def test_a_gelu_mlp_without_rotary_by_hand(toy_hw, small_arch):
    """small_arch (conftest: h 64, q 64, kv 32, ffn 128) on toy_hw (5e11 B/s, 5 us a kernel), 1000 tokens, tp 1:
    a GeLU MLP has one input GEMM of width ffn (SwiGLU: 2 ffn) and its activation moves 2 ffn values a token (read,
    write; SwiGLU 3); without rotary (learned positions) q and k are not rotated."""
    from dataclasses import replace

    from hfplan.simulator.kernels import layer_forward, memory_time

    gelu = replace(small_arch, mlp="gelu", rotary_dim=0)
    swiglu = layer_forward(toy_hw, small_arch, 1000, 500, 1)
    plain = layer_forward(toy_hw, gelu, 1000, 500, 1)
    up = gemm_time(toy_hw, 1000, 64, 256) - gemm_time(toy_hw, 1000, 64, 128)  # gate and up, against up alone
    assert swiglu.gemm - plain.gemm == pytest.approx(up)
    rotary = memory_time(toy_hw, 2 * 2 * 1000 * (64 + 32))
    activation = memory_time(toy_hw, 2 * 3 * 1000 * 128) - memory_time(toy_hw, 2 * 2 * 1000 * 128)
    assert swiglu.elementwise - plain.elementwise == pytest.approx(rotary + activation)
    assert plain.attention == swiglu.attention


@pytest.mark.parametrize("name", ["h100-80g", "h200-141g"])
def test_hopper_profiles_price_the_sustained_best_shape_gemm_at_its_measured_rate(name):
    """The GH100 profiles' matmul rate is the power-saturated one (MSMF, 708.5 TFLOP/s on H200 at ~1465 MHz), not
    the boost-clock burst (MAMF, 792.1 on H100). Its shape, 8192 x 20480 x 8448, tiles into 64 x 33 = 2112 tiles of
    128 x 256: 16 whole waves of 132 SMs, and walks 320 K blocks plus the 3 that fill the 4-stage pipeline. So it
    is priced at 708.5 x 320 / 323 TFLOP/s (its 4 us launch aside), and the burst rate would be 12% faster."""
    hw = load_hardware(name)
    flops = 2.0 * 8192 * 20480 * 8448
    seconds = gemm_time(hw, 8192, 20480, 8448) - hw.compute.kernel_overhead_us * 1e-6
    assert flops / seconds / 1e12 == pytest.approx(708.5 * 320 / 323, rel=1e-3)
    assert flops / seconds / 1e12 < 0.9 * 792.1 * 320 / 323


def test_a_prefill_writes_its_keys_and_values_into_the_kv_cache_by_hand(toy_hw, small_arch):
    """small_arch (conftest: 2 layers, kv_heads 2 of head_dim 16, kv 32) on toy_hw (5e11 B/s, 5 us a kernel), a
    prompt of 1000 tokens: each layer reads the 1000 tokens' k and v and writes them into the cache, 4 x 32 values of
    2 bytes a token = 256,000 B, 0.512 us + 5 us. At tp 2 a rank holds one KV head: half the bytes. A forward of the
    same tokens without a cache (inference, training) makes no such pass."""
    from hfplan.plan import InferConfig, Layout
    from hfplan.simulator import costs
    from hfplan.simulator.kernels import head_forward, kv_cache_write_time, layer_forward

    assert kv_cache_write_time(toy_hw, small_arch, 1000, 1) == pytest.approx(5.512e-6)
    assert kv_cache_write_time(toy_hw, small_arch, 1000, 2) == pytest.approx(5.256e-6)
    one = costs.SetShape(1, 8)
    prefill = costs.prefill_parts(toy_hw, small_arch, Layout(), one, 1, 1000)
    forward = costs.inference_parts(toy_hw, small_arch, InferConfig(), one, 1, 1000, head="lm")
    layer = layer_forward(toy_hw, small_arch, 1000, 500.5, 1, False, 1000)
    head_norm = 5e-6 + 2 * 2 * 1 * 64 / 5e11  # the final norm over the last token only
    embedding = 5e-6 + 2 * 2 * 1000 * 64 / 5e11
    assert prefill["elementwise"] == pytest.approx(2 * (layer.elementwise + 5.512e-6) + head_norm + embedding
                                                   + 5e-6 + 4 * 3 * 260 / 5e11)  # the last token's log-softmax
    every_logit = head_forward(toy_hw, small_arch, 1000, 1, "lm").elementwise  # a log-prob pass scores every token
    assert forward["elementwise"] == pytest.approx(2 * layer.elementwise + every_logit + embedding)


def test_a_parallel_block_has_one_norm_a_layer_by_hand(toy_hw, small_arch):
    """A parallel block (GPT-J: attention and MLP both read ln_1's output) drops one norm a layer: its kernel (read
    and write 64 values of 2 bytes for each of 1000 tokens: 256,000 B at 5e11 B/s, 0.512 us + 5 us), its weights (h = 64
    a layer) and its saved input and output (2h values a token); GEMMs and attention are unchanged."""
    from dataclasses import replace

    from hfplan.simulator.kernels import layer_forward
    from hfplan.simulator.memory import activation_values_per_token_layer

    parallel = replace(small_arch, parallel_block=True)
    sequential, side_by_side = (layer_forward(toy_hw, a, 1000, 500, 1) for a in (small_arch, parallel))
    assert sequential.elementwise - side_by_side.elementwise == pytest.approx(5.512e-6)
    assert (sequential.gemm, sequential.attention) == (side_by_side.gemm, side_by_side.attention)
    assert small_arch.params_per_layer - parallel.params_per_layer == 64
    assert (activation_values_per_token_layer(small_arch, 1) - activation_values_per_token_layer(parallel, 1)
            == 2 * 64)
