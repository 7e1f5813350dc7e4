"""Roofline cost of the kernels of one transformer layer, forward and backward, on one GPU.

Each kernel costs a fixed overhead plus the larger of its math time (FLOPs at the profile's
achievable matmul rate) and its memory time (bytes at the profile's achievable bandwidth). So
efficiency falls by itself where per-GPU work is small: small GEMMs are memory- or overhead-bound,
decode steps are weight-read bound, and large training GEMMs run near the measured matmul rate.
Where the profile describes its GEMM kernels' tiling, a GEMM's math rate is further scaled by its
shape (`gemm_shape_efficiency`): padded tiles, a last partial wave of tiles, a short reduction; where the
library splits K (small M, as in decode), the GEMM fills the SMs and becomes weight-read bound. Without a tiling
(CPUs), the rate is scaled by the GEMM's rows and its weight's bytes as the profile measured them (`row_fraction`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from hfplan.layout import kv_heads_per_rank
from hfplan.profiles.hardware import GemmTiling, HardwareProfile, MeasuredAttention, rows_by_weight
from hfplan.profiles.models import ModelArch

BF16 = 2  # bytes of a bf16 value (weights and activations on GPUs)
FP32 = 4  # bytes of an fp32 value (gradients, optimizer states, logits; everything on CPUs)


def kernel_time(hw: HardwareProfile, flops: float, nbytes: float, shape_efficiency: float = 1.0) -> float:
    """shape_efficiency: the fraction of the matmul rate this kernel's shape allows (GEMMs; 1 otherwise)."""
    compute = flops / (hw.matmul_flops * shape_efficiency)
    memory = nbytes / (hw.memory.bandwidth_gbytes_per_s * 1e9 * hw.memory.efficiency)
    return hw.compute.kernel_overhead_us * 1e-6 + max(compute, memory)


class GemmPlan(NamedTuple):
    """How the library runs one GEMM: the useful share of the tensor cores' work, and the K splits per output
    tile (1: no split-K)."""

    efficiency: float
    splits: int


def _padded_work(tiling: GemmTiling, tiles: int, tile_m: int, tile_n: int, k_blocks: int, splits: int) -> int:
    """Tensor-core work (multiply-adds) of `tiles` output tiles, each split over `splits` K ranges, in whole
    waves of sm_count, each K range walked in whole blocks plus the stages - 1 that fill the pipeline."""
    waves = math.ceil(tiles * splits / tiling.sm_count)
    k_work = (math.ceil(k_blocks / splits) + tiling.stages - 1) * tiling.tile_k
    return waves * tiling.sm_count * tile_m * tile_n * k_work


@functools.lru_cache(maxsize=1 << 16)
def gemm_plan(tiling: GemmTiling | None, m: float, k: float, n: float) -> GemmPlan:
    """The tile and K split the library would pick for an (m x k)(k x n) GEMM: the one with the least padded work.
    The output is covered by whole tiles (tile quantization), the tiles run in whole waves of sm_count (wave
    quantization), and each tile walks K in whole blocks of tile_k plus the stages - 1 blocks that fill its
    pipeline (the short-K loss). With `split_k`, an output of fewer tiles than SMs may split K over up to
    ceil(sm_count / tiles) tiles each (more only adds waves), as CUTLASS's and cuBLAS's split-K kernels do for small
    M: a decode GEMM then streams its weights from every SM instead of a few. (1, 1) without a tiling (CPUs)."""
    if tiling is None:
        return GemmPlan(1.0, 1)
    k_blocks = math.ceil(k / tiling.tile_k)
    best = GemmPlan(0.0, 1)
    for tile_m, tile_n in tiling.tiles:
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
        most = min(k_blocks, max(1, math.ceil(tiling.sm_count / tiles))) if tiling.split_k else 1
        for splits in range(1, most + 1):
            efficiency = m * n * k / _padded_work(tiling, tiles, tile_m, tile_n, k_blocks, splits)
            if efficiency > best.efficiency:
                best = GemmPlan(efficiency, splits)
    return best


def gemm_shape_efficiency(tiling: GemmTiling | None, m: float, k: float, n: float) -> float:
    """Useful fraction of the tensor cores' work for an (m x k)(k x n) GEMM (`gemm_plan`); 1 without a tiling."""
    return gemm_plan(tiling, m, k, n).efficiency


def split_k_bytes(tiling: GemmTiling | None, m: float, k: float, n: float) -> float:
    """Memory traffic a split-K GEMM adds to its operands': the fp32 partial sums of its K ranges meet through
    memory (serial split-K, CUTLASS's SplitKSerial: each range but the last writes its partial m x n sums, each but
    the first reads the one before it)."""
    splits = gemm_plan(tiling, m, k, n).splits
    return 2.0 * (splits - 1) * FP32 * m * n


def reduction_matrix_vector_time(hw: HardwareProfile, k: float, n: float) -> float:
    """One row times a (k x n) matrix as an elementwise product summed over K (Compute.matrix_vector "reduction"):
    no tensor-core tile to pad, so it reads the weights (and the row, writes the output) at the memory bandwidth,
    its 2kn multiply-adds in fp32 on the CUDA cores where vector_tflops is known."""
    nbytes = hw.compute.value_bytes * (k + k * n + n)
    times = [nbytes / (hw.memory.bandwidth_gbytes_per_s * 1e9 * hw.memory.efficiency)]
    if hw.compute.vector_tflops is not None:
        times.append(2.0 * k * n / (hw.compute.vector_tflops * 1e12))
    return hw.compute.kernel_overhead_us * 1e-6 + max(times)


def log_interpolated(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The value at `x` of (x, value) points, x increasing: interpolated in log(x) between two points, the end's
    value beyond either end."""
    if x <= points[0][0]:
        return points[0][1]
    for (low, low_value), (high, high_value) in zip(points, points[1:], strict=False):
        if x <= high:
            t = math.log(x / low) / math.log(high / low)
            return low_value + t * (high_value - low_value)
    return points[-1][1]


# A profile's table grouped once: gemm_time is the search's hot path.
_rows_by_weight = functools.cache(rows_by_weight)


def row_fraction(hw: HardwareProfile, m: float, weight_bytes: float, backward: bool = False, cached: bool = False
                 ) -> float:
    """Fraction of the matmul rate a GEMM of `m` rows by a weight (its k x n operand) of `weight_bytes` reaches
    where the profile has no tiling model (Compute.row_efficiency; with `backward`, of that product's backward pair,
    Compute.backward_row_efficiency; `cached`, with its operands in the cache, Compute.cached_row_efficiency: in log
    rows along each weight size measured, then in log bytes between the two sizes around this one; 1 without a
    table)."""
    table = (hw.compute.backward_row_efficiency if backward
             else hw.compute.cached_row_efficiency if cached else hw.compute.row_efficiency)
    if table is None:
        return 1.0
    by_weight = _rows_by_weight(table)
    if weight_bytes <= by_weight[0][0]:
        return log_interpolated(by_weight[0][1], m)
    for (low, low_points), (high, high_points) in zip(by_weight, by_weight[1:], strict=False):
        if weight_bytes <= high:
            low_value = log_interpolated(low_points, m)
            t = math.log(weight_bytes / low) / math.log(high / low)
            return low_value + t * (log_interpolated(high_points, m) - low_value)
    return log_interpolated(by_weight[-1][1], m)


def gemm_time(hw: HardwareProfile, m: float, k: float, n: float, cached: bool = False) -> float:
    """(m x k) @ (k x n) in the device's compute precision; one row (m = 1) as the stack runs it
    (Compute.matrix_vector). Its math rate is scaled by its shape: by tiles and waves where the profile describes
    the GEMM library's tiling, else by its rows and its weight's bytes (Compute.row_efficiency). `cached`: its
    operands are in the cache already (costs.step_operands_cached), where the profile measured such products
    (Compute.cached_row_efficiency): at that fraction of peak, with no memory term."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    if cached and hw.compute.cached_row_efficiency is not None:  # a fraction of peak, not of the matmul rate
        return kernel_time(hw, 2.0 * m * k * n, 0.0, row_fraction(hw, m, hw.compute.value_bytes * k * n, cached=True)
                           / hw.compute.matmul_efficiency)
    if m == 1 and hw.compute.matrix_vector == "reduction":
        return reduction_matrix_vector_time(hw, k, n)
    tiling = hw.compute.gemm
    nbytes = hw.compute.value_bytes * (m * k + k * n + m * n) + split_k_bytes(tiling, m, k, n)
    shape = (gemm_shape_efficiency(tiling, m, k, n) if tiling is not None
             else row_fraction(hw, m, hw.compute.value_bytes * k * n))
    return kernel_time(hw, 2.0 * m * k * n, nbytes, shape)


def gemm_backward_time(hw: HardwareProfile, m: float, k: float, n: float) -> float:
    """The backward of an (m x k) @ (k x n) product (a layer's input times its weight): the input gradient
    (m x n)(n x k) and the weight gradient (k x m)(m x n), whose reduction runs over the m rows. Where the profile
    measured that pair by rows (Compute.backward_row_efficiency, CPUs), both at its fraction; otherwise each GEMM at
    the efficiency of its own shape (the weight gradient's K is the rows: few of them are a short reduction)."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    if hw.compute.gemm is None and hw.compute.backward_row_efficiency is not None:
        v = hw.compute.value_bytes
        nbytes = 2 * v * (m * n + n * k + m * k)  # each of the two GEMMs reads two of these and writes the third
        fraction = row_fraction(hw, m, v * k * n, backward=True)
        return hw.compute.kernel_overhead_us * 1e-6 + kernel_time(hw, 4.0 * m * k * n, nbytes, fraction)
    return gemm_time(hw, m, n, k) + gemm_time(hw, k, m, n)


def memory_time(hw: HardwareProfile, nbytes: float) -> float:
    """An elementwise (memory-bound) kernel moving nbytes."""
    return kernel_time(hw, 0.0, nbytes) if nbytes > 0 else 0.0


# Backward-to-forward work of attention. Flash: 5 matmuls to the forward's 2 (Dao, FlashAttention-2, 2023).
# Eager: 4 matmuls to 2 (dS V^T... the gradients of Q, K, V and the scores' product), and the softmax backward
# reads the saved probabilities and their gradient and writes one gradient, as the forward's passes do.
ATTENTION_BACKWARD = {"flash": 2.5, "eager": 2.0}


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer's kernels on one GPU, by kind; TP communication is costed separately."""

    gemm: float
    attention: float
    elementwise: float
    gemm_backward: float  # the backward's GEMMs: each forward GEMM's input and weight gradients (gemm_backward_time)
    attention_backward: float = ATTENTION_BACKWARD["flash"]
    backward_only: float = 0.0  # memory-bound kernels the backward runs and the forward has no counterpart of

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise

    def backward(self) -> float:
        """Backward: two GEMMs per forward GEMM (input and weight gradients, `gemm_backward`); attention by its
        kernel (ATTENTION_BACKWARD); elementwise ops read the saved input and the incoming gradient and write one
        gradient; then the backward's own kernels (`backward_only`: bias gradients)."""
        return (self.gemm_backward + self.attention_backward * self.attention + 2.0 * self.elementwise
                + self.backward_only)


def kv_width(arch: ModelArch, tp: int) -> int:
    """Width of the keys (and of the values) one of `tp` tensor-parallel ranks holds: its KV heads x the head size."""
    return kv_heads_per_rank(arch.kv_heads, tp) * arch.dim_per_head


def attention_fraction(hw: HardwareProfile, seq_len: float) -> float:
    """Fraction of peak the flash attention kernel reaches over sequences of `seq_len` keys: the profile's measured
    rate (Compute.attention_rate, interpolated in log(length), the end's fraction beyond either end), or
    matmul_efficiency where it has none. A fused attention kernel keeps its softmax, masking and rescaling between
    the two matmuls of each tile, on the SM's slower units, and a causal pass skips half its tiles and idles on the
    diagonal ones, so it runs well below the GEMM rate, the more so on short sequences (fewer tiles per query
    block to amortise each block's prologue and epilogue over)."""
    points = hw.compute.attention_rate
    return hw.compute.matmul_efficiency if points is None else log_interpolated(points, seq_len)


def shard(dim: int, tp: int) -> float:
    return dim / tp


def per_query_head_decode_time(hw: HardwareProfile, tokens: float, keys: float, q_local: float, kv_local: float,
                               hbm_bytes: float) -> float:
    """A decode attention kernel that runs one thread block per query head (Compute.decode_attention
    "per_query_head"): each of the `q_local / kv_local` query heads sharing a KV head reads that head's whole
    cache, so the cache crosses HBM once (the first reader brings it into L2) and L2 that many times; the dot
    products and the weighted sum run in fp32 on the CUDA cores. The slowest of the three bounds (HBM, L2, CUDA
    cores) sets its time; with one query head per KV head (multi-head attention) it is the HBM read, as a grouped
    kernel's."""
    group = max(1.0, q_local / kv_local)
    cache_bytes = hw.compute.value_bytes * tokens * keys * 2 * kv_local
    times = [hbm_bytes / (hw.memory.bandwidth_gbytes_per_s * 1e9 * hw.memory.efficiency)]
    if hw.memory.l2_gbytes_per_s is not None:
        times.append((hbm_bytes + (group - 1) * cache_bytes) / (hw.memory.l2_gbytes_per_s * 1e9))
    if hw.compute.vector_tflops is not None:
        times.append(4.0 * tokens * keys * q_local / (hw.compute.vector_tflops * 1e12))
    return hw.compute.kernel_overhead_us * 1e-6 + max(times)


def measured_attention_time(hw: HardwareProfile, kernel: MeasuredAttention, tokens: float, keys: float,
                            heads_local: float, head_dim: int, kv_local: float, decode: bool, length: float) -> float:
    """Attention as the profile timed the kernel (Compute.measured_attention, CPU processes): its call, a pair per
    sequence and query head (`tokens` sequences in a decode step, tokens / `length` in a pass over whole sequences:
    attention_time takes it from seq_len, else from the keys a causal query attends, (length + 1) / 2), a score per
    query, key and head, and its 4 x tokens x keys x query width FLOPs at the measured rate. A decode call whose
    keys and values do not fit the cache (`decode_streams`; the rate was fitted on calls whose did) has its products
    no faster than each pair's read of its KV head's keys and values at the memory bandwidth: the kernel walks the
    pairs, so query heads that share a KV head read it again."""
    sequences = tokens if decode else tokens / max(1.0, length)
    scores = tokens * keys * heads_local
    products = 4.0 * scores * head_dim / (kernel.tflops * 1e12)
    if decode and decode_streams(hw.compute.cache_bytes, hw.compute.value_bytes * tokens * keys * 2 * kv_local):
        read = hw.compute.value_bytes * scores * 2 * head_dim
        products = max(products, read / (hw.memory.bandwidth_gbytes_per_s * 1e9 * hw.memory.efficiency))
    fixed = (kernel.call_us + sequences * heads_local * kernel.pair_us) * 1e-6
    return fixed + scores * kernel.score_ns * 1e-9 + products


def decode_streams(cache_bytes: int | None, kv_bytes: float) -> bool:
    """Whether a decode call's keys and values (`kv_bytes`) stream from memory: more than the cache one process
    keeps (Compute.cache_bytes; a profile that did not measure it has the rate its kernel was timed at)."""
    return cache_bytes is not None and kv_bytes > cache_bytes


def attention_time(hw: HardwareProfile, arch: ModelArch, tokens: float, keys_per_token: float, tp: int,
                   decode: bool, seq_len: float | None = None) -> float:
    """Attention of `tokens` queries on one of `tp` GPUs, with the profile's kernel (compute.attention).

    flash: one fused kernel; q, k, v and the output cross memory once (decode: the whole KV cache is read),
    scores never do; its math runs at the kernel's measured rate (`attention_fraction`). eager (the scores through
    memory, as a plain PyTorch attention): QK^T writes the score matrix, the softmax reads it and writes the
    probabilities, PV reads them; a causal pass computes every query against all `seq_len` keys of its sequence (the
    mask is applied, not skipped). A decode step with compute.decode_attention "per_query_head" runs the stack's
    one-block-per-query-head kernel instead (`per_query_head_decode_time`). A profile that timed its kernel
    (compute.measured_attention, CPU processes) prices it as measured (`measured_attention_time`), whichever of
    these it names, the backward at ATTENTION_BACKWARD times that forward."""
    v = hw.compute.value_bytes
    kv_local = kv_width(arch, tp)
    q_local = shard(arch.q_dim, tp)
    measured = hw.compute.measured_attention
    if measured is not None:
        return measured_attention_time(hw, measured["decode" if decode else "forward"], tokens, keys_per_token,
                                       q_local / arch.dim_per_head, arch.dim_per_head, kv_local, decode,
                                       seq_len if seq_len is not None else 2 * keys_per_token - 1)
    if decode:
        io_bytes = v * (tokens * keys_per_token * 2 * kv_local + 2 * tokens * q_local)
        if hw.compute.decode_attention == "per_query_head":
            return per_query_head_decode_time(hw, tokens, keys_per_token, q_local, kv_local, io_bytes)
    else:
        io_bytes = v * tokens * (2 * q_local + 2 * kv_local)
    if hw.compute.attention == "flash":
        # Its rate by the sequence's length (a decode step: the context it reads), as a share of the matmul rate.
        share = attention_fraction(hw, seq_len if seq_len is not None else keys_per_token)
        return kernel_time(hw, 4.0 * tokens * keys_per_token * q_local, io_bytes,
                           share / hw.compute.matmul_efficiency)
    keys = keys_per_token if decode or seq_len is None else seq_len
    heads_local = q_local / arch.dim_per_head
    scores = v * tokens * keys * heads_local  # bytes of one score (or probability) matrix
    half_flops = 2.0 * tokens * keys * q_local  # each of QK^T and PV
    return (kernel_time(hw, half_flops, io_bytes / 2 + scores)  # QK^T: read q and k, write the scores
            + memory_time(hw, 2 * scores)  # softmax: read the scores, write the probabilities
            + kernel_time(hw, half_flops, io_bytes / 2 + scores))  # PV: read them and v, write the output


def kv_cache_write_time(hw: HardwareProfile, arch: ModelArch, tokens: float, tp: int) -> float:
    """One layer of a prefill storing its `tokens` tokens' keys and values in the KV cache, on one of `tp` GPUs: a
    pass that reads each token's k and v (the KV heads this rank holds) and writes them into the cache, 4 x kv values
    a token. Every generation engine makes it: vLLM's attention layer calls `reshape_and_cache_flash` (v1
    attention backends, flash_attn.py), hfplan's torch engine copies each layer's k and v into its preallocated cache
    (`_forward`: `keys.narrow(...).copy_(k)`, `values...copy_(v)`), TensorRT-LLM's context phase writes them from
    the kernel that adds the QKV bias and rotates q and k in place (`invokeApplyBiasRopeUpdateKVCache`,
    gptAttentionCommon). A training or log-prob forward keeps no cache and makes none; a decode step appends one
    token's k and v, bytes a step's cache read dwarfs, not priced."""
    kv_local = kv_width(arch, tp)
    return memory_time(hw, hw.compute.value_bytes * 4 * tokens * kv_local)


def biased_widths(arch: ModelArch, tp: int) -> list[float]:
    """Output widths, on one of `tp` GPUs, of a layer's projections that carry a bias: q, k and v where the attention
    has biases (ModelArch.attention_bias, linear_bias), and the attention's output and the MLP's where every
    projection has one (linear_bias)."""
    kv_local = kv_width(arch, tp)
    widths = [shard(arch.q_dim, tp) + 2 * kv_local] if arch.attention_bias or arch.linear_bias else []
    if arch.linear_bias:
        widths += [arch.hidden, shard((arch.mlp_matrices - 1) * arch.ffn, tp), arch.hidden]
    return widths


def bias_gradients_time(hw: HardwareProfile, arch: ModelArch, tokens: float, tp: int) -> float:
    """The backward's bias gradients of one layer: each is its projection's output gradient summed over the tokens,
    one reduction kernel reading that gradient whole (torch's addmm backward: the bias, broadcast over the rows,
    gets `grad` summed to its shape; the GEMMs' epilogues add a bias in the forward, but no GEMM computes its
    gradient). Reads dominate: the sum's one row per projection is left out."""
    return sum(memory_time(hw, hw.compute.value_bytes * tokens * width) for width in biased_widths(arch, tp))


def layer_forward(hw: HardwareProfile, arch: ModelArch, tokens: float, keys_per_token: float, tp: int,
                  decode: bool = False, seq_len: float | None = None, cached: bool = False) -> LayerCost:
    """One layer's forward over `tokens` tokens on one of `tp` tensor-parallel GPUs.

    keys_per_token: keys each query attends to (L/2 on average for causal prefill of length L; the
    context length for a decode step). In decode, attention reads the KV cache of every key. seq_len:
    the length of each sequence of a prefill pass (what an eager attention's score matrix spans). cached: its
    GEMMs' operands are in the cache (gemm_time).
    """
    h, q, f = arch.hidden, arch.q_dim, arch.ffn
    v = hw.compute.value_bytes
    kv_local = kv_width(arch, tp)
    qkv_out = shard(q, tp) + 2 * kv_local
    up = arch.mlp_matrices - 1  # the MLP's input projections: gate and up (SwiGLU, one GEMM), up (GeLU)
    shapes = ((h, qkv_out), (shard(q, tp), h), (h, shard(up * f, tp)), (shard(f, tp), h))  # (k, n) of each GEMM
    gemm = sum(gemm_time(hw, tokens, k, n, cached) for k, n in shapes)
    attention = attention_time(hw, arch, tokens, keys_per_token, tp, decode, seq_len)
    rotated = arch.rotary_share * (shard(q, tp) + kv_local)
    elementwise = (
        arch.norms * memory_time(hw, v * 2 * tokens * h)  # the norms (two, one in a parallel block): read, write h
        + memory_time(hw, v * 2 * tokens * rotated)  # rotary on q and k (its share of them)
        + 2 * memory_time(hw, v * 3 * tokens * h)  # two residual adds (a parallel block sums three: two adds)
        + memory_time(hw, v * (up + 1) * tokens * shard(f, tp))  # silu(gate) * up, or gelu(up)
    )
    return LayerCost(gemm=gemm, attention=attention, elementwise=elementwise,
                     gemm_backward=sum(gemm_backward_time(hw, tokens, k, n) for k, n in shapes),
                     attention_backward=ATTENTION_BACKWARD[hw.compute.attention],
                     backward_only=bias_gradients_time(hw, arch, tokens, tp))


def head_forward(hw: HardwareProfile, arch: ModelArch, tokens: float, tp: int, head: str, cached: bool = False
                 ) -> LayerCost:
    """Final norm, output head and (for a language model) log-softmax in fp32 over the local vocabulary; `cached`
    as layer_forward's."""
    out = arch.head_out_dim(head)
    local_out = shard(out, tp) if head == "lm" else out
    gemm = gemm_time(hw, tokens, arch.hidden, local_out, cached)
    softmax = memory_time(hw, FP32 * 3 * tokens * local_out) if head == "lm" else 0.0
    norm = memory_time(hw, hw.compute.value_bytes * 2 * tokens * arch.hidden)
    return LayerCost(gemm=gemm, attention=0.0, elementwise=softmax + norm,
                     gemm_backward=gemm_backward_time(hw, tokens, arch.hidden, local_out))


def embedding_forward(hw: HardwareProfile, arch: ModelArch, tokens: float) -> LayerCost:
    nbytes = hw.compute.value_bytes * 2 * tokens * arch.hidden
    return LayerCost(gemm=0.0, attention=0.0, elementwise=memory_time(hw, nbytes), gemm_backward=0.0)
