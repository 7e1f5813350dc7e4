"""Per-GPU memory of each role, and of a colocated set, with the reason a strategy does not fit.

A role's memory is what it keeps resident (weights; for trained roles also gradients, fp32 master
weights and Adam moments) plus what one of its calls needs while it runs (activations, logits,
the generation copy of the weights and the KV cache). Colocated roles keep their resident states
side by side; their calls run one after another, so a set's peak is the sum of resident states plus
the largest transient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hfplan.layout import (
    kv_heads_per_rank,
    micro_batch_sizes,
    most_generation_numel,
    most_new_numel,
    reshards_by_plan,
    stage_layers,
    stage_params,
    switch_round_bytes,
    trains_through_fsdp,
)
from hfplan.plan import GenConfig, InferConfig, Layout, Recompute, TrainConfig
from hfplan.profiles.models import ModelArch
from hfplan.simulator import sharding
from hfplan.simulator.kernels import BF16, FP32, kv_width
from hfplan.spec import ResponseLengths


def activation_values_per_token_layer(arch: ModelArch, tp: int) -> float:
    """Values one layer saves per token for its backward pass (flash attention, no sequence parallel):
    the two norm inputs and outputs (4h; 2h for a parallel block's one norm), q, k, v and the attention output
    (sharded by tp), and the MLP's gate, up and gated outputs (SwiGLU) or its up and activated outputs (GeLU),
    sharded by tp."""
    kv = kv_width(arch, tp)
    return 2 * arch.norms * arch.hidden + (2 * arch.q_dim / tp + 2 * kv) + arch.mlp_matrices * arch.ffn / tp


def layer_working_values_per_token(arch: ModelArch, tp: int) -> float:
    """Values alive at once inside one layer's forward (inference: nothing is kept for backward); with tp
    above the KV heads each rank computes its copied head (kv_heads_per_rank)."""
    kv = kv_width(arch, tp)
    return 2 * arch.hidden + arch.q_dim / tp + 2 * kv + arch.mlp_matrices * arch.ffn / tp


def score_bytes(arch: ModelArch, tp: int, sequences: float, seq_len: float, attention: str,
                value_bytes: int = BF16) -> float:
    """Bytes of eager attention's score matrices in one layer: the softmax's output, which its backward reads,
    and the probabilities PV reads (Korthikanti et al. 2022, section 4.1: 2as^2b bytes each in 16 bits; no
    dropout mask, RLHF models train without attention dropout), each sequences x heads/tp x seq_len x seq_len
    values. Inference holds the same two at once (the scores and their softmax). Flash attention keeps them on
    chip: 0."""
    if attention == "flash":
        return 0.0
    return 2 * value_bytes * sequences * (arch.heads / tp) * seq_len * seq_len


def train_resident_bytes(arch: ModelArch, cfg: TrainConfig, head: str, value_bytes: int = BF16) -> float:
    local = stage_params(arch, cfg.pp, head) / cfg.tp
    return sharding.resident_bytes_per_param(cfg, value_bytes) * local


def infer_resident_bytes(arch: ModelArch, cfg: Layout, head: str, value_bytes: int = BF16) -> float:
    return value_bytes * stage_params(arch, cfg.pp, head) / cfg.tp


def generation_step_bytes(arch: ModelArch, cfg: Layout, batch: float, context: float,
                          value_bytes: int = BF16) -> float:
    """What one step of a generation engine reads per GPU (per process on CPU): its weights and the KV cache of
    `batch` sequences at `context` tokens."""
    return (infer_resident_bytes(arch, cfg, "lm", value_bytes)
            + batch * context * kv_bytes_per_token_per_gpu(arch, cfg, value_bytes))


def _logits_bytes(arch: ModelArch, tokens: float, tp: int, head: str) -> float:
    return FP32 * tokens * (arch.vocab / tp if head == "lm" else 1)


def _gathered_layers_bytes(arch: ModelArch, cfg: TrainConfig, value_bytes: int) -> float:
    """Training with sharded weights gathers one layer's weights at a time and prefetches the next."""
    if cfg.shards("weights") == 1:
        return 0.0
    return 2 * value_bytes * arch.params_per_layer / cfg.tp


def in_flight_micro_batches(cfg: TrainConfig, n_micro: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once: up to pp under 1F1B; with v
    virtual stages, (1 + (pp - 1) / (pp v)) times that (Korthikanti et al., "Reducing Activation Recomputation
    in Large Transformer Models", 2022, section 4.2: the interleaved schedule's extra warm-up chunks)."""
    in_flight = min(cfg.pp, n_micro)
    if cfg.virtual_stages > 1 and cfg.pp > 1:
        in_flight *= 1 + (cfg.pp - 1) / (cfg.pp * cfg.virtual_stages)
    return in_flight


def train_transient_bytes(arch: ModelArch, cfg: TrainConfig, sequences_per_step: int, seq_len: int,
                          head: str, value_bytes: int = BF16, attention: str = "flash") -> float:
    """Activations of one optimizer step's micro-batches in flight, the logits and, for sharded training, the
    gathered layers. Eager attention also saves each layer's score matrices (score_bytes). Full recomputation
    keeps only each layer's input per micro-batch; the one micro-batch being recomputed has one layer's
    activations alive again (micro-batches are recomputed one at a time). Selective recomputation drops the
    saved scores and recomputes them in the backward, one layer at a time; flash attention never keeps them,
    so there it needs what none needs."""
    sizes = micro_batch_sizes(math.ceil(sequences_per_step / cfg.dp), cfg.micro_batch)
    micro, n_micro = sizes[0], len(sizes)
    tokens = micro * seq_len
    layers = stage_layers(arch, cfg.pp)
    saved = value_bytes * tokens * activation_values_per_token_layer(arch, cfg.tp)
    scores = score_bytes(arch, cfg.tp, micro, seq_len, attention, value_bytes)
    mode = Recompute.of(cfg.recompute)
    if mode is Recompute.FULL:
        per_micro, recomputing = layers * value_bytes * tokens * arch.hidden, saved + scores
    elif mode is Recompute.SELECTIVE:
        per_micro, recomputing = layers * saved, scores
    else:
        per_micro, recomputing = layers * (saved + scores), 0.0
    logits = 2 * _logits_bytes(arch, tokens, cfg.tp, head)  # logits and their gradient
    return (in_flight_micro_batches(cfg, n_micro) * per_micro + recomputing + logits
            + _gathered_layers_bytes(arch, cfg, value_bytes))


def infer_transient_bytes(arch: ModelArch, cfg: InferConfig, seq_len: int, head: str,
                          sharded: TrainConfig | None = None, value_bytes: int = BF16,
                          attention: str = "flash") -> float:
    tokens = cfg.micro_batch * seq_len
    working = (value_bytes * tokens * layer_working_values_per_token(arch, cfg.tp)
               + score_bytes(arch, cfg.tp, cfg.micro_batch, seq_len, attention, value_bytes))
    gathered = _gathered_layers_bytes(arch, sharded, value_bytes) if sharded is not None else 0.0
    return working + 2 * _logits_bytes(arch, tokens, cfg.tp, head) + gathered


def generation_shard_bytes(arch: ModelArch, gen: GenConfig, value_bytes: int = BF16) -> float:
    """One GPU's generation shard, the model split evenly over tp x pp: the copy vLLM keeps of it."""
    return value_bytes * arch.params("lm") / (gen.tp * gen.pp)


def generation_weights_bytes(arch: ModelArch, gen: GenConfig, train: TrainConfig, value_bytes: int = BF16) -> float:
    """Weights the hybrid engine's switch makes beside the training states (engines.hybrid): in the training layout,
    the whole shard FSDP2 unshards (new tensors beside its sharded ones, whatever the shard group), or nothing where
    the module trains as it is (generation reads the trained tensors); resharded by the per-tensor plan, the new
    tensors it makes (layout.most_new_numel: the trained tensors, fp32 master weights, serve as generation shards
    only where generation runs in fp32 too). vLLM's own copy is not counted here (mapping.gen_memory)."""
    if reshards_by_plan(train, gen):
        return value_bytes * most_new_numel(arch, train, gen, keeps_own=value_bytes == FP32)
    return value_bytes * most_generation_numel(arch, gen) if trains_through_fsdp(train.dp, value_bytes) else 0.0


def switch_buffer_bytes(arch: ModelArch, gen: GenConfig, train: TrainConfig, value_bytes: int = BF16) -> float:
    """The send and receive buffers of one round of the per-tensor switch (layout.switch_round_bytes): held
    during the switch only, before generation's working memory and KV cache."""
    return switch_round_bytes(arch, train, gen, value_bytes) if reshards_by_plan(train, gen) else 0.0


def generation_working_bytes(arch: ModelArch, gen: GenConfig, prompt_len: int, value_bytes: int = BF16,
                             attention: str = "flash") -> float:
    """Prefill of one sequence at a time bounds the live activations (with eager attention, its score
    matrices too); logits of a decode batch are small next to them."""
    return (value_bytes * prompt_len * layer_working_values_per_token(arch, gen.tp)
            + score_bytes(arch, gen.tp, 1, prompt_len, attention, value_bytes))


def vllm_working_bytes(arch: ModelArch, gen: GenConfig, batched_tokens: int, max_seqs: int,
                       value_bytes: int = BF16) -> float:
    """What vLLM sets aside for its activations before it sizes its KV cache: the peak of its profile run (vLLM
    0.32, gpu_model_runner.profile_run: one forward of max_num_batched_tokens dummy tokens, then the sampler over
    max_num_seqs rows of fp32 logits), which gpu_worker.determine_available_memory takes from its budget with the
    weights. Its attention is its own fused kernel: no score matrices, whatever the training stack's."""
    return (value_bytes * batched_tokens * layer_working_values_per_token(arch, gen.tp)
            + _logits_bytes(arch, min(max_seqs, batched_tokens), gen.tp, "lm"))


def kv_bytes_per_token_per_gpu(arch: ModelArch, cfg: Layout, value_bytes: int = BF16) -> float:
    """KV-cache bytes of one token on one GPU: KV heads split over tp (replicated when fewer than tp),
    layers split over pp."""
    heads_local = kv_heads_per_rank(arch.kv_heads, cfg.tp)
    return 2 * value_bytes * heads_local * arch.dim_per_head * stage_layers(arch, cfg.pp)


# vLLM's default KV-cache block on CUDA: 16 tokens (vLLM engine arguments, `--block-size`). A sequence's last block
# is partly empty, on average by (block - 1) / 2 tokens.
KV_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class KvSequence:
    """KV-cache bytes per GPU of one sequence in a rollout engine. `longest`: at its longest (prompt + maximum
    response), the least room an engine starts with (vLLM refuses a cache that cannot hold one sequence of the
    model length). `slot`: what a continuously refilled slot holds on average. `burst`: per sequence, at the
    fullest step of a batch started together. A reserved cache sets `longest` aside for every sequence it holds;
    a paged one holds each sequence's tokens so far, in blocks, and frees them when it ends."""

    longest: float
    slot: float
    burst: float

    def slots(self, budget: float, sequences: int, cap: int | None = None) -> int:
        """Sequences of a replica's `sequences` the engine holds at once in `budget` bytes per GPU (0: not one):
        all of them when their burst fits, else as many slots as the average slot allows; at most `cap`."""
        if budget < self.longest or sequences < 1:
            return 0
        held = sequences if sequences * self.burst <= budget else min(sequences - 1, int(budget // self.slot))
        return min(held, cap) if cap else held

    def most(self, budget: float) -> int:
        """The most sequences `budget` bytes per GPU can hold at once for any count of them (slots' bound)."""
        return int(budget // min(self.slot, self.burst))

    def held(self, batch: int, sequences: int) -> float:
        """Bytes per GPU the engine holds running `sequences` with `batch` of them at once: a batch started
        together at its fullest step, or refilled slots at their average."""
        return batch * (self.burst if batch >= sequences else self.slot)


NO_KV = KvSequence(0.0, 0.0, 0.0)


def kv_sequence(arch: ModelArch, gen: GenConfig, prompt_len: int, lengths: ResponseLengths,
                value_bytes: int = BF16) -> KvSequence:
    per_token = kv_bytes_per_token_per_gpu(arch, gen, value_bytes)
    if gen.kv_cache != "paged":
        longest = per_token * (prompt_len + lengths.max_len)
        return KvSequence(longest, longest, longest)
    partial_block = (KV_BLOCK_TOKENS - 1) / 2
    longest = per_token * KV_BLOCK_TOKENS * math.ceil((prompt_len + lengths.max_len) / KV_BLOCK_TOKENS)
    # a sequence never holds more blocks than its longest takes
    return KvSequence(longest, slot=min(longest, per_token * (prompt_len + lengths.held_by_slot + partial_block)),
                      burst=min(longest, per_token * (lengths.peak_held(prompt_len) + partial_block)))


def gib(nbytes: float) -> float:
    return nbytes / 1024**3
