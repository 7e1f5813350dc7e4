"""bench/published.py: its table of published measurements is complete and every case is priced."""

from __future__ import annotations

import math

from tests.support.scripts import load_bench

BENCH = load_bench("published")


def test_the_table_covers_every_category_with_cited_cases():
    cases = BENCH.build_cases()
    assert len(cases) >= 30
    assert {c.category for c in cases} == set(BENCH.CATEGORIES)
    assert all(c.source.strip() and c.unit and c.published > 0 for c in cases)
    assert len({c.name for c in cases}) == len(cases)


def test_every_prediction_is_finite_and_positive():
    rows = BENCH.predict_all(BENCH.build_cases())
    assert all(math.isfinite(r.predicted) and r.predicted > 0 for r in rows)
    summary = BENCH.summaries(rows)
    assert [s.label for s in summary] == [*BENCH.CATEGORIES, "overall"]
    assert summary[-1].cases == len(rows)


def test_llm_foundry_cases_price_the_triton_attention_kernel_they_ran():
    """A100: the Triton kernel's measured 68 of 312 TFLOP/s at 2048 tokens. H100: that times FlashAttention-2's
    H100/A100 ratio at the same length, (265 / 989.4) / (155 / 312): 68 * 265 / (155 * 989.4) of peak."""
    assert dict(BENCH.TRITON_ATTENTION_A100)[2048] == 68 / 312
    h100 = dict(BENCH._triton_attention_h100())
    assert math.isclose(h100[2048], 68 * 265 / (155 * 989.4), rel_tol=5e-3)  # the profiles round to 3 digits
    a100_case = BENCH._with_attention_rate("a100-80g", BENCH.TRITON_ATTENTION_A100)
    assert a100_case.compute.attention_rate == BENCH.TRITON_ATTENTION_A100
    assert a100_case.compute.matmul_efficiency == BENCH._hw("a100-80g").compute.matmul_efficiency


def test_tensorrt_llm_throughput_cases_price_its_per_query_head_decode_kernel():
    """TensorRT-LLM v0.6.1's masked multi-head attention runs one block per query head: its throughput cases say so
    in their source, and the profile they price differs from the shipped one in that kernel alone."""
    trt = [c for c in BENCH.decode_cases() if "TensorRT-LLM" in c.source]
    assert trt and all("one block per query head" in c.source for c in trt)
    hw = BENCH._with_decode_attention("a100-80g", "per_query_head")
    shipped = BENCH._hw("a100-80g")
    assert hw.compute.decode_attention == "per_query_head" and shipped.compute.decode_attention == "grouped"
    assert hw.compute.model_copy(update={"decode_attention": "grouped"}) == shipped.compute
    assert all("one block per query head" not in c.source for c in BENCH.decode_cases() if "gpt-fast" in c.source)
