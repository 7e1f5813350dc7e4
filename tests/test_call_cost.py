"""`hfplan cost` and its library function: the search's own cost functions on one call, with the rates a
person reads, checked by hand where the rate is a formula."""

import json

import pytest

from hfplan.errors import HfplanError
from hfplan.plan import GenConfig, InferConfig, TrainConfig
from hfplan.profiles.hardware import load_hardware
from hfplan.profiles.models import CATALOG
from hfplan.simulator import collectives as coll
from hfplan.simulator import costs, memory
from hfplan.simulator.call_cost import CallRequest, call_cost
from tests.support.cli import invoke

A100 = load_hardware("a100-80g")
LLAMA7 = CATALOG["llama2-7b"]


def test_train_is_the_search_step_cost():
    req = CallRequest("train", "a100-80g", tp=2, dp=4, micro_batch=2, batch=64, seq_len=1024, recompute="full")
    result = call_cost(req)
    cfg = TrainConfig(tp=2, dp=4, micro_batch=2, recompute="full")
    where = costs.SetShape(8, 8)
    assert result.seconds == costs.train_step_time(A100, LLAMA7, cfg, where, 64, 1024, "lm")
    assert sum(result.parts.values()) == pytest.approx(result.seconds)
    assert result.tokens_per_s == pytest.approx(64 * 1024 / result.seconds)
    resident = memory.train_resident_bytes(LLAMA7, cfg, "lm")
    transient = memory.train_transient_bytes(LLAMA7, cfg, 64, 1024, "lm")
    assert result.memory_gib_per_gpu == pytest.approx((resident + transient) / 2**30)


def test_train_flops_are_three_forwards_by_hand():
    result = call_cost(CallRequest("train", "a100-80g", batch=4, seq_len=512))
    h, q, kv, f, layers, vocab = 4096, 4096, 4096, 11008, 32, 32000
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h  # matmul weights and the two norms
    tokens = 4 * 512
    forward = 2 * (layers * per_layer + h * vocab) * tokens + 4 * layers * tokens * (512 + 1) / 2 * q
    assert result.flops_per_gpu_per_s * result.seconds == pytest.approx(3 * forward)


def test_forward_is_the_search_inference_cost():
    result = call_cost(CallRequest("forward", "h100-80g", tp=4, micro_batch=4, batch=32, head="scalar"))
    expected = costs.inference_time(load_hardware("h100-80g"), LLAMA7, InferConfig(tp=4, micro_batch=4),
                                    costs.SetShape(4, 8), 32, 2048, "scalar")
    assert result.seconds == expected


def test_generate_counts_response_tokens():
    # 1024 prompts per replica, more than its KV cache holds at once: static waves, or slots kept full.
    req = CallRequest("generate", "a100-80g", tp=2, dp=2, batch=2048, prompt_len=256, response_len=512,
                      response_len_mean=200, batching="continuous")
    result = call_cost(req)
    assert result.tokens_per_s == pytest.approx(2048 * 200 / result.seconds)
    assert result.parts["controller"] == pytest.approx(load_hardware("a100-80g").runtime.controller_call_us * 1e-6)
    assert result.detail["batching"] == "continuous"
    static = call_cost(CallRequest("generate", "a100-80g", tp=2, dp=2, batch=2048, prompt_len=256, response_len=512,
                                   response_len_mean=200))
    assert static.detail["waves"] > 1
    assert result.seconds < static.seconds
    gen = GenConfig(tp=2, dp=2, batching="continuous")
    assert result.memory_gib_per_gpu * 2**30 >= memory.infer_resident_bytes(LLAMA7, gen, "lm")


def test_collective_bus_bandwidth_by_hand():
    """All-reduce of 1 GiB on 8 A100s: a ring of 8 in NCCL's Simple protocol (the profile's), 8.4 us and 14 steps of
    3.4 us, 2 x 7/8 of the bytes at 300 x 0.77 GB/s."""
    result = call_cost(CallRequest("collective", "a100-80g", op="all_reduce", nbytes=2**30, gpus=8))
    seconds = (8.4 + 14 * 3.4) * 1e-6 + 2 * 7 / 8 * 2**30 / (300e9 * 0.77)
    assert result.seconds == pytest.approx(seconds)
    assert result.detail["busbw_gbytes_per_s"] == pytest.approx(2**30 / seconds * 2 * 7 / 8 / 1e9)
    assert (result.detail["nvls"], result.detail["runs_as"]) == ("false", "Simple")
    nvls = call_cost(CallRequest("collective", "h100-80g", op="all_reduce", nbytes=2**30, gpus=8))
    # NVLS on H100: 2^30 (1 + 1/8) bytes each way at 450 x 0.70 GB/s (the profile's nvls_efficiency), after NCCL's
    # 25 us of NVLS latency (the profile's nvls_latency_us).
    assert nvls.seconds == pytest.approx(25e-6 + 1.125 * 2**30 / (450e9 * 0.70))
    assert (nvls.detail["nvls"], nvls.detail["runs_as"]) == ("true", "nvls")
    small = call_cost(CallRequest("collective", "a100-80g", op="all_gather", nbytes=4096, gpus=4))
    # 4 KiB gathered on 4 A100s: LL, 6.6 us and 3 steps of 0.6 us, 3/4 of the bytes at LL's cap of 87.7 GB/s.
    assert small.seconds == pytest.approx((6.6 + 3 * 0.6) * 1e-6 + 3072 / 87.7e9)
    assert small.detail["runs_as"] == "LL"
    across = call_cost(CallRequest("collective", "a100-80g", op="all_gather", nbytes=2**30, gpus=16))
    assert across.seconds == coll.all_gather(A100, coll.group_of(16, 1, 8), 2**30)


@pytest.mark.parametrize(("req", "message"), [
    (CallRequest("backward", "a100-80g"), "unknown call 'backward'"),
    (CallRequest("train", "a100-80g", recompute="half"), "--recompute half"),
    (CallRequest("train", "a100-80g", tp=0), "--tp must be at least 1"),
    (CallRequest("collective", "a100-80g", op="broadcast"), "--op broadcast"),
    (CallRequest("collective", "a100-80g", gpus=1), "at least 2 GPUs"),
    (CallRequest("generate", "a100-80g", model="llama2-70b"), "no room for the KV cache"),
    (CallRequest("generate", "a100-80g", kv_cache="blocks"), "--kv-cache blocks: use reserved or paged"),
    (CallRequest("generate", "a100-80g", kv_cache="paged"), "--kv-cache paged needs --batching continuous"),
])
def test_bad_requests_are_one_line_errors(req, message):
    with pytest.raises(HfplanError, match=message):
        call_cost(req)


def test_cli_json_is_the_library_result():
    out = invoke("cost", "train", "--tp", 2, "--dp", 4, "--micro-batch", 2, "--batch", 64, "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    direct = call_cost(CallRequest("train", "a100-80g", tp=2, dp=4, micro_batch=2, batch=64))
    assert data == json.loads(json.dumps(direct.to_dict()))


def test_cli_tables_and_errors():
    out = invoke("cost", "collective", "--gpus", 8, "--bytes", 1e9)
    assert out.exit_code == 0 and "busbw" in out.output and "all_reduce" in out.output
    bad = invoke("cost", "train", "--recompute", "half")
    assert bad.exit_code == 2 and "--recompute half" in bad.output


def test_generate_splits_its_seconds_into_prefill_and_decode_by_hand():
    """4 prompts of 16 tokens, 8-token responses, on one A100: one static wave, one prefill (it samples each
    response's first token), then 7 decode steps, for tokens 2 to 8, at the mean context 16 + (1 + 7) / 2 = 20. Each
    step, the prefill one too, pays the profile's engine step (4 ms): 4 ms of prefill runtime, 28 ms of decode
    runtime. Prefill, decode and the controller's dispatch add up to the parts, and the parts to the seconds."""
    result = call_cost(CallRequest("generate", "a100-80g", batch=4, prompt_len=16, response_len=8))
    where = costs.SetShape(1, 8)
    prefill = costs.prefill_parts(A100, LLAMA7, GenConfig(), where, 4, 16)
    step = costs.decode_step_parts(A100, LLAMA7, GenConfig(), where, 4, 20)
    assert result.detail["waves"] == 1 and result.detail["decode_steps"] == 7
    assert result.phases["prefill"] == pytest.approx(dict(prefill))
    assert result.phases["decode"] == pytest.approx({name: 7 * s for name, s in step.items()})
    assert result.phases["prefill"]["runtime"] == pytest.approx(4e-3)
    assert result.phases["decode"]["runtime"] == pytest.approx(7 * 4e-3)
    assert result.detail["decode_step_ms"] == pytest.approx(1e3 * step.total)
    together = {name: result.phases["prefill"].get(name, 0.0) + result.phases["decode"].get(name, 0.0)
                for name in result.parts}
    together["controller"] += result.parts["controller"]
    assert together == pytest.approx(result.parts)
    assert sum(result.parts.values()) == pytest.approx(result.seconds)
    # Two waves of 2 (a cache that holds 2): each phase is both waves'; the decode steps run one wave after another.
    two = costs.waves_phases(A100, LLAMA7, 1, 1, where, 4, 2, 16, 8)
    one = costs.wave_phases(A100, LLAMA7, 1, 1, where, 2, 16, 8)
    assert two.decode_steps == 14 and two.prefill == pytest.approx(dict(one.prefill.times(2)))


def test_cli_shows_where_the_time_goes():
    out = invoke("cost", "generate", "--batch", 4, "--prompt-len", 16, "--response-len", 8)
    assert out.exit_code == 0, out.output
    for text in ("prefill", "decode", "what it is", "host overhead", "matmul kernels", "decode step ms"):
        assert text in out.output, text
    data = json.loads(invoke("cost", "generate", "--batch", 4, "--prompt-len", 16, "--response-len", 8,
                             "--json").output)
    assert set(data["phases"]) == {"prefill", "decode"}
    assert "phases" not in json.loads(invoke("cost", "collective", "--gpus", 8, "--json").output)
