"""Per-GPU memory of training, inference and generation, by hand on small_arch of conftest.py:
hidden 64, q_dim 64, kv_dim 32, ffn 128, 2 layers, vocab 260; 36992 parameters per layer,
107328 in all with the LM head, 90753 with a scalar head."""

import pytest

from hfplan.plan import GenConfig, InferConfig, TrainConfig
from hfplan.profiles.models import CATALOG
from hfplan.simulator import memory
from hfplan.simulator.kernels import FP32
from hfplan.simulator.memory import (
    activation_values_per_token_layer,
    gib,
    kv_bytes_per_token_per_gpu,
    train_resident_bytes,
    train_transient_bytes,
)
from hfplan.spec import ResponseLengths

PER_LAYER = 36992
PARAMS = 2 * PER_LAYER + 16640 + 64 + 16640
SCALAR_PARAMS = 2 * PER_LAYER + 16640 + 64 + 64 + 1


def test_small_arch_totals(small_arch):
    assert (PARAMS, SCALAR_PARAMS) == (107328, 90753)
    assert small_arch.params() == PARAMS and small_arch.params("scalar") == SCALAR_PARAMS


@pytest.mark.parametrize(
    ("cfg", "head", "expected"),
    [
        (TrainConfig(), "lm", 18 * PARAMS),
        (TrainConfig(dp=4, shard=False), "lm", 18 * PARAMS),  # DDP: every rank holds everything
        (TrainConfig(dp=4, shard=True), "lm", 18 * PARAMS / 4),  # FSDP: a quarter each
        (TrainConfig(tp=2, dp=4, shard=True), "lm", 18 * PARAMS / 2 / 4),
        (TrainConfig(tp=2, dp=4, shard=False), "lm", 18 * PARAMS / 2),
        (TrainConfig(dp=2, shard=True), "scalar", 18 * SCALAR_PARAMS / 2),
        # pp 2: the loaded stage holds one layer plus the larger end (LM head + final norm).
        (TrainConfig(pp=2), "lm", 18 * (PER_LAYER + 16640 + 64)),
    ],
)
def test_train_resident_bytes(small_arch, cfg, head, expected):
    assert train_resident_bytes(small_arch, cfg, head) == pytest.approx(expected, rel=1e-12)


def test_train_resident_bytes_llama2_7b_on_one_gpu_does_not_fit_80gb():
    # 18 B x 6.74e9 = 121 GB of weights and optimizer states: more than an 80 GB GPU.
    resident = train_resident_bytes(CATALOG["llama2-7b"], TrainConfig(), "lm")
    assert resident == pytest.approx(18 * 6_738_415_616)
    assert gib(resident) > 80
    assert gib(train_resident_bytes(CATALOG["llama2-7b"], TrainConfig(dp=8), "lm")) < 80 / 4


def test_infer_resident_bytes(small_arch):
    assert memory.infer_resident_bytes(small_arch, InferConfig(tp=2, dp=4), "lm") == pytest.approx(2 * PARAMS / 2)
    assert memory.infer_resident_bytes(small_arch, InferConfig(), "scalar") == pytest.approx(2 * SCALAR_PARAMS)


@pytest.mark.parametrize(
    ("tp", "values"),
    [
        # norm inputs/outputs 4h + q and attention output 2q + k, v 2kv + gate, up, gated 3f.
        (1, 4 * 64 + 2 * 64 + 2 * 32 + 3 * 128),
        (2, 4 * 64 + 2 * 64 / 2 + 2 * 32 / 2 + 3 * 128 / 2),
        # 2 KV heads on 4 GPUs: each GPU keeps one head of 16 for k and for v.
        (4, 4 * 64 + 2 * 64 / 4 + 2 * 16 + 3 * 128 / 4),
    ],
)
def test_activation_values_per_token_layer(small_arch, tp, values):
    assert activation_values_per_token_layer(small_arch, tp) == pytest.approx(values)


def test_activation_bytes_per_token_layer_tp1(small_arch):
    assert 2 * activation_values_per_token_layer(small_arch, 1) == 2 * 832 == 1664  # bf16


def test_train_transient_bytes_by_hand(small_arch):
    seq_len = 128
    per_layer = 2 * seq_len * 832  # one micro-batch of one sequence
    logits = 2 * 4 * seq_len * 260  # fp32 logits and their gradient
    assert train_transient_bytes(small_arch, TrainConfig(), 4, seq_len, "lm") == pytest.approx(
        2 * per_layer + logits)


def test_recompute_keeps_only_layer_inputs(small_arch):
    seq_len = 128
    per_layer = 2 * seq_len * 832
    logits = 2 * 4 * seq_len * 260
    # Each layer's bf16 input is kept; one layer's activations live again during its backward.
    expected = 2 * (2 * seq_len * 64) + per_layer + logits
    with_recompute = train_transient_bytes(small_arch, TrainConfig(recompute=True), 4, seq_len, "lm")
    without = train_transient_bytes(small_arch, TrainConfig(), 4, seq_len, "lm")
    assert with_recompute == pytest.approx(expected)
    assert with_recompute < without


def test_recompute_reduces_activation_memory_of_a_real_model():
    arch = CATALOG["llama2-7b"]
    cfg = TrainConfig(micro_batch=4)
    without = train_transient_bytes(arch, cfg, 64, 2048, "lm")
    with_recompute = train_transient_bytes(arch, cfg.model_copy(update={"recompute": True}), 64, 2048, "lm")
    # 32 layers x 832-ish values collapse to 32 x h plus one layer: several times less.
    assert with_recompute < without / 4


def test_micro_batch_scales_activations(small_arch):
    one = train_transient_bytes(small_arch, TrainConfig(micro_batch=1), 8, 64, "scalar")
    four = train_transient_bytes(small_arch, TrainConfig(micro_batch=4), 8, 64, "scalar")
    assert four == pytest.approx(4 * one)


def test_pipeline_keeps_pp_micro_batches_in_flight(small_arch):
    seq_len = 128
    per_layer = 2 * seq_len * 832
    logits = 2 * 4 * seq_len * 260
    # pp 2: one layer per stage, up to 2 micro-batches in flight on the first stage (1F1B).
    assert train_transient_bytes(small_arch, TrainConfig(pp=2), 4, seq_len, "lm") == pytest.approx(
        2 * per_layer + logits)
    # With a single micro-batch only one is ever in flight.
    assert train_transient_bytes(small_arch, TrainConfig(pp=2), 1, seq_len, "lm") == pytest.approx(
        per_layer + logits)


def test_sharded_training_holds_gathered_layers(small_arch):
    seq_len = 128
    base = train_transient_bytes(small_arch, TrainConfig(dp=2, shard=False), 4, seq_len, "lm")
    sharded = train_transient_bytes(small_arch, TrainConfig(dp=2, shard=True), 4, seq_len, "lm")
    assert sharded - base == pytest.approx(2 * 2 * PER_LAYER)  # the gathered layer and the prefetched next, bf16


def test_infer_transient_bytes_by_hand(small_arch):
    tokens = 2 * 128
    working = 2 * tokens * (2 * 64 + (64 + 2 * 32) + 3 * 128)
    assert memory.infer_transient_bytes(small_arch, InferConfig(micro_batch=2), 128, "lm") == pytest.approx(
        working + 2 * 4 * tokens * 260)
    assert memory.infer_transient_bytes(small_arch, InferConfig(micro_batch=2), 128, "scalar") == pytest.approx(
        working + 2 * 4 * tokens * 1)


@pytest.mark.parametrize(
    ("gen", "per_token"),
    [(GenConfig(), 2 * 2 * 2 * 16 * 2), (GenConfig(tp=2), 2 * 2 * 1 * 16 * 2),
     (GenConfig(tp=4), 2 * 2 * 1 * 16 * 2), (GenConfig(pp=2), 2 * 2 * 2 * 16 * 1)],
)
def test_kv_bytes_per_token(small_arch, gen, per_token):
    assert kv_bytes_per_token_per_gpu(small_arch, gen) == pytest.approx(per_token)


def test_kv_cache_llama31_8b():
    # 128 KiB per token x 4096 tokens x 16 sequences = 8 GiB.
    assert kv_bytes_per_token_per_gpu(CATALOG["llama3.1-8b"], GenConfig()) * 4096 * 16 == 8 * 1024**3


def test_generation_weights_bytes(small_arch):
    full = 2 * PARAMS
    # A generation shard split evenly (vLLM's copy): half the model at tp 2.
    assert memory.generation_shard_bytes(small_arch, GenConfig(tp=2)) == pytest.approx(full / 2)
    # In the training layout: FSDP2 unshards the whole tp shard into new tensors (beside its sharded ones, whatever
    # the shard group): half of every split tensor and the 320 norm values whole; a module trained as it is (fp32,
    # one data-parallel rank) is read in place.
    for train in (TrainConfig(tp=2, dp=4), TrainConfig(tp=2, dp=4, shard=False)):
        assert memory.generation_weights_bytes(small_arch, GenConfig(tp=2, dp=4), train) == 2 * ((PARAMS - 320) / 2
                                                                                                 + 320)
    assert memory.generation_weights_bytes(small_arch, GenConfig(tp=2), TrainConfig(tp=2), FP32) == 0.0
    # Pipelined training to pp 1: a rank keeps its own stage's fp32 tensors and makes the other stage's; the busier
    # is the last (layer 1, the final norm and the head: 36992 + 64 + 16640). In bf16 every tensor is new.
    last_stage = PER_LAYER + 64 + 16640
    assert memory.generation_weights_bytes(small_arch, GenConfig(dp=2), TrainConfig(pp=2), FP32) == 4 * last_stage
    assert memory.generation_weights_bytes(small_arch, GenConfig(dp=2), TrainConfig(pp=2)) == full
    # Its round of transfers: the stage it sends and the one it receives, both under one bucket.
    assert memory.switch_buffer_bytes(small_arch, GenConfig(dp=2), TrainConfig(pp=2), FP32) == 4 * 2 * last_stage
    # FSDP over two ranks to generation tp 2: each rank's chunk of dim 0 is its tp slice of the column-split tensors
    # (q, k, v, gate, up, embedding, head: kept); it makes its halves of o and down (split along dim 1) and the
    # norms (whole, where it trains half of each): 2 * (4096 + 8192) / 2 + 2 * 128 + 64.
    made = memory.generation_weights_bytes(small_arch, GenConfig(tp=2), TrainConfig(dp=2), FP32)
    assert made == 4 * ((4096 + 8192) + 2 * 128 + 64)
    assert memory.switch_buffer_bytes(small_arch, GenConfig(tp=2, dp=4), TrainConfig(tp=2, dp=4)) == 0.0


def test_generation_working_bytes(small_arch):
    assert memory.generation_working_bytes(small_arch, GenConfig(tp=2), 100) == pytest.approx(
        2 * 100 * (2 * 64 + (64 + 2 * 32) / 2 + 3 * 128 / 2))


def test_gib():
    assert gib(3 * 1024**3) == 3.0


def test_full_recompute_under_a_pipeline_recomputes_one_micro_batch_at_a_time(small_arch):
    """pp 2 (one layer per stage), 4 micro-batches: 2 in flight keep their layer input each (h values per
    token); only the micro-batch being recomputed has its layer's 832 values per token alive again."""
    seq_len = 128
    checkpoint = 2 * seq_len * 64  # one layer's bf16 input
    per_layer = 2 * seq_len * 832
    logits = 2 * 4 * seq_len * 260
    full = train_transient_bytes(small_arch, TrainConfig(pp=2, recompute="full"), 4, seq_len, "lm")
    assert full == pytest.approx(2 * checkpoint + per_layer + logits)


def test_selective_recompute_keeps_what_flash_attention_keeps(small_arch):
    # Flash attention never saves the score matrix, which is all that selective recomputation drops.
    none = train_transient_bytes(small_arch, TrainConfig(), 4, 128, "lm")
    assert train_transient_bytes(small_arch, TrainConfig(recompute="selective"), 4, 128, "lm") == none


@pytest.mark.parametrize(("pp", "v", "n_micro", "in_flight"),
                         [(4, 1, 8, 4), (4, 2, 8, 4 * (1 + 3 / 8)), (4, 4, 8, 4 * (1 + 3 / 16)), (4, 2, 2, 2 * 1.375),
                          (1, 2, 8, 1)])
def test_interleaved_stages_hold_more_micro_batches(pp, v, n_micro, in_flight):
    assert memory.in_flight_micro_batches(TrainConfig(pp=pp, virtual_stages=v), n_micro) == pytest.approx(in_flight)


# Eager attention's score matrices, by hand on small_arch (4 heads, 2 layers): 2 bf16 matrices of
# micro x heads/tp x seq x seq per layer.
def test_eager_training_saves_two_score_matrices_per_layer(small_arch):
    seq_len, micro = 16, 2
    scores = 2 * 2 * micro * 4 * seq_len * seq_len  # 8192 bytes per layer
    flash = train_transient_bytes(small_arch, TrainConfig(micro_batch=micro), 2, seq_len, "lm")
    eager = train_transient_bytes(small_arch, TrainConfig(micro_batch=micro), 2, seq_len, "lm", attention="eager")
    assert eager - flash == pytest.approx(2 * scores)  # both layers keep theirs
    # tp 2: two heads per GPU, half the scores
    flash2 = train_transient_bytes(small_arch, TrainConfig(tp=2, micro_batch=micro), 2, seq_len, "lm")
    eager2 = train_transient_bytes(small_arch, TrainConfig(tp=2, micro_batch=micro), 2, seq_len, "lm",
                                   attention="eager")
    assert eager2 - flash2 == pytest.approx(scores)


def test_selective_recompute_drops_the_saved_scores_but_one_layer_recomputes_them(small_arch):
    seq_len = 16
    scores = 2 * 2 * 1 * 4 * seq_len * seq_len
    none = train_transient_bytes(small_arch, TrainConfig(), 1, seq_len, "lm", attention="eager")
    selective = train_transient_bytes(small_arch, TrainConfig(recompute="selective"), 1, seq_len, "lm",
                                      attention="eager")
    flash = train_transient_bytes(small_arch, TrainConfig(), 1, seq_len, "lm")
    # none: 2 layers' scores; selective: only the layer in its backward holds them again
    assert none - flash == pytest.approx(2 * scores)
    assert selective - flash == pytest.approx(scores)


def test_full_recompute_with_eager_scores_brings_one_layer_back(small_arch):
    seq_len = 16
    scores = 2 * 2 * 1 * 4 * seq_len * seq_len
    flash = train_transient_bytes(small_arch, TrainConfig(recompute="full"), 1, seq_len, "lm")
    eager = train_transient_bytes(small_arch, TrainConfig(recompute="full"), 1, seq_len, "lm", attention="eager")
    assert eager - flash == pytest.approx(scores)


def test_eager_inference_and_prefill_hold_the_scores_of_one_layer(small_arch):
    seq_len = 16
    flash = memory.infer_transient_bytes(small_arch, InferConfig(micro_batch=2), seq_len, "lm")
    eager = memory.infer_transient_bytes(small_arch, InferConfig(micro_batch=2), seq_len, "lm", attention="eager")
    assert eager - flash == pytest.approx(2 * 2 * 2 * 4 * seq_len * seq_len)
    prefill = memory.generation_working_bytes(small_arch, GenConfig(tp=2), 100, attention="eager")
    assert prefill - memory.generation_working_bytes(small_arch, GenConfig(tp=2), 100) == pytest.approx(
        2 * 2 * 1 * 2 * 100 * 100)


def test_reserved_kv_cache_sets_the_longest_aside_for_every_sequence(small_arch):
    per_token = 2 * 2 * 2 * 16 * 2  # K and V, bf16, 2 KV heads of 16, 2 layers
    kv = memory.kv_sequence(small_arch, GenConfig(), 20, ResponseLengths(300, 200.0, ((100, 0.5), (300, 0.5))))
    assert kv.longest == kv.slot == kv.burst == per_token * 320
    assert kv.slots(per_token * 320 * 5.5, sequences=8) == 5
    assert kv.slots(per_token * 320 * 8, sequences=8) == 8
    assert kv.slots(per_token * 319, sequences=8) == 0  # not one sequence at its longest


def test_paged_kv_cache_holds_tokens_as_they_come_in_blocks(small_arch):
    per_token = 2 * 2 * 2 * 16 * 2
    lengths = ResponseLengths(300, 200.0, ((100, 0.5), (300, 0.5)))
    kv = memory.kv_sequence(small_arch, GenConfig(batching="continuous", kv_cache="paged"), 20, lengths)
    partial = (memory.KV_BLOCK_TOKENS - 1) / 2  # 7.5 tokens of a sequence's last block, on average
    assert kv.longest == per_token * 16 * 20  # 320 tokens: 20 blocks of 16
    assert kv.slot == pytest.approx(per_token * (20 + 124.5 + partial))
    assert kv.burst == pytest.approx(per_token * (max(120, 0.5 * 320) + partial))
    # 8 bursts of 167.5 tokens fit in 1340 tokens' room: all at once; with less, refilled slots of 152 tokens
    # each, fewer than all (1339 // 152 = 8 slots would be all of them at once again).
    assert kv.slots(per_token * 1340, sequences=8) == 8
    assert kv.slots(per_token * 1339, sequences=8) == 7
    assert kv.slots(per_token * 1000, sequences=8) == 6  # 1000 // 152
    assert kv.slots(per_token * 1339, sequences=8, cap=4) == 4
    assert kv.slots(per_token * 319, sequences=8) == 0  # vLLM needs room for one sequence of the model length
    assert kv.most(per_token * 1340) == 8  # 1340 // 167.5 (a burst is the smaller here): no count holds more
    assert kv.held(8, 8) == pytest.approx(per_token * 1340) and kv.held(6, 8) == pytest.approx(per_token * 6 * 152)
    # A sequence never holds more than its longest in blocks: a fixed length's burst is exactly its blocks.
    fixed = memory.kv_sequence(small_arch, GenConfig(batching="continuous", kv_cache="paged"), 20,
                               ResponseLengths.fixed(300))
    assert fixed.burst == fixed.longest == per_token * 320


def test_vllm_sets_aside_its_profile_runs_activations(small_arch):
    # one forward of 1000 tokens: per token 2h + q/tp + 2 kv heads' values + 3 ffn/tp = 128 + 32 + 32 + 192 = 384
    # values of 2 bytes; then 8 rows of fp32 logits over half the vocabulary (tp 2)
    assert memory.vllm_working_bytes(small_arch, GenConfig(tp=2), 1000, 8) == pytest.approx(
        2 * 1000 * 384 + 4 * 8 * 130)
    # never more logit rows than tokens in the forward
    assert memory.vllm_working_bytes(small_arch, GenConfig(tp=2), 4, 8) == pytest.approx(2 * 4 * 384 + 4 * 4 * 130)


def test_each_engine_sets_aside_its_own_working_memory():
    from hfplan.simulator.mapping import engine_working
    from hfplan.spec import load_workload

    w = load_workload("ppo-llama2-7b")
    arch = w.arch("actor")
    torch_gen = GenConfig(tp=2, dp=4)
    # hfplan's torch engine prefills one prompt at a time
    assert engine_working(w, torch_gen, 2, "flash", 16384) == memory.generation_working_bytes(arch, torch_gen,
                                                                                             w.prompt_len)
    # vLLM: its profile run of the device's batched tokens, logits for the sequences it runs at once
    share = -(-w.sequences // 4)
    vllm_gen = GenConfig(tp=2, dp=4, engine="vllm")
    assert engine_working(w, vllm_gen, 2, "flash", 16384) == memory.vllm_working_bytes(arch, vllm_gen, 16384, share)
    capped = vllm_gen.model_copy(update={"max_batch": 3})
    assert engine_working(w, capped, 2, "flash", 8192) == memory.vllm_working_bytes(arch, capped, 8192, 3)
    assert engine_working(w, vllm_gen, 2, "flash", 16384) > engine_working(w, torch_gen, 2, "flash", 16384)


def test_generation_phase_peaks_at_the_switch_the_copy_or_generating():
    """gen_memory's extra bytes by hand: llama2-7b (32 layers, hidden 4096, ffn 11008, vocab 32000, untied) generating
    at tp 4 in bf16, from a separate rollout set and from the hybrid engine trained at tp 2 x pp 2."""
    from hfplan.simulator.mapping import engine_working, gen_memory
    from hfplan.spec import load_workload

    w = load_workload("ppo-llama2-7b")
    split = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 2 * 32000 * 4096  # every tensor tp splits
    norms = 32 * 2 * 4096 + 4096
    shard = 2 * (split + norms) / 4  # vLLM's copy: the model over tp 4
    made = 2 * (split // 4 + norms)  # every generation shard new (fp32 trained tensors), its norms whole
    buffers = 256 << 20  # one bucket: the GPU moves far more, and its largest slice (half the head) is 131 MB
    prefill = 2 * w.prompt_len * (2 * 4096 + 4096 // 4 + 2 * 4096 // 4 + 3 * 11008 // 4)  # one 1024-token prompt
    train = TrainConfig(tp=2, pp=2, dp=2)
    torch_gen, vllm_gen = GenConfig(tp=4, dp=2), GenConfig(tp=4, dp=2, engine="vllm")
    assert engine_working(w, torch_gen, 2, "flash", 16384) == prefill < buffers
    # The torch engine: the switch's buffers outweigh the prefill, and are gone before it.
    assert gen_memory(w, torch_gen, train, 2, vllm_tokens=16384)[0] == made + buffers
    # vLLM: the switch's tensors and vLLM's copy at once outweigh the copy beside vLLM's working memory.
    vllm_working = engine_working(w, vllm_gen, 2, "flash", 16384)
    assert shard + vllm_working < made + shard
    assert gen_memory(w, vllm_gen, train, 2, vllm_tokens=16384)[0] == pytest.approx(made + shard)
    # A separate rollout set: its synced shards are resident; vLLM copies them into its own beside them.
    assert gen_memory(w, torch_gen, None, 2, vllm_tokens=16384)[0] == prefill
    assert gen_memory(w, vllm_gen, None, 2, vllm_tokens=16384)[0] == pytest.approx(shard + vllm_working)


def test_a_gelu_mlp_saves_two_values_of_its_width(small_arch):
    from dataclasses import replace

    gelu = replace(small_arch, mlp="gelu")
    # SwiGLU saves gate, up and their product (3 x 128 / 2 at tp 2); GeLU its up projection and activation
    assert (memory.activation_values_per_token_layer(small_arch, 2)
            - memory.activation_values_per_token_layer(gelu, 2)) == pytest.approx(128 / 2)
    assert (memory.layer_working_values_per_token(small_arch, 2)
            - memory.layer_working_values_per_token(gelu, 2)) == pytest.approx(128 / 2)
