"""The attention kernel as `hfplan profile` times it on CPU processes (Compute.measured_attention): its price in
kernels.attention_time and its fit from the profiler's attention rows."""

import pytest
from pydantic import ValidationError

from hfplan.profiler.fit import fit_attention
from hfplan.profiles.hardware import Compute, MeasuredAttention
from hfplan.simulator import kernels

DECODE = MeasuredAttention(call_us=10.0, pair_us=0.5, score_ns=2.0, tflops=0.02)
FORWARD = MeasuredAttention(call_us=4.0, pair_us=1.5, score_ns=1.0, tflops=0.05)


def _measured(hw, decode=DECODE, forward=FORWARD, value_bytes=4):
    compute = hw.compute.model_copy(update={"measured_attention": {"decode": decode, "forward": forward},
                                            "value_bytes": value_bytes})
    return hw.model_copy(update={"compute": compute})


def test_a_decode_step_pays_the_call_each_pair_each_score_and_its_products(toy_hw, small_arch):
    # small_arch: 4 query heads of 16, 2 KV heads. 8 sequences at 100 keys: 32 pairs, 3,200 scores (6.4 us);
    # 4 x 3,200 x 16 = 204.8 KFLOP at 2e10 FLOP/s, 10.24 us; each pair's read of its KV head's keys and values,
    # 4 B x 3,200 x 2 x 16 = 409.6 KB at 5e11 B/s (0.82 us), is less.
    hw = _measured(toy_hw)
    assert kernels.attention_time(hw, small_arch, 8, 100, 1, True) == pytest.approx(
        (10 + 32 * 0.5 + 6.4 + 10.24) * 1e-6)
    # Split over 2 tensor-parallel ranks: 2 query heads each, half the pairs, scores and products.
    assert kernels.attention_time(hw, small_arch, 8, 100, 2, True) == pytest.approx(
        (10 + 16 * 0.5 + 3.2 + 5.12) * 1e-6)
    # The set-up of each pair and score is what the matmul-rate price leaves out at these sizes.
    assert kernels.attention_time(hw, small_arch, 8, 100, 1, True) > 3 * kernels.attention_time(
        toy_hw, small_arch, 8, 100, 1, True)


def test_a_streamed_cache_s_products_are_no_faster_than_each_pair_s_read(toy_hw, small_arch):
    # No fixed costs and a rate of 1e18 FLOP/s (2 GFLOP in 2 ns): 8 sequences at 1M keys, 4 query heads each
    # reading its KV head's keys and values, 4 B x 8 x 1e6 x 4 x 2 x 16 = 4.096 GB, 8.192 ms at 5e11 B/s (the 2 KV
    # heads' cache, 2.048 GB, is half that: the query heads that share one read it again).
    fast = _measured(toy_hw, decode=MeasuredAttention(call_us=0.0, pair_us=0.0, score_ns=0.0, tflops=1e6))
    hw = fast.model_copy(update={"compute": fast.compute.model_copy(update={"cache_bytes": 4 * 2**20})})
    assert kernels.attention_time(hw, small_arch, 8, 1e6, 1, True) == pytest.approx(4 * 8 * 1e6 * 4 * 2 * 16 / 5e11)
    # Keys and values that fit the cache one process keeps (compute.cache_bytes: 4 MiB) run at the measured rate, as
    # the kernel was timed: 8 sequences at 1,000 keys hold 4 B x 8 x 1,000 x 2 x 32 = 2.048 MB.
    assert kernels.attention_time(hw, small_arch, 8, 1000, 1, True) == pytest.approx(4 * 8 * 1000 * 4 * 16 / 1e18)
    # A profile that did not measure its cache keeps the measured rate.
    assert kernels.attention_time(fast, small_arch, 8, 1e6, 1, True) == pytest.approx(4 * 8 * 1e6 * 4 * 16 / 1e18)


def test_a_pass_over_whole_sequences_has_a_pair_per_sequence_and_query_head(toy_hw, small_arch):
    # 4 sequences of 16 tokens: 64 queries, 16 pairs; causal, (16 + 1) / 2 keys a query on average: 2,176 scores
    # (2.176 us), 4 x 2,176 x 16 = 139.3 KFLOP at 5e10 FLOP/s.
    hw = _measured(toy_hw)
    seconds = kernels.attention_time(hw, small_arch, 64, 8.5, 1, False, seq_len=16)
    assert seconds == pytest.approx((4 + 16 * 1.5 + 2.176) * 1e-6 + 4 * 2176 * 16 / 5e10)
    # Without seq_len, a causal pass's length is the one its keys a query imply: (16 + 1) / 2 keys, 16 tokens.
    assert kernels.attention_time(hw, small_arch, 64, 8.5, 1, False) == pytest.approx(seconds)
    # The same tokens as one sequence of 64: a pair a head, more scores and products.
    longer = kernels.attention_time(hw, small_arch, 64, 32.5, 1, False, seq_len=64)
    assert longer == pytest.approx((4 + 4 * 1.5 + 8.32) * 1e-6 + 4 * 8320 * 16 / 5e10)


def test_a_profile_needs_both_kinds_of_call(toy_hw):
    with pytest.raises(ValidationError, match="decode and forward"):
        Compute.model_validate({**toy_hw.compute.model_dump(), "measured_attention": {"decode": DECODE.model_dump()}})
    with pytest.raises(ValidationError):
        MeasuredAttention(call_us=1.0, pair_us=0.1, score_ns=1.0, tflops=0.0)


# (batch, heads, head width, length): the rows' FLOPs are 4 x batch x length x heads x width; 2 KV heads each
SHAPES = ((1, 4, 16, 8), (8, 4, 16, 64), (32, 8, 64, 8), (32, 4, 16, 512), (1, 8, 64, 512), (8, 8, 64, 128),
          (32, 8, 64, 2048))


def _rows(op, kernel, shapes=SHAPES):
    rows = []
    for batch, heads, width, length in shapes:
        scores = batch * length * heads
        seconds = ((kernel.call_us + batch * heads * kernel.pair_us) * 1e-6 + scores * kernel.score_ns * 1e-9
                   + 4.0 * scores * width / (kernel.tflops * 1e12))
        rows.append(dict(op=op, batch=batch, heads=heads, kv_heads=2, hidden=heads * width, context=length,
                         flops=4.0 * scores * width, seconds=seconds))
    return rows


def test_the_fit_recovers_each_kind_s_call_pair_score_and_rate():
    fitted = fit_attention(_rows("decode", DECODE) + _rows("forward", FORWARD), 4, None)
    for op, kernel in (("decode", DECODE), ("forward", FORWARD)):
        assert fitted[op] == pytest.approx((kernel.call_us, kernel.pair_us, kernel.score_ns, kernel.tflops),
                                           rel=1e-3)


def test_decode_rows_whose_cache_streams_are_left_out_of_the_fit():
    # 32 sequences x 2048 keys x 2 KV heads of 64 x 2 x 4 B = 64 MiB of keys and values, over a 16 MiB cache: timed
    # ten times slower, it does not move the fit (the simulator prices such a call by its read).
    streamed = [dict(row, seconds=10 * row["seconds"]) if row["context"] == 2048 else row
                for row in _rows("decode", DECODE)]
    fitted = fit_attention(streamed + _rows("forward", FORWARD), 4, 16 * 2**20)
    assert fitted["decode"] == pytest.approx((DECODE.call_us, DECODE.pair_us, DECODE.score_ns, DECODE.tflops),
                                             rel=1e-3)
    assert fit_attention(streamed + _rows("forward", FORWARD), 4, None)["decode"] != pytest.approx(
        fitted["decode"], rel=1e-2)


def test_no_fit_without_both_kinds_or_more_rows_than_unknowns():
    decode = _rows("decode", DECODE)
    assert fit_attention(decode, 4, None) is None
    assert fit_attention(decode + _rows("forward", FORWARD)[:4], 4, None) is None
    assert fit_attention([], 4, None) is None
