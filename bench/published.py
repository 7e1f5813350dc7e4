"""Published measurements of real systems, with the cost model's prediction beside each.

Each case names its source (paper table, vendor benchmark page or nccl-tests result) and the configuration
measured; hfplan prices the same configuration with its public cost functions on the matching hardware profile
and converts to the published unit. Per case: published, predicted, their ratio and the error; then the median
and worst |error| per category and overall. Asserts nothing: the numbers are for reading.

    python bench/published.py [--csv PATH]

Assumptions common to the cases:
- GPT-style models are described as they are built (ModelArch.mlp, rotary_dim): a GeLU MLP of width 4h (MPT,
  GPT-J), no rotary embedding where positions are learned (MPT's default, which its benchmark yamls keep) and
  GPT-J's rotary on 64 of each head's 256 dimensions (its config.json's rotary_dim). MPT's projections all carry
  biases in these runs (MPTConfig's no_bias defaults to False and no yaml sets it; the table's NumParams counts them:
  12,853,954,560 for 13b at seq 2048 is the weights, position table and LayerNorms plus 11 x 5120 biases a block and
  the final norm's): the forward adds them in the GEMMs' epilogues (torch's linear on a contiguous input is one
  addmm), the backward sums each projection's output gradient over the tokens for its bias gradient
  (ModelArch.linear_bias, kernels.bias_gradients_time). Inference cases need no bias term (GPT-J's MLP biases ride
  the epilogues). A LayerNorm's bias is computed inside its own kernels: a fused LayerNorm moves the bytes an RMSNorm
  does. GPT-J's parallel
  attention and MLP read one norm's output (ModelArch.parallel_block: one norm a layer); its three-way residual sum
  is priced as the two adds an eager sum makes.
- Where a published system's network differs from the shipped profile's, the case prices the shipped profile with
  that one link changed (`_with_inter_node`, `_without_nvls`), and says so.
- Where a published run's attention kernel is not the shipped profiles' (FlashAttention-2), the case prices the
  kernel it ran at that kernel's measured rate (`_with_attention_rate`): llm-foundry's MPT runs used its Triton
  FlashAttention, measured on A100 in the flash-attention README's figure, and derived for H100 from it by
  FlashAttention-2's measured H100/A100 ratio (`_triton_attention_h100`, no H100 measurement of it being published).
  Nothing else of a profile is changed.
- The MPT runs' optimizer (composer's DecoupledAdamW, one unfused kernel per line of the update, weight decay 0) and
  gradient clipping by norm stream 92 bytes per parameter, as torch's foreach AdamW and the clip do
  (`Compute.optimizer` unfused, `costs.UNFUSED_ADAMW_PASS_BYTES`; `_with_unfused_adamw`; the shipped profiles price
  the executor's fused AdamW, 40 bytes): the lerp the torch one uses is a mul and an add there, and its weight-decay
  pass is skipped at weight decay 0, 8 bytes each way.
- The MPT runs' stack (11 of the 12 rows; A100's 70b row, not listed there, is priced alike): the results' Image
  column (llm-foundry commit beb8dee, scripts/train/benchmarking/h100new.md) names
  mosaicml/pytorch:2.1.0_cu121-nightly20230827, where submit_benchmarks.py installs torch 2.1.0.dev20230821+cu121 and
  mosaicml/composer 784f50be, whose mixed precision "DEFAULT" sets a bf16 param_dtype and leaves reduce_dtype unset
  (get_mixed_precision), which torch's FSDP1 takes as the param_dtype: gradients are reduce-scattered in bf16, and
  the weights gathered in bf16 (`_with_fsdp1`; the shipped profiles reduce in fp32, as the executor's FSDP2 does).
  FSDP1 (`Compute.fsdp_engine` fsdp1, `sharding.fsdp1_passes`) also makes memory passes of its own each micro-batch:
  the backward of its flat parameter's split views concatenates every unit's gradients into one flat gradient on the
  compute stream, and beside the collectives it casts each fp32 shard to bf16 before a gather and divides the flat
  gradient before its reduce-scatter (the predivide factor). The rest of the runs' FSDP settings (composer
  784f50be's dist_strategy.py set_fsdp_default and the yamls' fsdp_config) are what the model prices: FULL_SHARD,
  backward_prefetch BACKWARD_POST, forward_prefetch off, limit_all_gathers on, use_orig_params on, every block
  its own unit (MPT's fsdp_wrap_fn); no no_sync between micro-batches (composer's ddp_sync_context acts on DDP
  models only).
- The MPT tables' Throughput: collect_results.py (llm-foundry 061f2c7) takes a run's last
  throughput/samples_per_sec, composer's SpeedMonitor over the yamls' window of 10 batches (of the 30 that
  submit_benchmarks.py's mod_parameters runs, max_duration '30ba', evaluation off, eval_interval 0): samples over
  the wall-clock between batch ends (state.timestamp.total_wct, which leaves evaluation out). Every optimizer step
  and each batch's host work is inside it; a case prices one optimizer step (the global batch: GPUs x micro-batch
  x grad-accum sequences).
- H100's GEMMs run at the shipped profile's sustained rate (708.5 TFLOP/s: S. Bekman's MSMF of the same GH100
  compute at its 700 W limit, ~1465 MHz), not the boost-clock burst of his MAMF table (792.1 on H100 with the runs'
  CUDA 12.1): a training step keeps the tensor cores at the power limit. A100's is his MAMF (no A100 MSMF is
  published).
- FSDP's all-gathers and reduce-scatters run beside the compute they overlap, which they slow by the shipped
  profiles' `compute.overlap_slowdown` (18.9%, Lee et al., arXiv 2507.03114); each micro-batch's first and last
  layers' collectives have nothing beside them (`sharding.exposed_step_comm`).
- Collectives in a node run in the fastest of NCCL's ring protocols (LL, LL128, Simple) as NCCL's tuning model prices
  them (the shipped profiles' `links.intra_node.protocols`, from NVIDIA/nccl src/graph/tuning.cc); NVLS pays that
  model's 25 us latency on H100. Rings spanning nodes run in the same protocols at that model's network latencies
  (`links.inter_node.protocols`).
- FP16 inference runs are priced as bf16 (same bytes and tensor-core rate on A100).
- The shipped profiles' engine step (`runtime.engine_step_us`, 4 ms) is vLLM's Python scheduler's host work per step.
  gpt-fast does not pay it (`_engine_without_host_step`): it replays each decode step as one CUDA graph (generate.py:
  `torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)`), so its steps are their kernels alone.
  TensorRT-LLM's session publishes no per-step host figure: its cases keep the shipped one. gpt-fast also sets
  `torch._inductor.config.coordinate_descent_tuning = True` (generate.py), under which inductor decomposes an mm
  with one row into an elementwise product and a sum over K (torch/_inductor/decomposition.py, `mm`: "Our matrix
  vector multiplies only achieve peak bandwidth with coordinate descent tuning"): a batch-1 step's GEMMs are
  Triton reductions on the CUDA cores, not tensor-core tiles padded to 64 or 128 rows (`_gpt_fast`,
  Compute.matrix_vector "reduction").
- TensorRT-LLM v0.6.1's generation phase ran its masked multi-head attention kernel (the engines are built with
  `--use_gpt_attention_plugin`; its XQA kernel for grouped-query attention came in v0.8, per the repository's
  docs/source/blogs/XQA-kernel.md: "using tensor cores ... reducing data loading and conversion", up to 2.4x the
  throughput of LLaMA-70B at 128 in / 2048 out). That kernel runs one thread block per query head
  (decoderMaskedMultiheadAttentionTemplate.h: block `hi` reads KV head `hi / qhead_per_kv`) in fp32 on the CUDA
  cores: its throughput cases price the decode attention so (`_with_decode_attention`, Compute.decode_attention
  "per_query_head"), the query heads' re-reads of their KV head's cache at the profile's L2 rate (a100-80g: the
  5,411 GB/s te42kyfo/gpu-benches measures, not the 7,219 GB/s peak). LLaMA 7B and GPT-J have one query head per KV
  head, where this changes nothing.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from hfplan.plan import Layout, Recompute, TrainConfig
from hfplan.profiles.hardware import HardwareProfile, load_hardware
from hfplan.profiles.models import CATALOG, ModelArch
from hfplan.simulator import collectives as coll
from hfplan.simulator import costs

CATEGORIES = ("training", "prefill", "decode", "collective")
GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Case:
    """One published measurement and how hfplan predicts it (`predict` returns the published unit)."""

    category: str
    name: str
    unit: str
    published: float
    source: str
    predict: Callable[[], float]


@dataclass(frozen=True)
class Row:
    case: Case
    predicted: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.case.published

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.ratio - 1.0)


@dataclass(frozen=True)
class Summary:
    label: str
    cases: int
    median_abs_pct: float
    worst_pct: float  # signed error of the case with the largest |error|
    worst_name: str


# ---------------------------------------------------------------------------------------------- hardware, models

@cache
def _hw(name: str) -> HardwareProfile:
    return load_hardware(name)


@cache
def _with_inter_node(name: str, gbytes_per_s: float) -> HardwareProfile:
    """The shipped profile with the published system's network between nodes (GB/s per node)."""
    hw = _hw(name)
    inter = hw.links.inter_node.model_copy(update={"bandwidth_gbytes_per_s": gbytes_per_s})
    return hw.model_copy(update={"links": hw.links.model_copy(update={"inter_node": inter})})


@cache
def _without_nvls(name: str) -> HardwareProfile:
    """The shipped profile with NVLink SHARP off (a run that forces NCCL's ring algorithm)."""
    hw = _hw(name)
    intra = hw.links.intra_node.model_copy(update={"nvls": False})
    return hw.model_copy(update={"links": hw.links.model_copy(update={"intra_node": intra})})


@cache
def _engine_without_host_step(name: str) -> HardwareProfile:
    """The shipped profile with an inference engine that does no host work between its steps (a CUDA-graph replay,
    module docstring): its kernels, launches and collectives are all a step costs."""
    hw = _hw(name)
    runtime = hw.runtime.model_copy(update={"engine_step_us": 0.0, "engine_step_continuous_us": None})
    return hw.model_copy(update={"runtime": runtime})


@cache
def _gpt_fast(name: str) -> HardwareProfile:
    """The shipped profile with gpt-fast's engine: no host work between steps (_engine_without_host_step) and its
    one-row GEMMs run as reductions (Compute.matrix_vector, module docstring)."""
    hw = _engine_without_host_step(name)
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"matrix_vector": "reduction"})})


@cache
def _with_decode_attention(name: str, kernel: str) -> HardwareProfile:
    """The shipped profile with the published engine's decode attention kernel (Compute.decode_attention)."""
    hw = _hw(name)
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"decode_attention": kernel})})


# FlashAttention's Triton kernel (the flash-attn repository's flash_attn_triton.py, which llm-foundry's attn_impl
# "triton" runs), forward + backward, causal, head dimension 128, on A100 80GB SXM4: 50, 61, 68, 74, 78, 80 TFLOP/s at
# sequence lengths 512 .. 16k (Dao-AILab/flash-attention README "Performance",
# assets/flash2_a100_fwd_bwd_benchmark.png, panel (d), bars "FlashAttention Triton"), over 312 TFLOP/s peak.
TRITON_ATTENTION_A100 = tuple((length, tflops / 312) for length, tflops in
                              ((512, 50), (1024, 61), (2048, 68), (4096, 74), (8192, 78), (16384, 80)))



@cache
def _triton_attention_h100() -> tuple[tuple[int, float], ...]:
    """The Triton kernel's rate on H100, derived (no published measurement found): it is written for Ampere's
    synchronous mma.sync tensor-core instructions (its Triton predates Hopper's wgmma; llm-foundry's setup.py builds
    a pre-MLIR Triton patched only to compile for sm90), as FlashAttention-2 is, so it is taken to gain on H100 what
    FlashAttention-2 gains at each length: its A100 fraction of peak times FlashAttention-2's H100 fraction over its
    A100 fraction (the shipped profiles' attention_rate, the same figure's panel (d))."""
    a100, h100 = dict(_hw("a100-80g").compute.attention_rate), dict(_hw("h100-80g").compute.attention_rate)
    return tuple((length, fraction * h100[length] / a100[length]) for length, fraction in TRITON_ATTENTION_A100)


@cache
def _with_attention_rate(name: str, points: tuple[tuple[int, float], ...] | None) -> HardwareProfile:
    """The shipped profile with the attention kernel the published run used (its measured rate); None: the
    shipped one."""
    hw = _hw(name)
    if points is None:
        return hw
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"attention_rate": points})})


def _with_fsdp1(hw: HardwareProfile) -> HardwareProfile:
    """The profile with the MPT runs' FSDP: torch's FSDP1 (Compute.fsdp_engine fsdp1: its flat gradient and its
    casts and divisions, sharding.fsdp1_passes), reducing gradients in bf16 (Compute.gradient_reduce_bytes 2;
    module docstring)."""
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"gradient_reduce_bytes": 2,
                                                                          "fsdp_engine": "fsdp1"})})


def _with_unfused_adamw(hw: HardwareProfile) -> HardwareProfile:
    """The profile with the MPT runs' optimizer: an AdamW of one kernel per line of the update (Compute.optimizer
    unfused; module docstring)."""
    return hw.model_copy(update={"compute": hw.compute.model_copy(update={"optimizer": "unfused"})})


def gpt_arch(name: str, layers: int, hidden: int, heads: int, vocab: int, rotary_dim: int, tied: bool = True,
             linear_bias: bool = False, parallel_block: bool = False) -> ModelArch:
    """A GPT-style model: a GeLU MLP 4h wide, multi-head attention, `rotary_dim` rotated dimensions per head."""
    return ModelArch(name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab,
                     tied_embeddings=tied, mlp="gelu", rotary_dim=rotary_dim, linear_bias=linear_bias,
                     parallel_block=parallel_block)


# MPT sizes: mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-{1b,3b,7b,13b,30b,70b}.yaml (d_model, n_heads,
# n_layers; expansion_ratio 4; vocab_size 50368; MPT ties its output head to the embedding). The benchmark
# table's NumParams column agrees with these within 0.1%.
# Learned positions (llmfoundry/models/mpt/configuration_mpt.py at the same commit: learned_pos_emb True,
# attn_config alibi False, which the yamls leave): no rotary embedding; the position table (max_seq_len x d_model,
# under 0.1% of the weights) is left out. Biases on every projection (configuration_mpt.py: no_bias False, which
# the yamls keep; module docstring).
MPT = {size: gpt_arch(f"mpt-{size}", layers, hidden, heads, 50368, rotary_dim=0, linear_bias=True)
       for size, layers, hidden, heads in (("1b", 24, 2048, 16), ("3b", 32, 2560, 20), ("7b", 32, 4096, 32),
                                           ("13b", 40, 5120, 40), ("30b", 48, 7168, 56), ("70b", 80, 8192, 64))}
# GPT-J 6B (EleutherAI/gpt-j-6b config.json: n_layer 28, n_embd 4096, n_head 16, rotary_dim 64, vocab 50400,
# untied head). Its block runs attention and MLP side by side on one LayerNorm's output (transformers'
# modeling_gptj.py GPTJBlock: ln_1 only, `attn_output + feed_forward_hidden_states + residual`; TensorRT-LLM's
# GPTJDecoderLayer the same): ModelArch.parallel_block, one norm a layer.
GPTJ = gpt_arch("gpt-j-6b", 28, 4096, 16, 50400, rotary_dim=64, tied=False, parallel_block=True)


# ---------------------------------------------------------------------------------------------- predictions

def _fsdp_tokens_per_gpu(hw: HardwareProfile, arch: ModelArch, gpus: int, seq: int, micro: int, accum: int,
                         checkpointing: bool) -> float:
    """Tokens/s per GPU of one optimizer step under FSDP full sharding (ZeRO-3) over `gpus` ranks."""
    cfg = TrainConfig(dp=gpus, micro_batch=micro, shard="full",
                      recompute=Recompute.FULL if checkpointing else Recompute.NONE)
    sequences = gpus * micro * accum
    seconds = costs.train_step_time(hw, arch, cfg, costs.SetShape(gpus, hw.gpus_per_node), sequences, seq, "lm")
    return sequences * seq / seconds / gpus


def _first_token_ms(hw: HardwareProfile, arch: ModelArch, tp: int, prompt: int) -> float:
    """Milliseconds of the prefill of one prompt (time to first token at batch 1)."""
    parts = costs.prefill_parts(hw, arch, Layout(tp=tp), costs.SetShape(tp, hw.gpus_per_node), 1, prompt)
    return 1e3 * parts.total


def _batch1_tokens_per_s(hw: HardwareProfile, arch: ModelArch, tp: int, context: float) -> float:
    """Decode tokens/s of one sequence at `context` tokens."""
    return 1.0 / costs.decode_step_time(hw, arch, Layout(tp=tp), costs.SetShape(tp, hw.gpus_per_node), 1, context)


def _static_batch_tokens_per_gpu(hw: HardwareProfile, arch: ModelArch, tp: int, batch: int, prompt: int,
                                 output: int) -> float:
    """Output tokens/s per GPU of one static batch on `tp` GPUs: its prefill, then `output` decode steps."""
    parts = costs.wave_parts(hw, arch, tp, 1, costs.SetShape(tp, hw.gpus_per_node), batch, prompt, output)
    return batch * output / parts.total / tp


def _bus_gbytes_per_s(hw: HardwareProfile, op: str, ranks: int, per_node: int, nbytes: float) -> float:
    """nccl-tests' bus bandwidth of one collective (doc/PERFORMANCE.md: algbw = size / time, times 2(n-1)/n for
    all-reduce and (n-1)/n for all-gather and reduce-scatter; size is the whole buffer)."""
    group = coll.Group(ranks, per_node, per_node)
    seconds = {"all_reduce": coll.all_reduce, "all_gather": coll.all_gather,
               "reduce_scatter": coll.reduce_scatter}[op](hw, group, nbytes)
    factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks
    return nbytes / seconds * factor / 1e9


# ---------------------------------------------------------------------------------------------- the cases

FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7), table '{table}', "
           "row {row}: {gpus} GPUs, FSDP FULL_SHARD, bf16, seq {seq}, micro-batch {micro}, grad-accum {accum}, "
           "activation checkpointing {ckpt}; column Throughput (T/s/GPU)")
# The runs' attention kernel: submit_benchmarks.py (same commit) sets model.attn_config.attn_impl from --attn_impl,
# default "triton", which sweep.sh does not change: llm-foundry's Triton FlashAttention.
A100_FOUNDRY_TABLE = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
H100_FOUNDRY_TABLE = "H100 80GB BF16"


def _foundry(table: str, hw_name: str, size: str, gpus: int, seq: int, micro: int, accum: int, ckpt: bool,
             published: float, inter_node: float | None = None) -> Case:
    source = FOUNDRY.format(table=table, row=f"{size} {seq} {gpus}", gpus=gpus, seq=seq, micro=micro, accum=accum,
                            ckpt=ckpt)
    if inter_node is not None:
        source += f"; inter-node link set to the table's {inter_node:g} GB/s per node"
    # The runs' attention kernel (Triton FlashAttention, the comment above A100_FOUNDRY_TABLE): its measured rate on
    # A100, the rate derived from it on H100 (_triton_attention_h100).
    if hw_name == "a100-80g":
        source += "; attention at the Triton FlashAttention kernel's measured A100 rate"
    else:
        source += "; attention at the Triton FlashAttention kernel's rate derived for H100 (_triton_attention_h100)"

    def predict() -> float:
        attention = TRITON_ATTENTION_A100 if hw_name == "a100-80g" else _triton_attention_h100()
        hw = _with_unfused_adamw(_with_fsdp1(_with_attention_rate(hw_name, attention)))
        if inter_node is not None:
            inter = hw.links.inter_node.model_copy(update={"bandwidth_gbytes_per_s": inter_node})
            hw = hw.model_copy(update={"links": hw.links.model_copy(update={"inter_node": inter})})
        return _fsdp_tokens_per_gpu(hw, MPT[size], gpus, seq, micro, accum, ckpt)

    return Case("training", f"MPT-{size} {hw_name} x{gpus} seq{seq} mb{micro}{' ckpt' if ckpt else ''}",
                "tokens/s/GPU", published, source, predict)


def training_cases() -> list[Case]:
    a100, h100 = A100_FOUNDRY_TABLE, H100_FOUNDRY_TABLE
    # The A100 table's cluster: 1600 Gb/s between nodes = 200 GB/s per node (its heading). The H100 table states
    # no network: the shipped h100-80g profile's (8 x 400 Gb/s) is kept.
    return [
        _foundry(a100, "a100-80g", "1b", 8, 2048, 14, 4, False, 20513),
        _foundry(a100, "a100-80g", "3b", 8, 2048, 10, 2, False, 10811),
        _foundry(a100, "a100-80g", "7b", 8, 2048, 6, 2, False, 4641),
        _foundry(a100, "a100-80g", "13b", 8, 2048, 2, 3, False, 2262),
        _foundry(a100, "a100-80g", "30b", 8, 2048, 3, 21, True, 916),
        _foundry(a100, "a100-80g", "70b", 64, 2048, 8, 4, True, 410, inter_node=200.0),
        _foundry(h100, "h100-80g", "1b", 8, 2048, 14, 1, False, 45455),
        _foundry(h100, "h100-80g", "3b", 8, 4096, 5, 6, False, 20964),
        _foundry(h100, "h100-80g", "7b", 8, 2048, 6, 1, False, 10643),
        _foundry(h100, "h100-80g", "13b", 8, 2048, 2, 1, False, 4792),
        _foundry(h100, "h100-80g", "13b", 64, 2048, 2, 1, False, 4800),
        _foundry(h100, "h100-80g", "30b", 8, 2048, 3, 21, True, 2002),
    ]


TRTLLM = ("NVIDIA/TensorRT-LLM docs/source/performance.md (commit 138f96d; figures of v0.6.1, low latency of "
          "v0.5), A100 GPUs (FP16), {table}: {row}")


def prefill_cases() -> list[Case]:
    """Time to first token at batch 1 (TensorRT-LLM's low-latency table: a run with one output token)."""
    rows = [("LLaMA 7B", CATALOG["llama2-7b"], 1, 128, 16.0), ("LLaMA 7B", CATALOG["llama2-7b"], 1, 2048, 133.0),
            ("LLaMA 70B", CATALOG["llama2-70b"], 4, 128, 47.0), ("LLaMA 70B", CATALOG["llama2-70b"], 4, 2048, 377.0),
            ("GPT-J 6B", GPTJ, 1, 128, 12.0), ("GPT-J 6B", GPTJ, 1, 2048, 129.0)]
    # LLaMA 7B and 70B are priced as Llama 2 (7B: the same architecture as LLaMA 1; 70B exists only as Llama 2).
    return [Case("prefill", f"{model} a100-80g tp{tp} in{prompt} bs1", "ms", ms,
                 TRTLLM.format(table="Low Latency, 1st Token Latency (ms)",
                               row=f"{model}, batch 1, TP {tp}, input {prompt}"),
                 lambda arch=arch, tp=tp, prompt=prompt: _first_token_ms(_hw("a100-80g"), arch, tp, prompt))
            for model, arch, tp, prompt, ms in rows]


GPTFAST = ("pytorch-labs/gpt-fast README.md (commit 0f925b5), {table}: {row}, bf16, batch 1, 5-token prompt, "
           "8xA100-80GB power-limited to 330 W")


def decode_cases() -> list[Case]:
    # gpt-fast: batch-1 decode of generate.py's default 200 new tokens after a 5-token prompt, priced at the mean
    # context of 105 tokens. Its machine is an A100-80GB node ("hybrid cube mesh"); priced on a100-80g.
    fast = [("Llama-2-7B", "llama2-7b", tp, tok) for tp, tok in ((1, 104.9), (2, 168.84), (4, 254.02), (8, 328.43))]
    fast += [("Llama-2-70B", "llama2-70b", tp, tok) for tp, tok in ((2, 21.32), (4, 38.01), (8, 62.50))]
    cases = [Case("decode", f"{model} a100-80g tp{tp} bs1", "tokens/s", tok,
                  GPTFAST.format(table="Tensor Parallelism table" if tp > 1 else "Benchmarks table",
                                 row=f"{model}, {tp} GPU(s), Base"),
                  lambda name=name, tp=tp: _batch1_tokens_per_s(_gpt_fast("a100-80g"), CATALOG[name], tp, 5 + 100))
             for model, name, tp, tok in fast]
    # TensorRT-LLM peak throughput (static batching, gptSessionBenchmark): one batch of `batch` sequences, output
    # tokens per second per GPU. The A100 table's heading says only "out tok/s"; it is read as per GPU, as the H100
    # table beside it says: as a total, LLaMA 70B on 4 A100s would run 16x slower per GPU than on 2 H100s (FP8),
    # against about 4x for the 7B models on one GPU each.
    peak = [("LLaMA 7B", CATALOG["llama2-7b"], 1, 384, 128, 128, 5586.0),
            ("LLaMA 7B", CATALOG["llama2-7b"], 1, 60, 128, 2048, 1928.0),
            ("LLaMA 7B", CATALOG["llama2-7b"], 1, 52, 2048, 128, 591.0),
            ("LLaMA 70B", CATALOG["llama2-70b"], 4, 1280, 128, 128, 670.0),
            ("LLaMA 70B", CATALOG["llama2-70b"], 4, 240, 128, 2048, 525.0),
            ("GPT-J 6B", GPTJ, 1, 512, 128, 128, 6374.0),
            ("GPT-J 6B", GPTJ, 1, 60, 2048, 128, 670.0)]
    cases += [Case("decode", f"{model} a100-80g tp{tp} bs{batch} {prompt}/{output}", "tokens/s/GPU", tok,
                   TRTLLM.format(table="Peak Throughput, Throughput (out tok/s)",
                                 row=f"{model}, batch {batch}, TP {tp}, input {prompt}, output {output}")
                   + "; decode attention one block per query head (the masked multi-head attention kernel)",
                   lambda arch=arch, tp=tp, batch=batch, prompt=prompt, output=output:
                   _static_batch_tokens_per_gpu(_with_decode_attention("a100-80g", "per_query_head"), arch, tp,
                                                batch, prompt, output))
              for model, arch, tp, batch, prompt, output, tok in peak]
    return cases


def _collective(name: str, hw: Callable[[], HardwareProfile], op: str, ranks: int, per_node: int, nbytes: float,
                published: float, source: str) -> Case:
    return Case("collective", name, "busbw GB/s", published, source,
                lambda: _bus_gbytes_per_s(hw(), op, ranks, per_node, nbytes))


def collective_cases() -> list[Case]:
    nccl212 = ("NVIDIA/nccl-tests issue #212 (2024-05-06), NCCL maintainer's reply: on 8 H100 GPUs {what}; "
               "priced at an 8 GiB buffer (the reply: 256 MB is too small to reach peak)")
    return [
        _collective("all_reduce h100 x8 NVLS 8GiB", lambda: _hw("h100-80g"), "all_reduce", 8, 8, 8 * GIB, 480.0,
                    nccl212.format(what="all-reduce with NVLink SHARP peaks at ~480 GB/s busbw")),
        _collective("all_reduce h100 x8 ring 8GiB", lambda: _without_nvls("h100-80g"), "all_reduce", 8, 8, 8 * GIB,
                    370.0, nccl212.format(what="NCCL_ALGO=RING reaches ~370 GB/s busbw (NVLS off in the profile)")),
        _collective("all_gather h100 x8 8GiB", lambda: _hw("h100-80g"), "all_gather", 8, 8, 8 * GIB, 370.0,
                    nccl212.format(what="non-all-reduce collectives reach ~370 GB/s busbw")),
        _collective("reduce_scatter h100 x8 8GiB", lambda: _hw("h100-80g"), "reduce_scatter", 8, 8, 8 * GIB, 370.0,
                    nccl212.format(what="non-all-reduce collectives reach ~370 GB/s busbw")),
        _collective("all_reduce a100 x8 1GiB", lambda: _hw("a100-80g"), "all_reduce", 8, 8, GIB, 200.0,
                    "NVIDIA/nccl-tests issue #149 (2023-06-27): HPE Apollo 6500, 8x A100-SXM4-80GB over NVLink, "
                    "NCCL 2.18.1, all_reduce_perf -b 8 -e 1G -f 4 -t 8: busbw ~200 GB/s at the largest size"),
        _collective("all_reduce a100 x2 NVLink pair 12GiB", lambda: _hw("a100-80g"), "all_reduce", 2, 2, 12 * GIB,
                    208.0,
                    "NVIDIA/nccl-tests issue #178 (2023-11-17): two A100s joined by NVLink (NV12), all_reduce_perf "
                    "-b 8 -e 12G -f 2 -t 2: Bus_BW 208 GB/s; priced at the largest size"),
        _collective("all_reduce a100 3 nodes x8 128MiB", lambda: _with_inter_node("a100-80g", 100.0), "all_reduce",
                    24, 8, 128 * MIB, 96.0,
                    "NVIDIA/nccl-tests issue #119 (2022-11-17): 3 servers of 8 A100-SXM4-40GB and 4 HDR InfiniBand "
                    "cards each (4 x 200 Gb/s = 100 GB/s per node, set as the inter-node link), all_reduce_perf "
                    "-b 8 -e 128M: peak busbw ~96 GB/s (at the largest size, 128 MiB)"),
    ]


def build_cases() -> list[Case]:
    """Every case, by category (nothing is priced until a case's `predict` is called)."""
    return training_cases() + prefill_cases() + decode_cases() + collective_cases()


# ---------------------------------------------------------------------------------------------- the report

def predict_all(cases: list[Case]) -> list[Row]:
    return [Row(case, case.predict()) for case in cases]


def summarize(label: str, rows: list[Row]) -> Summary:
    worst = max(rows, key=lambda r: abs(r.error_pct))
    return Summary(label, len(rows), statistics.median(abs(r.error_pct) for r in rows), worst.error_pct,
                   worst.case.name)


def summaries(rows: list[Row]) -> list[Summary]:
    by_category = [summarize(c, [r for r in rows if r.case.category == c]) for c in CATEGORIES]
    return by_category + [summarize("overall", rows)]


def _fmt(value: float) -> str:
    return f"{value:,.1f}" if abs(value) < 1e4 else f"{value:,.0f}"


def write_report(rows: list[Row], out) -> None:
    out.write(f"{'category':<10} {'case':<42} {'unit':<13} {'published':>10} {'predicted':>10} {'ratio':>6} "
              f"{'error %':>8}\n")
    for r in rows:
        out.write(f"{r.case.category:<10} {r.case.name:<42} {r.case.unit:<13} {_fmt(r.case.published):>10} "
                  f"{_fmt(r.predicted):>10} {r.ratio:>6.2f} {r.error_pct:>+8.1f}\n")
    out.write(f"\n{'':<10} {'cases':>5} {'median |err| %':>15} {'worst err %':>12}  worst case\n")
    for s in summaries(rows):
        out.write(f"{s.label:<10} {s.cases:>5} {s.median_abs_pct:>15.1f} {s.worst_pct:>+12.1f}  {s.worst_name}\n")


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["category", "case", "unit", "published", "predicted", "ratio", "error_pct", "source"])
        for r in rows:
            writer.writerow([r.case.category, r.case.name, r.case.unit, r.case.published, r.predicted,
                             round(r.ratio, 4), round(r.error_pct, 2), r.case.source])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="also write every case (with its source) to this CSV file")
    args = parser.parse_args()
    rows = predict_all(build_cases())
    write_report(rows, sys.stdout)
    if args.csv:
        write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
