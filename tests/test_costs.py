"""Roofline kernels and the costs of training, inference, generation and resharding, by hand.

Most tests use the toy profile of conftest.py: matmul 5e13 FLOP/s, memory 5e11 B/s, 5 us per kernel,
intra-node 5e10 B/s per GPU (alpha 1 us), inter-node 8e9 B/s per node (alpha 10 us)."""

import math

import pytest

from hfplan import layout
from hfplan.layout import resharding
from hfplan.plan import GenConfig, InferConfig, TrainConfig
from hfplan.profiles.hardware import Runtime, load_hardware
from hfplan.profiles.models import CATALOG
from hfplan.simulator import costs, memory, sharding
from hfplan.simulator.costs import SetShape
from hfplan.simulator.kernels import gemm_time, kernel_time, memory_time

FLOPS = 100e12 * 0.5
BW = 1000e9 * 0.5
OVERHEAD = 5e-6
INTRA_BW, INTRA_ALPHA = 100e9 * 0.5, 1e-6
INTER_BW = 10e9 * 0.8
LLAMA7 = CATALOG["llama2-7b"]
ONE_NODE = SetShape(gpus=8, gpus_per_node=8)


# -- kernels ------------------------------------------------------------------------------------------


def test_kernel_time_is_overhead_plus_the_larger_of_math_and_memory(toy_hw):
    assert kernel_time(toy_hw, 0, 0) == pytest.approx(OVERHEAD)
    assert kernel_time(toy_hw, 1e12, 1e9) == pytest.approx(OVERHEAD + 1e12 / FLOPS)  # 20 ms math > 2 ms memory
    assert kernel_time(toy_hw, 1e9, 1e10) == pytest.approx(OVERHEAD + 1e10 / BW)  # 20 ms memory > 0.02 ms math


def test_large_gemm_is_compute_bound(toy_hw):
    m = k = n = 4096
    # 2mkn = 1.37e11 FLOP (2.7 ms) against 2 * 3 * 4096^2 = 1e8 bytes (0.2 ms): compute-bound.
    assert gemm_time(toy_hw, m, k, n) == pytest.approx(2 * m * k * n / FLOPS + OVERHEAD, rel=1e-12)


def test_decode_gemm_is_memory_bound(toy_hw):
    m, k, n = 1, 4096, 11008  # one token through an MLP up-projection
    nbytes = 2 * (m * k + k * n + m * n)  # read input and weight, write output, bf16
    # 9e7 FLOP (1.8 us) against 9e7 bytes (180 us): memory-bound.
    assert gemm_time(toy_hw, m, k, n) == pytest.approx(nbytes / BW + OVERHEAD, rel=1e-12)


def test_gemm_in_fp32_moves_twice_the_bytes(toy_hw):
    fp32_hw = toy_hw.model_copy(update={"compute": toy_hw.compute.model_copy(update={"value_bytes": 4})})
    assert gemm_time(fp32_hw, 1, 4096, 4096) == pytest.approx(4 * (4096 + 4096 * 4096 + 4096) / BW + OVERHEAD)


def test_fp32_profile_doubles_weight_and_kv_memory():
    # An fp32 device (CPU) holds 4-byte weights and KV values, and needs no separate fp32 master copy.
    arch = CATALOG["llama2-7b"]
    # Mixed-precision Adam: bf16 weights 2 + fp32 gradients 4 + fp32 master weights 4 + fp32 moments 4 + 4.
    assert sum(sharding.state_bytes(4).values()) == 4 + 4 + 8 == 16
    assert sum(sharding.state_bytes(2).values()) == 2 + 4 + 4 + 4 + 4 == 18
    gen = GenConfig(tp=1)
    assert memory.kv_bytes_per_token_per_gpu(arch, gen, 4) == 2 * memory.kv_bytes_per_token_per_gpu(arch, gen)
    infer = InferConfig(tp=2)
    assert memory.infer_resident_bytes(arch, infer, "lm", 4) == 2 * memory.infer_resident_bytes(arch, infer, "lm")


def test_empty_kernels_cost_nothing(toy_hw):
    assert gemm_time(toy_hw, 0, 4096, 4096) == 0.0
    assert memory_time(toy_hw, 0) == 0.0
    assert memory_time(toy_hw, 1e9) == pytest.approx(1e9 / BW + OVERHEAD)


# -- training ------------------------------------------------------------------------------------------


def test_training_step_on_one_gpu_matches_6_params_tokens():
    """llama2-70b on one A100 (tp = pp = dp = 1): 4 micro-batches of one 2048-token sequence, every GEMM at the
    profile's matmul rate (its tiling left out: shape efficiency is tested in test_kernels.py)."""
    a100 = load_hardware("a100-80g")
    hw = a100.model_copy(update={"compute": a100.compute.model_copy(update={"gemm": None})})
    arch = CATALOG["llama2-70b"]
    seq_len, sequences = 2048, 4
    rate = 312e12 * 0.859
    h, q, kv, f, layers, vocab = 8192, 8192, 1024, 28672, 80, 32000
    matmul_params = layers * (h * q + 2 * h * kv + q * h + 3 * h * f) + h * vocab  # the embedding is a lookup
    tokens = sequences * seq_len
    gemm_flops = 6 * matmul_params * tokens  # forward 2, backward 4 FLOPs per parameter and token
    # Causal attention: QK^T and PV, 2 * 2 FLOPs per (query, key, dim) over (L+1)/2 keys on average;
    # FlashAttention-2's backward does 5 matmuls to the forward's 2, so 3.5 x the forward in all, at the profile's
    # measured FlashAttention-2 rate for 2048-token sequences: 155 of 312 TFLOP/s (0.497 of peak).
    attention_flops = 3.5 * 4 * tokens * (seq_len + 1) / 2 * q * layers
    # Optimizer step: the fused AdamW and the gradient clip, 40 B per parameter (costs.optimizer_bytes_per_param).
    optimizer = 40 * arch.params() / (2039e9 * 0.88)
    expected = gemm_flops / rate + attention_flops / (312e12 * 0.497) + optimizer
    actual = costs.train_step_time(hw, arch, TrainConfig(micro_batch=1), SetShape(1, 8), sequences, seq_len, "lm")
    # Nothing can beat the roofline, so expected is a lower bound. On top of it come the memory-bound
    # elementwise kernels (norms 8h, rotary 4(q+kv), residual adds 12h, SwiGLU gating 6f bytes per token
    # and layer: 372,736 B forward, 3x that with backward = 0.62 us per token-layer at 1.79 TB/s, i.e.
    # 3.3% of the 19.1 us of GEMM per token-layer), kernel launch overheads (~34 kernels x 4 us per
    # layer and micro-batch against ~40 ms of GEMM: 0.3%) and the fp32 log-softmax (<0.1%): < 5% in all.
    assert expected <= actual <= 1.05 * expected


def test_training_time_grows_with_tokens_like_the_flops(toy_hw):
    one = costs.train_step_time(toy_hw, LLAMA7, TrainConfig(micro_batch=1), SetShape(1, 8), 4, 1024, "lm")
    two = costs.train_step_time(toy_hw, LLAMA7, TrainConfig(micro_batch=1), SetShape(1, 8), 8, 1024, "lm")
    optimizer = OVERHEAD + 40 * LLAMA7.params() / BW  # the fused AdamW and the clip: 40 B per parameter
    assert (two - optimizer) == pytest.approx(2 * (one - optimizer), rel=1e-12)  # twice the micro-batches


def test_pipeline_bubble_in_training(toy_hw):
    """1F1B: a step of n micro-batches on pp stages takes (n + pp - 1) micro-batch slots, plus the
    optimizer step (memory traffic over the stage's parameters)."""
    cfg = TrainConfig(pp=4, micro_batch=1)
    step = {n: costs.train_step_time(toy_hw, LLAMA7, cfg, SetShape(4, 8), n, 512, "lm") for n in (1, 2, 8)}
    slot = step[2] - step[1]
    assert step[8] - step[1] == pytest.approx(7 * slot, rel=1e-9)
    # The most loaded stage: 32/4 = 8 layers, plus the larger of the embedding and the LM head (+ norm).
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    stage_params = 8 * per_layer + 32000 * 4096 + 4096
    optimizer = OVERHEAD + 40 * stage_params / BW
    assert step[1] - 4 * slot == pytest.approx(optimizer, rel=1e-6)


@pytest.mark.parametrize(("pp", "micro"), [(1, 8), (2, 8), (4, 8), (4, 1), (8, 3)])
def test_pipeline_bubble_in_inference(toy_hw, pp, micro):
    cfg = InferConfig(pp=pp, dp=1, micro_batch=2)
    one = costs.inference_time(toy_hw, LLAMA7, cfg, SetShape(pp, 8), 2, 1024, "lm")
    many = costs.inference_time(toy_hw, LLAMA7, cfg, SetShape(pp, 8), 2 * micro, 1024, "lm")
    assert many / one == pytest.approx((micro + pp - 1) / pp, rel=1e-12)


def test_data_parallel_splits_the_batch(toy_hw):
    # Without communication terms on the critical path, 8 replicas of 1 micro-batch each take as long as
    # one replica with 1 micro-batch: the forward of 8 sequences on dp=8 equals that of 1 on dp=1.
    dp8 = costs.inference_time(toy_hw, LLAMA7, InferConfig(dp=8), ONE_NODE, 8, 1024, "lm")
    dp1 = costs.inference_time(toy_hw, LLAMA7, InferConfig(dp=1), SetShape(1, 8), 1, 1024, "lm")
    assert dp8 == pytest.approx(dp1, rel=1e-12)


def test_stage_params_by_hand(small_arch):
    per_layer = 36992
    assert layout.stage_params(small_arch, 1, "lm") == 2 * per_layer + 16640 + 64 + 16640
    assert layout.stage_params(small_arch, 2, "lm") == per_layer + max(16640, 16640 + 64)
    assert layout.stage_params(small_arch, 2, "scalar") == per_layer + max(16640, 64 + 1 + 64)


# -- generation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "pp", "expected"),
    [(1, 1, 2 * 2 * 8 * 128 * 32), (2, 1, 2 * 2 * 4 * 128 * 32), (8, 1, 2 * 2 * 1 * 128 * 32),
     (16, 1, 2 * 2 * 1 * 128 * 32),  # 8 KV heads on 16 GPUs: each GPU keeps one head (replicated)
     (1, 2, 2 * 2 * 8 * 128 * 16), (2, 4, 2 * 2 * 4 * 128 * 8)],
)
def test_kv_bytes_per_token_per_gpu(tp, pp, expected):
    arch = CATALOG["llama3.1-8b"]
    assert memory.kv_bytes_per_token_per_gpu(arch, GenConfig(tp=tp, pp=pp)) == expected


def test_decode_step_is_weight_and_kv_reads(toy_hw):
    """llama2-7b, one GPU, 8 sequences at 1000 tokens of context: every GEMM and the attention are
    memory-bound (arithmetic intensity ~8 and ~1 FLOP/byte against the toy ridge of 100)."""
    batch, context = 8, 1000
    h, f, layers, vocab = 4096, 11008, 32, 32000
    weights = 2 * (layers * (4 * h * h + 3 * h * f) + h * vocab)  # bf16 matrices; no embedding in decode
    kv = batch * context * (2 * layers * 32 * 128 * 2)  # K and V of every layer, bf16
    # Kernels: per layer 4 GEMMs, attention, 2 norms, rotary, 2 residual adds, SwiGLU gating; then the
    # final norm, LM head, log-softmax and sampling.
    kernels = layers * 11 + 4
    expected = (weights + kv) / BW + kernels * OVERHEAD
    actual = costs.decode_step_time(toy_hw, LLAMA7, GenConfig(), SetShape(1, 8), batch, context)
    # On top: activations (GEMM inputs/outputs ~1 MB, elementwise ~1.5 MB per layer against ~535 MB of
    # weights and KV per layer, ~0.5%) and the logits (~4 MB against 17 GB): well under 1%.
    assert expected <= actual <= 1.01 * expected


def test_decode_step_grows_by_exactly_the_extra_kv_read(toy_hw):
    batch = 8
    short = costs.decode_step_time(toy_hw, LLAMA7, GenConfig(), SetShape(1, 8), batch, 1000)
    long = costs.decode_step_time(toy_hw, LLAMA7, GenConfig(), SetShape(1, 8), batch, 3000)
    assert long - short == pytest.approx(batch * 2000 * LLAMA7.kv_bytes_per_token() / BW, rel=1e-9)


def test_decode_step_barely_depends_on_batch_when_weights_dominate(toy_hw):
    one = costs.decode_step_time(toy_hw, LLAMA7, GenConfig(), SetShape(1, 8), 1, 10)
    two = costs.decode_step_time(toy_hw, LLAMA7, GenConfig(), SetShape(1, 8), 2, 10)
    assert one < two < 1.01 * one


def test_tensor_parallel_decode_reads_fewer_weights_per_gpu(toy_hw):
    tp1 = costs.decode_step_time(toy_hw, LLAMA7, GenConfig(tp=1), ONE_NODE, 1, 10)
    tp2 = costs.decode_step_time(toy_hw, LLAMA7, GenConfig(tp=2), ONE_NODE, 1, 10)
    assert tp2 < tp1
    assert tp2 > tp1 / 2  # half the reads, plus all-reduces and the same kernel overheads


def _per_seq(arch, prompt, response) -> int:
    return memory.kv_bytes_per_token_per_gpu(arch, GenConfig()) * (prompt + response)


def test_generation_in_one_wave_when_the_budget_holds_everything(toy_hw, small_arch):
    # small_arch: 2 layers x K,V x 2 KV heads x 16 dims x 2 bytes = 256 bytes per token.
    assert _per_seq(small_arch, 16, 16) == 256 * 32
    cost = costs.generation_time(toy_hw, small_arch, GenConfig(), SetShape(1, 8), 64, 16, 16, 1e9)
    assert (cost.max_batch, cost.waves) == (64, 1)


def test_generation_waves_when_the_kv_budget_is_small(toy_hw, small_arch):
    per_seq = 256 * 32
    ample = costs.generation_time(toy_hw, small_arch, GenConfig(), SetShape(1, 8), 16, 16, 16, 1e9)
    tight = costs.generation_time(toy_hw, small_arch, GenConfig(), SetShape(1, 8), 64, 16, 16, 16 * per_seq)
    assert (tight.max_batch, tight.waves) == (16, 4)
    assert tight.seconds == pytest.approx(4 * ample.seconds, rel=1e-12)
    roomy = costs.generation_time(toy_hw, small_arch, GenConfig(), SetShape(1, 8), 64, 16, 16, 1e9)
    assert tight.seconds > 2 * roomy.seconds


def test_generation_partial_last_wave(toy_hw, small_arch):
    per_seq = 256 * 32
    cost = costs.generation_time(toy_hw, small_arch, GenConfig(), SetShape(1, 8), 64, 16, 16, 10 * per_seq + 100)
    assert (cost.max_batch, cost.waves) == (10, 7)  # 6 waves of 10, then 4
    ten = costs.generation_time(toy_hw, small_arch, GenConfig(), SetShape(1, 8), 10, 16, 16, 1e9).seconds
    four = costs.generation_time(toy_hw, small_arch, GenConfig(), SetShape(1, 8), 4, 16, 16, 1e9).seconds
    assert cost.seconds == pytest.approx(6 * ten + four, rel=1e-12)


def test_generation_replicas_split_the_sequences(toy_hw, small_arch):
    per_seq = 256 * 32
    cost = costs.generation_time(toy_hw, small_arch, GenConfig(dp=2), SetShape(2, 8), 64, 16, 16, 16 * per_seq)
    assert (cost.max_batch, cost.waves) == (16, 2)


def test_generation_impossible_when_one_sequence_does_not_fit(toy_hw, small_arch):
    cost = costs.generation_time(toy_hw, small_arch, GenConfig(), SetShape(1, 8), 64, 16, 16, 256 * 32 - 1)
    assert cost.seconds == math.inf
    assert (cost.max_batch, cost.waves) == (0, 0)


# -- resharding (hybrid engine) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("train", "gen", "gen_fraction", "own_fraction", "group"),
    [
        # Same layout, replicated: the GPU already holds its generation shard.
        (TrainConfig(tp=2, dp=4, shard=False), GenConfig(tp=2, dp=4), 1 / 2, 1 / 2, 1),
        # Generation shards are halves of training shards: nothing to fetch.
        (TrainConfig(tp=2, dp=4, shard=False), GenConfig(tp=4, dp=2), 1 / 4, 1 / 4, 1),
        # tp 4 -> 2: a GPU holds 1/4 and needs 1/2, from itself and one neighbour.
        (TrainConfig(tp=4, dp=2, shard=False), GenConfig(tp=2, dp=4), 1 / 2, 1 / 4, 2),
        # FSDP over dp 8, no TP: each GPU holds 1/8 and generation needs the whole model.
        (TrainConfig(tp=1, dp=8, shard=True), GenConfig(tp=1, dp=8), 1, 1 / 8, 8),
        # tp 2 and FSDP over 4: a GPU holds 1/2 / 4 = 1/8 and needs its tp-2 shard, 1/2.
        (TrainConfig(tp=2, dp=4, shard=True), GenConfig(tp=2, dp=4), 1 / 2, 1 / 8, 4),
        # FSDP over 8 into tp 4 generation: needs 1/4, holds 1/4 of it (1/16).
        (TrainConfig(tp=1, dp=8, shard=True), GenConfig(tp=4, dp=2), 1 / 4, 1 / 32, 8),
        # tp 4 x pp 2 -> tp 2: needs 1/2 of the model, holds 1/8 (a quarter of a stage's tp-4 shard).
        (TrainConfig(tp=4, pp=2, shard=False), GenConfig(tp=2, dp=4), 1 / 2, 1 / 8, 4),
        # pp 2 -> pp 1 at the same tp 2: needs 1/2, holds half of it.
        (TrainConfig(tp=2, pp=2, dp=2, shard=False), GenConfig(tp=2, dp=4), 1 / 2, 1 / 4, 2),
    ],
)
def test_resharding_fractions_and_groups(train, gen, gen_fraction, own_fraction, group):
    plan = resharding(train, gen)
    assert plan.gen_fraction == pytest.approx(gen_fraction)
    assert plan.own_fraction == pytest.approx(own_fraction)
    assert plan.received_fraction == pytest.approx(gen_fraction - own_fraction)
    assert plan.group == group


@pytest.mark.parametrize(
    ("train", "gen"),
    [(TrainConfig(tp=4, dp=3), GenConfig(tp=3, dp=4)), (TrainConfig(tp=2, pp=3, dp=2), GenConfig(tp=2, pp=2, dp=3)),
     (TrainConfig(tp=6, dp=2), GenConfig(tp=4, dp=3))],
)
def test_non_nesting_layouts_raise(train, gen):
    with pytest.raises(ValueError, match="does not nest"):
        resharding(train, gen)


def test_transition_free_when_generation_uses_the_training_layout(toy_hw):
    train = TrainConfig(tp=2, dp=4, shard=False)
    assert costs.transition_time(toy_hw, LLAMA7, train, GenConfig(tp=2, dp=4), ONE_NODE) == 0.0
    assert costs.transition_time(toy_hw, LLAMA7, train, GenConfig(tp=4, dp=2), ONE_NODE) == 0.0


def test_transition_of_sharded_training_by_hand(toy_hw):
    # tp 2, FSDP over 4: each GPU all-gathers its tp shard from 4 GPUs in the node, receiving 3/8 of every
    # split tensor (a half, less its eighth) and 3/4 of the norms (replicated over tp, FSDP-sharded over 4).
    norms = (2 * LLAMA7.layers + 1) * LLAMA7.hidden
    # Generating in the training layout, FSDP2 gathers unit by unit: 32 layers and the root, 33 rings of 3 steps.
    received = 2 * ((LLAMA7.params() - norms) * 3 / 8 + norms * 3 / 4)
    expected = (LLAMA7.layers + 1) * 3 * INTRA_ALPHA + received / INTRA_BW
    actual = costs.transition_time(toy_hw, LLAMA7, TrainConfig(tp=2, dp=4), GenConfig(tp=2, dp=4), ONE_NODE)
    assert actual == pytest.approx(expected, rel=1e-12)


def test_transition_tp4_to_tp2_by_hand(toy_hw):
    # Each GPU receives its tp-2 partner's quarter of every split tensor; both hold the norms whole already.
    norms = (2 * LLAMA7.layers + 1) * LLAMA7.hidden
    received = 2 * (LLAMA7.params() - norms) / 4
    expected = INTRA_ALPHA + received / INTRA_BW
    actual = costs.transition_time(toy_hw, LLAMA7, TrainConfig(tp=4, dp=2, shard=False), GenConfig(tp=2, dp=4),
                                   ONE_NODE)
    assert actual == pytest.approx(expected, rel=1e-12)


def test_sharded_transition_across_nodes_pays_the_network(toy_hw):
    # 16 GPUs on 2 nodes, tp 8 x FSDP dp 2. Ranks are numbered dp-major then tp, so rank = dp * 8 + tp:
    # dp index 0 is node 0 and dp index 1 is node 1. A GPU holds half of its tp shard; the other half
    # is on its dp peer in the other node. All 8 GPUs of a node fetch their missing halves at once
    # through the node's NICs, so the switch takes at least 8 x (1/16 of the bf16 weights) / 8e9 B/s.
    train, gen, where = TrainConfig(tp=8, dp=2, shard=True), GenConfig(tp=8, dp=2), SetShape(16, 8)
    received_per_gpu = 2 * LLAMA7.params() / 16
    lower_bound = 8 * received_per_gpu / INTER_BW
    assert costs.transition_time(toy_hw, LLAMA7, train, gen, where) >= lower_bound


def test_weight_sync_by_hand(toy_hw):
    norms = (2 * LLAMA7.layers + 1) * LLAMA7.hidden  # whole on every tp rank
    shard = 2 * ((LLAMA7.params() - norms) / 4 + norms)  # tp 4 generation shard
    same = costs.weight_sync_time(toy_hw, LLAMA7, GenConfig(tp=4, dp=2), SetShape(8, 8), same_node=True)
    assert same == pytest.approx(shard / INTRA_BW + INTRA_ALPHA)
    other = costs.weight_sync_time(toy_hw, LLAMA7, GenConfig(tp=4, dp=2), SetShape(8, 8), same_node=False)
    assert other == pytest.approx(8 * shard / INTER_BW + 10e-6)  # the node's 8 GPUs share its NICs


def test_a_weight_sync_moves_its_bytes_through_the_object_store_where_the_profile_measured_it(toy_hw):
    """Links.object_store: each rollout rank's shard through Ray's object store at its rate (on a GPU also out of
    and into the devices over the host link), across nodes the node's shards over the network first; without it,
    a point-to-point send (test_weight_sync_by_hand)."""
    from hfplan.profiles.hardware import Link

    store = toy_hw.model_copy(update={"links": toy_hw.links.model_copy(update={"object_store": Link(
        bandwidth_gbytes_per_s=0.5, efficiency=1.0, latency_us=4000)})})
    norms = (2 * LLAMA7.layers + 1) * LLAMA7.hidden
    shard = 2 * ((LLAMA7.params() - norms) / 4 + norms)
    handed = shard / 0.5e9  # the handover's latency is the profile's probe's: the sync's is weight_sync_us
    host = 2 * (3e-6 + shard / 1e10)  # toy_hw's host link: 1e10 B/s, 3 us
    same = costs.weight_sync_time(store, LLAMA7, GenConfig(tp=4, dp=2), SetShape(8, 8), same_node=True)
    assert same == pytest.approx(handed + host)
    other = costs.weight_sync_time(store, LLAMA7, GenConfig(tp=4, dp=2), SetShape(8, 8), same_node=False)
    assert other == pytest.approx(handed + host + 8 * shard / INTER_BW + 10e-6)
    # A CPU's processes hold their tensors in the host's memory: no device copies.
    on_host = store.model_copy(update={"backend": "gloo"})
    assert costs.weight_sync_time(on_host, LLAMA7, GenConfig(tp=4, dp=2), SetShape(8, 8), same_node=True) == \
        pytest.approx(handed)


def test_a_weight_sync_pays_its_measured_fixed_cost_through_ray_or_else_one_round_trip(toy_hw):
    """Runtime.weight_sync_us, where the profile measured it, replaces the controller's round trip that a profile
    without it charges for the buckets' way through the controller."""
    def sync(**runtime):
        hw = toy_hw.model_copy(update={"runtime": Runtime(**runtime)})
        return costs.weight_sync_time(hw, LLAMA7, GenConfig(tp=4, dp=2), SetShape(8, 8), same_node=True)

    bare = sync()
    assert sync(controller_call_us=3000) == pytest.approx(bare + 3000e-6)
    assert sync(controller_call_us=3000, weight_sync_us=7000) == pytest.approx(bare + 7000e-6)
    assert sync(controller_call_us=3000, weight_sync_us=0) == pytest.approx(bare)


def test_a_cost_memo_answers_as_the_direct_computation_and_clears(toy_hw):
    memo = costs.CostMemo()
    cfg = TrainConfig(tp=2, dp=2, micro_batch=1)
    direct = costs.update_time(toy_hw, LLAMA7, cfg, SetShape(4, 8), 16, 1024, "lm", 4, 1)
    assert costs.update_time(toy_hw, LLAMA7, cfg, SetShape(4, 8), 16, 1024, "lm", 4, 1, memo=memo) == direct
    assert set(memo.tables) == {"update_time", "stage_pass", "_layer_forward", "_head_forward"}
    assert costs.update_time(toy_hw, LLAMA7, cfg, SetShape(4, 8), 16, 1024, "lm", 4, 1, memo=memo) == direct
    assert len(memo.tables["update_time"]) == 1
    memo.clear()
    assert memo.tables == {}
