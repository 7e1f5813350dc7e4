"""Hardware profiles: the rates the cost model runs on, shipped as YAML or written by `hfplan profile`.

One schema for datasheet profiles and measured ones. Every rate the simulator uses lives here;
nothing in the cost model is a hard-coded hardware constant.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from hfplan.errors import HfplanError, describe_validation_error, known_names
from hfplan.files import read_mapping

SHIPPED_DIR = Path(__file__).parent / "hardware"
GIB = 1024**3
# Bandwidths are in gigabytes (1e9 bytes) per second. Profiles written before the field said so call it
# `bandwidth_gbps`; that name is still read (and written back under the new one).
BANDWIDTH_NAMES = AliasChoices("bandwidth_gbytes_per_s", "bandwidth_gbps")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GemmTiling(_Strict):
    """How the device's GEMM kernels split work, for tile and wave quantization (NVIDIA, "Matrix Multiplication
    Background User's Guide": an (M x K)(K x N) product runs as ceil(M/tile_m) x ceil(N/tile_n) output tiles, one
    per SM at a time, in waves of sm_count tiles; each tile walks K in blocks of tile_k through a software pipeline
    of `stages` blocks (CUTLASS, "Efficient GEMM in CUDA"), stages - 1 of which fill the pipeline before the
    first multiply)."""

    sm_count: int = Field(gt=0, description="streaming multiprocessors: tiles that run at once")
    tiles: tuple[tuple[int, int], ...] = Field(min_length=1, description="(tile_m, tile_n) output tiles the GEMM "
                                                                         "library chooses among, per shape")
    tile_k: int = Field(gt=0, description="reduction-dimension block of one pipeline stage")
    stages: int = Field(ge=1, description="pipeline stages of the mainloop")
    split_k: bool = Field(default=False, description="the library may split K over several tiles per output "
                                                     "tile (split-K) to fill the SMs where the output has few "
                                                     "tiles (small M: decode); their fp32 partial sums meet in "
                                                     "memory. False: one tile per output tile")

    @field_validator("tiles")
    @classmethod
    def _positive_tiles(cls, tiles: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        if any(m <= 0 or n <= 0 for m, n in tiles):
            raise ValueError("tile sides must be positive")
        return tiles

    def __hash__(self) -> int:
        # Tilings key the GEMM efficiency cache: hash the plain field values, not through pydantic.
        return hash((self.sm_count, self.tiles, self.tile_k, self.stages, self.split_k))


def _rising_points(points: Sequence[tuple[float, float]], point: str, firsts: str) -> None:
    """A table of points must have one at least, its first values positive and increasing."""
    if not points:
        raise ValueError(f"give at least one {point} point, or leave it unset")
    xs = [x for x, _ in points]
    if any(x <= 0 for x in xs) or xs != sorted(set(xs)):
        raise ValueError(f"{firsts} must be positive and increasing")


def _fraction_points(points: tuple[tuple[int, float], ...] | None, x: str, xs: str, of: str
                     ) -> tuple[tuple[int, float], ...] | None:
    """A table of (x, fraction of `of`) points: x positive and increasing, each fraction in (0, 1]."""
    if points is None:
        return None
    _rising_points(points, f"({x}, fraction of {of})", xs)
    if any(not 0 < fraction <= 1 for _, fraction in points):
        raise ValueError(f"fractions of {of} must be in (0, 1]")
    return points


def rows_by_weight(table: tuple[tuple[int, int, float], ...]) -> tuple[tuple[int, tuple[tuple[int, float], ...]], ...]:
    """Compute.row_efficiency as (weight bytes, its (rows, fraction) points), weight sizes increasing."""
    weights = sorted({weight for _, weight, _ in table})
    return tuple((weight, tuple((m, fraction) for m, w, fraction in table if w == weight)) for weight in weights)


class MeasuredAttention(_Strict):
    """An attention kernel timed on CPU processes (torch's scaled_dot_product_attention, called as the executor calls
    it): a call's fixed cost, each (sequence, query head) pair's, each score's (a query against a key: its softmax's
    exponential and running maximum, whatever the head's width) and the rate of its products. Small per-pair work
    runs far below the matmul rate there: each pair is its own few-row products, with its own set-up."""

    call_us: float = Field(ge=0, description="fixed cost of one call, microseconds")
    pair_us: float = Field(ge=0, description="fixed cost of each (sequence, query head) pair of a call, microseconds")
    score_ns: float = Field(ge=0, description="cost of each score (query x key x query head) beyond its products, "
                                              "nanoseconds")
    tflops: float = Field(gt=0, description="rate of its products (4 x queries x keys attended x query width "
                                            "FLOPs), TFLOP/s")


class Compute(_Strict):
    peak_tflops: float = Field(gt=0, description="dense matmul peak per device, bf16 (fp32 on CPU)")
    matmul_efficiency: float = Field(gt=0, le=1, description="fraction of peak reached by large matmuls (with "
                                                              "`gemm`: by one without tile, wave or short-K loss)")
    kernel_overhead_us: float = Field(ge=0, description="fixed cost of one kernel (launch, tail effects)")
    value_bytes: int = Field(default=2, description="bytes of one weight or activation value in the precision "
                                                    "the device computes in: 2 (bf16) on GPUs, 4 (fp32) on CPUs")
    gradient_reduce_bytes: Literal[2, 4] = Field(
        default=4, description="bytes of one gradient value as data-parallel ranks reduce it: 4 (fp32, as the "
                               "executor's FSDP2 reduces, MixedPrecisionPolicy reduce_dtype float32) or 2 (bf16: "
                               "torch's FSDP1 with a bf16 param_dtype and reduce_dtype unset reduces in param_dtype)")
    fsdp_engine: Literal["fsdp2", "fsdp1"] = Field(
        default="fsdp2", description="the FSDP implementation of a fully sharded (full, hybrid) step, for the "
                                     "memory passes it makes besides its collectives (sharding.fsdp1_passes): "
                                     "fsdp2 (the executor's fully_shard; none priced) or fsdp1 (torch's "
                                     "FullyShardedDataParallel over flat parameters: each micro-batch copies its "
                                     "units' gradients into one flat gradient on the compute stream, and casts, "
                                     "divides and accumulates on its side streams)")
    optimizer: Literal["fused", "unfused"] = Field(
        default="fused", description="how the stack steps AdamW: fused (torch's fused=True, one pass over each fp32 "
                                     "parameter, its gradient and both moments: 28 bytes a parameter; the "
                                     "executor's training engine) or unfused (one kernel per line of the update: "
                                     "torch's default foreach path, composer's DecoupledAdamW; 80 bytes)")
    attention: Literal["flash", "eager"] = Field(default="flash", description="attention kernel of the stack: "
                                                                               "flash (fused, scores stay on chip) "
                                                                               "or eager (scores through memory)")
    gemm: GemmTiling | None = Field(default=None, description="tile and wave quantization of GEMMs; none (CPUs): "
                                                              "every GEMM runs at matmul_efficiency")
    row_efficiency: tuple[tuple[int, int, float], ...] | None = Field(
        default=None, description="GEMMs without a tiling model (`gemm` none: CPUs): the fraction of the matmul rate "
                                  "(matmul_efficiency) an (m x k)(k x n) product reaches by its rows m and the bytes "
                                  "of its k x n operand (the weight), as (m, weight bytes, fraction) points, measured "
                                  "by `hfplan profile` as nn.Linear runs the product (the weight stored n x k, read "
                                  "transposed): a CPU BLAS packs the weight matrix and runs register tiles of several "
                                  "rows per call, so a product of a few rows, a decode step's, runs below the rate "
                                  "(the profiler ends each weight size's rows at 1). Between two row counts of "
                                  "a weight size the fraction is interpolated in log(m), between two weight sizes in "
                                  "log(bytes); beyond either end it is the end's. None: every GEMM runs at the "
                                  "matmul rate")
    backward_row_efficiency: tuple[tuple[int, int, float], ...] | None = Field(
        default=None, description="the backward of such a product as nn.Linear's runs it (`gemm` none: CPUs): its "
                                  "input gradient (m x n)(n x k) and its weight gradient (n x m)(m x k), their "
                                  "4mkn FLOPs together, as a fraction of the matmul rate by the rows m and the "
                                  "weight's bytes: (m, weight bytes, fraction) points, measured by `hfplan profile` "
                                  "and read as row_efficiency is (a weight gradient sums over the m rows, so few of "
                                  "them leave a CPU BLAS's kernel as short as few output rows do). None: each of "
                                  "the two GEMMs at the fraction its own shape gets")
    cache_bytes: int | None = Field(
        default=None, gt=0, description="bytes of the last-level cache one process keeps its working set in (CPUs: "
                                        "the cache over the cores that share it); a generation engine whose weights "
                                        "and KV cache fit reads them there each step (cached_row_efficiency), and a "
                                        "decode call's keys and values that fit stay there (measured_attention). "
                                        "None: every GEMM streams its operands from memory, and a measured attention "
                                        "kernel keeps the rate it was timed at")
    cached_row_efficiency: tuple[tuple[int, int, float], ...] | None = Field(
        default=None, description="the same points for products whose operands are already in the cache (the "
                                  "same operands every call, as `hfplan profile` times them), each a fraction of "
                                  "peak (the best measured matmul), not of the matmul rate: such products reach it. "
                                  "Read as row_efficiency is, with no memory term (the operands do not cross the "
                                  "memory bus), where a generation step's working set fits cache_bytes. None: "
                                  "row_efficiency")
    attention_rate: tuple[tuple[int, float], ...] | None = Field(
        default=None, description="the flash attention kernel's measured rate, forward and backward together, of a "
                                  "causal pass: (sequence length, fraction of peak) points, lengths increasing; "
                                  "between two points the fraction is interpolated in log(length), beyond the ends "
                                  "it is the end's. None: attention runs at the matmul rate (matmul_efficiency)")
    measured_attention: dict[Literal["decode", "forward"], MeasuredAttention] | None = Field(
        default=None, description="CPU processes: the attention kernel as `hfplan profile` timed it, by kind of call: "
                                  "`decode` (one query a sequence against its KV cache, a generation step's), "
                                  "`forward` (a causal pass over whole sequences under a boolean mask: a prefill's, "
                                  "a padded log-prob or training forward's; an unpadded one runs is_causal, no "
                                  "slower); each priced as MeasuredAttention in place of attention_rate, attention "
                                  "and decode_attention, the backward at ATTENTION_BACKWARD times it, a decode call "
                                  "whose keys and values exceed cache_bytes no faster than each pair's read of them. "
                                  "None: attention_rate")
    decode_attention: Literal["grouped", "per_query_head"] = Field(
        default="grouped", description="how the stack's decode attention kernel treats the query heads that share "
                                       "a KV head (grouped-query attention): grouped (one pass over each KV head's "
                                       "cache for all of them, as FlashAttention's decode kernels pack them) or "
                                       "per_query_head (one thread block per query head, computing in fp32 on the "
                                       "CUDA cores, each reading its KV head's cache through L2: TensorRT-LLM's "
                                       "masked multi-head attention before its XQA kernel, vLLM's paged attention "
                                       "v1/v2 kernels)")
    matrix_vector: Literal["tiled", "reduction"] = Field(
        default="tiled", description="how the stack runs a product of one row by a weight matrix (a batch-1 decode "
                                     "step's GEMMs): tiled (its GEMM library's tensor-core tiles, `gemm`, padded to "
                                     "the tile's rows) or reduction (an elementwise product summed over K on the "
                                     "CUDA cores in fp32, as torch.compile decomposes a one-row mm under "
                                     "coordinate-descent tuning, which gpt-fast sets): the weights' read at the "
                                     "memory bandwidth, or the math at vector_tflops where that is slower")
    vector_tflops: float | None = Field(
        default=None, gt=0, description="fp32 peak of the CUDA cores (not the tensor cores), TFLOP/s: the rate of a "
                                        "per_query_head decode attention's math and of a reduction matrix_vector "
                                        "product's; None: not limited by it")
    overlap_slowdown: float = Field(
        default=0.0, ge=0, description="how much slower compute kernels run while a collective runs beside them "
                                       "(its kernels hold SMs and memory bandwidth), as a fraction: 0.2 = 20% "
                                       "slower. What overlapping a collective with compute leaves exposed "
                                       "(sharding.exposed_beside); 0: a collective shorter than the compute beside "
                                       "it is free")
    overlaps_collectives: bool = Field(
        default=True, description="whether the training engine's data-parallel collectives run beside its compute: "
                                  "on GPUs FSDP2 issues its all-gathers and reduce-scatters on streams of their "
                                  "own. false: each runs in line, the compute waiting for it (CPU processes: "
                                  "torch has no streams there, so FSDP2 waits on every gather, reduce-scatter and "
                                  "replica all-reduce before going on; torch/distributed/fsdp/_fully_shard, "
                                  "FSDPCommContext.get_all_gather_streams and foreach_reduce): every collective of "
                                  "a step is exposed (sharding.exposed_beside)")
    host_parallelism: float | None = Field(
        default=None, gt=0, description="CPU processes: how many ranks of one host compute at full speed at once, "
                                        "measured by `hfplan profile` (a decode step timed on one process while the "
                                        "others wait, and on every process of the world at once: world x alone / "
                                        "together). A call whose set has k ranks on a node computes "
                                        "max(1, k / host_parallelism) times slower (host_slowdown). None: every "
                                        "device computes on its own (GPUs)")
    idle_wake: tuple[tuple[float, float], ...] | None = Field(
        default=None, description="CPU processes: how much longer a call runs when its process waited idle before "
                                  "it, as (idle ms, extra us) points, idle increasing, measured by `hfplan profile` "
                                  "(the rollout engine's generation of one prompt timed back to back and after each "
                                  "idle wait: a core that idled or ran other work meanwhile comes back slow, its "
                                  "caches and the VM's virtual CPU cold). Between points the extra is interpolated "
                                  "linearly, from none at no idle; beyond the last point it is the last's "
                                  "(wake_seconds). None: not measured, no such cost (GPUs)")

    def host_slowdown(self, ranks: float) -> float:
        """How much slower each of `ranks` ranks of one host computes while all of them do (1: not shared); `ranks`
        may be an average (a pipeline's stages take turns: costs.pipeline_busy)."""
        if self.host_parallelism is None:
            return 1.0
        return max(1.0, ranks / self.host_parallelism)

    def wake_seconds(self, idle_s: float) -> float:
        """Seconds a call runs longer after its process idled `idle_s` seconds (idle_wake; 0 without it)."""
        if self.idle_wake is None or idle_s <= 0:
            return 0.0
        idles, extras = zip((0.0, 0.0), *self.idle_wake, strict=True)
        return float(np.interp(idle_s * 1e3, idles, extras)) * 1e-6  # the last point's beyond it

    @field_validator("idle_wake")
    @classmethod
    def _rising_idle(cls, points: tuple[tuple[float, float], ...] | None) -> tuple[tuple[float, float], ...] | None:
        if points is None:
            return None
        _rising_points(points, "(idle ms, extra us)", "idle times")
        if any(extra < 0 for _, extra in points):
            raise ValueError("extra microseconds must not be negative")
        return points

    @field_validator("row_efficiency", "backward_row_efficiency", "cached_row_efficiency")
    @classmethod
    def _rising_rows(cls, points: tuple[tuple[int, int, float], ...] | None
                     ) -> tuple[tuple[int, int, float], ...] | None:
        if points is None:
            return None
        if not points:
            raise ValueError("a table of (rows, weight bytes, fraction of the matmul rate) needs at least one point")
        if any(weight <= 0 for _, weight, _ in points):
            raise ValueError("weight bytes must be positive")
        for weight, rows in rows_by_weight(points):
            _fraction_points(rows, "rows", f"row counts of one weight size ({weight} bytes)", "the matmul rate")
        return points

    @field_validator("measured_attention")
    @classmethod
    def _both_kinds(cls, kernels: dict[str, MeasuredAttention] | None) -> dict[str, MeasuredAttention] | None:
        if kernels is not None and set(kernels) != {"decode", "forward"}:
            raise ValueError("needs both kinds of call, decode and forward")
        return kernels

    @field_validator("attention_rate")
    @classmethod
    def _rising_lengths(cls, points: tuple[tuple[int, float], ...] | None) -> tuple[tuple[int, float], ...] | None:
        return _fraction_points(points, "sequence length", "sequence lengths", "peak")

    @field_validator("value_bytes")
    @classmethod
    def _known_precision(cls, value: int) -> int:
        if value not in (2, 4):
            raise ValueError("must be 2 (bf16) or 4 (fp32)")
        return value


class Memory(_Strict):
    capacity_gib: float = Field(gt=0, description="device memory")
    reserved_gib: float = Field(ge=0, description="not usable by tensors: runtime context, comm buffers, "
                                                  "allocator fragmentation")
    bandwidth_gbytes_per_s: float = Field(gt=0, validation_alias=BANDWIDTH_NAMES,
                                          description="peak device-memory bandwidth, GB/s")
    efficiency: float = Field(gt=0, le=1, description="fraction of peak bandwidth reached by streaming kernels")
    l2_gbytes_per_s: float | None = Field(
        default=None, gt=0, description="L2-cache read bandwidth a kernel reaches, GB/s: what a "
                                        "per_query_head decode attention's repeated reads of a KV head's cache run "
                                        "at; None: not limited by it")
    worker_resident_gib: float = Field(default=0.0, ge=0, description="resident memory of one executor worker "
                                       "process before it builds a model (the interpreter, torch, transformers, "
                                       "Ray's worker; Ray's object store left out): on a CPU profile, part of what "
                                       "a run's measured peak shows")

    @property
    def usable_bytes(self) -> float:
        return (self.capacity_gib - self.reserved_gib) * GIB


class Protocol(_Strict):
    """One of the ways a collective library moves a ring's data (NCCL's LL, LL128, Simple): a fixed latency per
    collective, one per ring step, and a share of the link's bus bandwidth (the rest carries the protocol's flags).
    The library runs each collective in whichever its own model finds fastest. Listed on the intra-node link: rings
    in a node; on the inter-node link: rings spanning nodes, whose steps across the network cost `hop_us` and whose
    steps in a node at least `overhead_us`."""

    name: str = Field(min_length=1)
    base_us: float = Field(ge=0, description="latency of one collective, whatever its ring's length")
    hop_us: float = Field(ge=0, description="latency of each step of the ring (over this link)")
    bandwidth_fraction: float = Field(gt=0, le=1, description="share of the link's bus bandwidth the data gets")
    max_gbytes_per_s: float | None = Field(default=None, gt=0, description="cap on that bandwidth, GB/s; None: "
                                                                          "none")
    alone_hop_us: float | None = Field(
        default=None, ge=0, description="inter-node: hop_us where the group has one rank per node (nothing in the "
                                        "node hides the network's latency); None: hop_us")
    overhead_us: float = Field(default=0.0, ge=0, description="inter-node: the least latency of a step inside a "
                                                              "node of a ring spanning nodes (the host's work "
                                                              "launching each step's network transfers)")


class TreeProtocol(_Strict):
    """One protocol of a collective library's tree all-reduce across nodes (NCCL's tree: each node's ranks chained
    over NVLink, the nodes in a binary tree over the network; reduced up the tree and broadcast down it)."""

    name: str = Field(min_length=1)
    base_us: float = Field(ge=0, description="latency of one all-reduce, whatever the tree's size")
    intra_hop_us: float = Field(ge=0, description="latency of each step along a node's chain")
    hop_us: float = Field(ge=0, description="latency of each level of the tree across the network")
    bandwidth_fraction: float = Field(gt=0, le=1, description="share of the ring's bus bandwidth the tree's "
                                                              "data gets (its protocol's flags, the tree's own "
                                                              "losses)")


class MeasuredCollective(_Strict):
    """One collective's own alpha-beta, as the library runs it over a link: time = steps x latency + the bytes
    each rank sends / bandwidth, with the ring's steps and bytes (collectives.collective_terms). Measured where a
    library's collectives do not follow its point-to-point transfers (gloo on a CPU host: its all-reduce and
    reduce-scatter pay about a millisecond however small, and every collective moves its data at a fraction of
    the point-to-point bandwidth)."""

    op: Literal["all_reduce", "all_gather", "reduce_scatter"]
    latency_us: float = Field(ge=0, description="per-step latency (alpha)")
    bandwidth_gbytes_per_s: float = Field(gt=0, description="bytes each rank sends, per second (GB/s)")


class Link(_Strict):
    """Alpha-beta model of one link class: a collective step costs latency + bytes / bandwidth (or, for rings in a
    node over a link that lists `protocols`, the fastest protocol's cost)."""

    bandwidth_gbytes_per_s: float = Field(gt=0, validation_alias=BANDWIDTH_NAMES,
                                          description="GB/s (not Gb/s) one device can drive (intra) or one node's "
                                                      "NICs together (inter): 200 Gb/s is 25")
    efficiency: float = Field(gt=0, le=1, description="fraction of bandwidth collectives reach (bus bandwidth)")
    latency_us: float = Field(ge=0, description="per-step latency (alpha)")
    nvls: bool = Field(default=False, description="the switch reduces (NVLink SHARP): all-reduce sends each "
                                                  "device's data once and receives the result once")
    nvls_efficiency: float | None = Field(
        default=None, gt=0, le=1, description="fraction of the link's bandwidth an NVLS all-reduce reaches (the "
                                              "switch's reduction and multicast pace it, not the ring's copies); "
                                              "None: `efficiency`")
    nvls_latency_us: float | None = Field(
        default=None, ge=0, description="latency of one NVLS all-reduce; None: two steps of latency_us")
    protocols: tuple[Protocol, ...] = Field(
        default=(), description="the collective library's protocols (Protocol) for rings over this link: in a node "
                                "(intra_node) or spanning nodes (inter_node), the fastest taken for each "
                                "collective; empty: every step costs latency_us, at the full bus bandwidth")
    tree: tuple[TreeProtocol, ...] = Field(
        default=(), description="inter_node only: the collective library's tree all-reduce across nodes, per "
                                "protocol (TreeProtocol); an all-reduce spanning nodes runs the fastest of these and "
                                "the ring's; empty: the ring alone")
    collectives: tuple[MeasuredCollective, ...] = Field(
        default=(), description="intra_node only: collectives measured on their own (MeasuredCollective), each "
                                "priced by its own fit in a node instead of the link's; `hfplan profile` writes them "
                                "on CPU hosts (gloo); empty: every collective by the link's alpha-beta or protocols")

    def measured(self, op: str) -> MeasuredCollective | None:
        """The collective's own fit on this link, if it has one."""
        return next((c for c in self.collectives if c.op == op), None)

    @property
    def nvls_bytes_per_s(self) -> float:
        """Bytes/s one device sends to (and receives from) the switch in an NVLS all-reduce."""
        fraction = self.efficiency if self.nvls_efficiency is None else self.nvls_efficiency
        return self.bandwidth_gbytes_per_s * 1e9 * fraction

    @property
    def effective_bytes_per_s(self) -> float:
        return self.bandwidth_gbytes_per_s * 1e9 * self.efficiency


class Links(_Strict):
    intra_node: Link
    inter_node: Link
    host: Link = Field(description="device <-> host (PCIe); data through the single controller")
    object_store: Link | None = Field(
        default=None, description="tensors handed from one of hfplan's executor workers to another through Ray's "
                                  "object store, as a separate rollout set's weights go (packed, stored, read, "
                                  "copied into place; on a GPU also through the host link both ways): measured by "
                                  "`hfplan profile` through Ray between two workers (its latency is that probe's; "
                                  "a weight sync's fixed cost is Runtime.weight_sync_us); None: a point-to-point "
                                  "send over the node's link")


class Runtime(_Strict):
    """Fixed host-side costs the kernels do not show: the software stack's, not the chip's. Zero where not
    known; `hfplan profile` measures them on the executor's own engines."""

    forward_pass_us: float = Field(default=0.0, ge=0, description="fixed cost of one forward pass (one micro-batch "
                                                                  "through a training or inference engine) beyond "
                                                                  "its kernels and its layers' (layer_forward_us)")
    engine_step_us: float = Field(default=0.0, ge=0, description="fixed cost of one step of the generation engine "
                                                                 "(a prefill or a decode step): scheduling, input "
                                                                 "preparation, sampled tokens back to the host; "
                                                                 "beyond its layers' (layer_step_us)")
    layer_forward_us: float = Field(
        default=0.0, ge=0, description="fixed cost per decoder layer of a forward micro-batch beyond the layer's "
                                       "kernels (a CPU's dispatch of the layer's torch ops, the host's share where "
                                       "it does not run ahead of the device): each layer a pass runs pays it, on top "
                                       "of forward_pass_us")
    layer_train_us: float = Field(
        default=0.0, ge=0, description="the same per decoder layer of a training micro-batch (its forward and "
                                       "backward), on top of train_pass_us")
    layer_step_us: float = Field(
        default=0.0, ge=0, description="the same per decoder layer of a generation engine's step (a prefill or a "
                                       "decode step), on top of engine_step_us")
    controller_call_us: float = Field(default=0.0, ge=0, description="fixed cost of one round trip of the "
                                                                     "single controller to a worker group: a call "
                                                                     "sent, and its result waited for")
    call_dispatch_us: float | None = Field(
        default=None, ge=0, description="fixed cost on a worker of one call of the controller while calls queue "
                                        "for it (the call started, its arguments read, its outputs stored), paid "
                                        "by every role call; None: controller_call_us, as for a profile written "
                                        "before the field")
    task_dispatch_us: float | None = Field(
        default=None, ge=0, description="fixed cost on a worker of a call that opens a Ray task there after its "
                                        "last task ended (Ray's switch between the tasks, this one's start, its "
                                        "arguments read): a generation, and the first call the controller sends "
                                        "a set after something waited; None: call_dispatch_us, as for a profile "
                                        "written before the field")
    rank_dispatch_us: float = Field(
        default=0.0, ge=0, description="how much later each rank past the first of a set starts a task the "
                                       "controller sends to every rank (one Ray task per rank, each reaching its "
                                       "worker after the one before), which the task's first call's end waits "
                                       "for: its last rank ends that much later; measured with two ranks, charged "
                                       "per rank past the first to each call that opens a task")
    controller_step_us: float = Field(default=0.0, ge=0, description="fixed cost of one step the controller "
                                                                     "runs itself (advantages, a rule reward)")
    controller_send_us: float | None = Field(
        default=None, ge=0, description="the sending side of controller_call_us: from the end of a controller "
                                        "step to the start of the call it feeds on an idle worker (the call sent, "
                                        "Ray's start of it, its arguments read); the rest of the round trip is a "
                                        "result's way into the controller. None: task_dispatch_us (call_dispatch_us "
                                        "where that is unset), as for a profile written before the field")
    controller_task_cpu_us: float = Field(
        default=0.0, ge=0, description="CPU the controller's process spends per Ray task it sends a worker rank, "
                                       "beyond its own steps and rules (the task submitted, its results read, the "
                                       "iteration's report): on a profile whose processes share a host's cores "
                                       "(compute.host_parallelism) the controller computes that beside the head "
                                       "host's workers; 0: not measured, nothing shared")
    weight_sync_us: float | None = Field(
        default=None, ge=0, description="fixed cost of one weight sync to a separate rollout set beyond its "
                                        "engines' cost per tensor and its bytes' transfer: the actor ranks' "
                                        "buckets stored in Ray's object store and their readiness reported to the "
                                        "controller, the rollout ranks' loads sent by it, their arguments fetched; "
                                        "None: controller_call_us (one round trip), as for a profile written "
                                        "before the field")
    engine_step_continuous_us: float | None = Field(
        default=None, ge=0, description="fixed cost of one step of a continuous-batching engine (its slot "
                                        "bookkeeping each step on top of the static step's work); None: "
                                        "engine_step_us, as for a profile written before the field")

    engine_sequence_step_us: float = Field(default=0.0, ge=0, description="fixed cost per sequence of one step "
                                           "of the generation engine, on top of engine_step_us (sampling its "
                                           "token, the cache's bookkeeping for it)")

    engine_wide_sequences: int | None = Field(
        default=None, ge=1, description="sequences in a step beyond which each more costs "
                                        "engine_wide_sequence_step_us instead of engine_sequence_step_us (the "
                                        "batch the profiler measured that slope from); None: one slope throughout")
    engine_wide_sequence_step_us: float | None = Field(
        default=None, ge=0, description="fixed cost per sequence of one step beyond engine_wide_sequences (measured "
                                        "between that batch and one four times as large: the per-row host work "
                                        "grows more slowly in a wide batch than from one sequence)")
    generate_call_us: float = Field(default=0.0, ge=0, description="fixed cost of one generation (a static "
                                    "wave, or a continuous engine's run) beyond its prefill and decode steps: "
                                    "its rotary tables, KV cache and masks set up, the token its last step "
                                    "leaves sampled, its responses assembled")

    forward_token_us: float = Field(default=0.0, ge=0, description="fixed cost per token of a forward pass "
                                    "beyond its kernels, whichever engine runs it (the host's share of the small "
                                    "operators the kernels leave out: norms, rotary, activations, short "
                                    "attention)")
    train_token_us: float = Field(default=0.0, ge=0, description="the same per token of a training micro-batch "
                                                                 "(forward and backward)")
    switch_tensor_us: float = Field(default=0.0, ge=0, description="fixed cost per parameter tensor of one "
                                    "switch of the hybrid engine into generation and back (the rollout engine "
                                    "given the weights and released), beyond the weights it moves")
    fsdp_switch_tensor_us: float | None = Field(
        default=None, ge=0, description="switch_tensor_us of a role that generates in its training layout while it "
                                        "trains through FSDP2 (its weights unsharded by the training engine and "
                                        "resharded after), beyond the modelled all-gather; None: switch_tensor_us")
    tp_switch_tensor_us: float = Field(default=0.0, ge=0, description="the same on top, of a role split by tensor "
                                       "parallelism that generates in its training layout")
    reshard_tensor_us: float = Field(
        default=0.0, ge=0, description="fixed cost per parameter tensor of a switch whose generation shards are built "
                                       "by the per-tensor resharding plan (a generation tp other than the training "
                                       "one, or pipelined training: each tensor's slices cut, sent and received, "
                                       "its shard assembled), beyond the modelled all-gather, on top of "
                                       "switch_tensor_us; measured with the engine in pipeline stages")
    kept_switch_us: float | None = Field(
        default=None, ge=0, description="one whole switch into generation and back of a hybrid actor that generates "
                                        "with the very tensors it trains (layout.keeps_trained_tensors: its training "
                                        "layout, one data-parallel rank, no FSDP2, tp 1: nothing is gathered or "
                                        "handed over); None: switch_tensor_us per tensor, as any other switch")

    train_pass_us: float | None = Field(
        default=None, ge=0, description="fixed cost of one micro-batch through a training engine (forward and "
                                        "backward, with the engine's hooks) beyond its kernels; None: "
                                        "forward_pass_us, as for a profile written before the field")
    optimizer_tensor_us: float = Field(default=0.0, ge=0, description="fixed cost of one optimizer step per "
                                                                      "parameter tensor a GPU holds (gradients "
                                                                      "zeroed and clipped, the optimizer's "
                                                                      "update), beyond its memory traffic")

    fsdp_forward_pass_us: float | None = Field(
        default=None, ge=0, description="fixed cost of one forward pass of a trained role through its training "
                                        "engine wrapped in FSDP2 (layout.trains_through_fsdp: its hooks, the "
                                        "parameters as DTensors) beyond its kernels and collectives; None: "
                                        "forward_pass_us")
    fsdp_train_pass_us: float | None = Field(
        default=None, ge=0, description="train_pass_us for the engine wrapped in FSDP2; None: train_pass_us")
    fsdp_optimizer_tensor_us: float | None = Field(
        default=None, ge=0, description="optimizer_tensor_us for the engine wrapped in FSDP2 (the update over "
                                        "DTensor shards); None: optimizer_tensor_us")

    tp_forward_pass_us: float = Field(default=0.0, ge=0, description="fixed cost of one forward pass of an "
                                      "engine split by tensor parallelism (DTensor dispatch, its collectives' "
                                      "host work) on top of the unsplit engine's")
    tp_train_pass_us: float = Field(default=0.0, ge=0, description="the same on top of a training micro-batch")
    tp_optimizer_tensor_us: float = Field(default=0.0, ge=0, description="the same on top of an optimizer step, "
                                          "per parameter tensor")
    fsdp_layer_forward_us: float = Field(
        default=0.0, ge=0, description="fixed cost per decoder layer of a forward micro-batch through a trained "
                                       "role's FSDP2-wrapped engine (each layer its own unit: its hooks, its "
                                       "parameters gathered and freed, DTensor dispatch) on top of "
                                       "layer_forward_us; measured across the profiled world at two depths")
    fsdp_layer_train_us: float = Field(default=0.0, ge=0, description="the same per decoder layer of a training "
                                       "micro-batch, on top of layer_train_us")
    tp_layer_forward_us: float = Field(
        default=0.0, ge=0, description="fixed cost per decoder layer of a forward micro-batch of an engine split by "
                                       "tensor parallelism (its split linears' DTensor dispatch, the host's work "
                                       "and the ranks' meeting at each of its collectives) on top of the unsplit "
                                       "engine's layer; measured across the profiled world at two depths")
    tp_layer_train_us: float = Field(default=0.0, ge=0, description="the same per decoder layer of a training "
                                     "micro-batch")
    pp_forward_pass_us: float = Field(
        default=0.0, ge=0, description="fixed cost of one micro-batch through one pipeline stage of a forward-only "
                                       "call (the pipeline schedule's actions, its point-to-point sends' and "
                                       "receives' host work, the outputs sent from the last stage to the others) "
                                       "on top of the unsplit engine's pass; each micro-batch slot of the call (its "
                                       "micro-batches and the pipeline's fill and drain) pays it")
    pp_train_pass_us: float = Field(default=0.0, ge=0, description="the same of a training micro-batch (forward and "
                                                                   "backward) through one pipeline stage")
    tp_step_collective_us: float = Field(
        default=0.0, ge=0, description="fixed cost of each tensor-parallel collective of a step of the generation "
                                       "engine (prefill or decode) beyond the link's modelled latency and "
                                       "bandwidth: the ranks meeting between the step's kernels, each waiting for "
                                       "the slowest one's compute and for the host to run it; written by "
                                       "`hfplan profile` before step_collective_us replaced it, which it is not "
                                       "added to")

    step_collective_us: float | None = Field(
        default=None, ge=0, description="each tensor-parallel collective of a generation step (prefill or decode) "
                                        "over two ranks of a node, in place of the link's modelled latency (the "
                                        "link's term for its bytes kept; a larger or wider group adds the link's "
                                        "latency beyond that pair's): measured with every rank generating at "
                                        "once, the ranks meeting between the step's kernels as they do there; "
                                        "None: the link's latency, plus tp_step_collective_us, as for a profile "
                                        "written before the field")

    vllm_batched_tokens: int = Field(
        default=8192, ge=1, description="vLLM's max_num_batched_tokens on this device (its default for the offline "
                                        "LLM class): the tokens of the dummy forward vLLM profiles its activations "
                                        "with before it sizes its KV cache, so what it sets aside for them")

    def forward_pass_s(self, fsdp: bool = False, tp: bool = False, pp: bool = False) -> float:
        """Seconds of fixed cost per forward micro-batch (of one pipeline stage); `fsdp`: through a trained role's
        FSDP2-wrapped engine; `tp`: the model split by tensor parallelism; `pp`: a stage of a pipeline."""
        base = self.fsdp_forward_pass_us if fsdp and self.fsdp_forward_pass_us is not None else self.forward_pass_us
        return (base + (self.tp_forward_pass_us if tp else 0.0) + (self.pp_forward_pass_us if pp else 0.0)) * 1e-6

    def train_pass_s(self, fsdp: bool = False, tp: bool = False, pp: bool = False) -> float:
        """Seconds of fixed cost per training micro-batch (of one pipeline stage); `fsdp`: through the
        FSDP2-wrapped engine; `tp`: split by tensor parallelism; `pp`: a stage of a pipeline."""
        if fsdp and self.fsdp_train_pass_us is not None:
            base = self.fsdp_train_pass_us
        else:
            base = self.forward_pass_us if self.train_pass_us is None else self.train_pass_us
        return (base + (self.tp_train_pass_us if tp else 0.0) + (self.pp_train_pass_us if pp else 0.0)) * 1e-6

    def layer_forward_s(self, fsdp: bool = False, tp: bool = False) -> float:
        """Seconds of fixed cost per decoder layer of a forward micro-batch; `fsdp`, `tp` as forward_pass_s."""
        return (self.layer_forward_us + (self.fsdp_layer_forward_us if fsdp else 0.0)
                + (self.tp_layer_forward_us if tp else 0.0)) * 1e-6

    def layer_train_s(self, fsdp: bool = False, tp: bool = False) -> float:
        """Seconds of fixed cost per decoder layer of a training micro-batch; `fsdp`, `tp` as train_pass_s."""
        return (self.layer_train_us + (self.fsdp_layer_train_us if fsdp else 0.0)
                + (self.tp_layer_train_us if tp else 0.0)) * 1e-6

    def optimizer_tensor_s(self, fsdp: bool = False, tp: bool = False) -> float:
        """Seconds of fixed cost of an optimizer step per parameter tensor; `fsdp`: over FSDP2's shards; `tp`:
        over tensor-parallel shards."""
        base = (self.fsdp_optimizer_tensor_us if fsdp and self.fsdp_optimizer_tensor_us is not None
                else self.optimizer_tensor_us)
        return (base + (self.tp_optimizer_tensor_us if tp else 0.0)) * 1e-6

    def switch_tensor_s(self, fsdp: bool = False, tp: bool = False, by_plan: bool = False) -> float:
        """Seconds of a hybrid switch's fixed cost per parameter tensor; `fsdp`, `tp`: a role generating in its
        training layout, trained through FSDP2, split by tensor parallelism (else the rollout engine's alone);
        `by_plan`: its generation shards built by the per-tensor resharding plan."""
        base = self.fsdp_switch_tensor_us if fsdp and self.fsdp_switch_tensor_us is not None else self.switch_tensor_us
        return (base + (self.tp_switch_tensor_us if tp else 0.0) + (self.reshard_tensor_us if by_plan else 0.0)) * 1e-6

    def tp_step_collective_s(self) -> float:
        """Seconds of fixed cost per tensor-parallel collective of a generation step (tp_step_collective_us)."""
        return self.tp_step_collective_us * 1e-6

    def call_dispatch_s(self) -> float:
        """Seconds a role call costs its worker beyond its work where it follows another call in the same Ray task
        (its arguments read, its outputs stored)."""
        return (self.controller_call_us if self.call_dispatch_us is None else self.call_dispatch_us) * 1e-6

    def task_dispatch_s(self, ranks: int = 1) -> float:
        """Seconds a role call on `ranks` ranks costs beyond its work where it opens a Ray task on each (Ray's
        switch from the worker's last task, this one's start, its arguments read), until its last rank has
        started: the ranks' tasks arrive one after another (rank_dispatch_us)."""
        base = self.call_dispatch_s() if self.task_dispatch_us is None else self.task_dispatch_us * 1e-6
        return base + (ranks - 1) * self.rank_dispatch_us * 1e-6

    def task_opening_s(self, ranks: int = 1) -> float:
        """What a call that opens a Ray task pays on top of a call within one (call_dispatch_s)."""
        return max(0.0, self.task_dispatch_s(ranks) - self.call_dispatch_s())

    def controller_send_s(self) -> float:
        """Seconds from a controller step's end to the start of the call it feeds on an idle worker."""
        return self.task_dispatch_s() if self.controller_send_us is None else self.controller_send_us * 1e-6

    def result_wait_s(self) -> float:
        """Seconds a worker's result takes to reach the controller beyond its transfer: the round trip less its
        sending side."""
        return max(0.0, self.controller_call_us * 1e-6 - self.controller_send_s())

    def send_wait_s(self) -> float:
        """Seconds a call fed by the controller waits for it beyond its own dispatch (charged with the call): the
        sending side less the dispatch of a call that opens a Ray task, as the first call the controller sends
        a set after one of its steps does."""
        return max(0.0, self.controller_send_s() - self.task_dispatch_s())

    def controller_task_cpu_s(self) -> float:
        """Seconds of the controller's CPU per Ray task it sends a worker rank (controller_task_cpu_us)."""
        return self.controller_task_cpu_us * 1e-6

    def weight_sync_s(self) -> float:
        """Seconds of a weight sync's fixed cost through Ray and the controller (weight_sync_us)."""
        return (self.controller_call_us if self.weight_sync_us is None else self.weight_sync_us) * 1e-6

    def controller_step_s(self) -> float:
        """Seconds of one step the controller runs itself (advantages, a rule reward)."""
        return self.controller_step_us * 1e-6

    def engine_step_s(self, batching: str, sequences: float = 0.0) -> float:
        """Seconds of fixed cost per step of an engine batching `batching` (GenConfig.batching) that runs
        `sequences` sequences in the step."""
        step = self.engine_step_us
        if batching == "continuous" and self.engine_step_continuous_us is not None:
            step = self.engine_step_continuous_us
        knee, wide = self.engine_wide_sequences, self.engine_wide_sequence_step_us
        if knee is None or wide is None or sequences <= knee:
            return (step + sequences * self.engine_sequence_step_us) * 1e-6
        return (step + knee * self.engine_sequence_step_us + (sequences - knee) * wide) * 1e-6


class HardwareProfile(_Strict):
    name: str
    description: str = ""
    measured: bool = False
    date: str | None = None
    backend: str = Field(default="nccl", pattern="^(nccl|gloo)$")
    gpus_per_node: int = Field(gt=0)
    compute: Compute
    memory: Memory
    links: Links
    runtime: Runtime = Field(default_factory=Runtime)

    @property
    def on_host(self) -> bool:
        """Whether its devices are the host's CPU cores (gloo), whose memory is the host's."""
        return self.backend == "gloo"

    def __hash__(self) -> int:
        # Profiles key the cost caches: a cheap hash of a few fields (equal profiles still hash equal).
        return hash((self.name, self.compute.peak_tflops, self.memory.bandwidth_gbytes_per_s))

    @property
    def peak_flops(self) -> float:
        return self.compute.peak_tflops * 1e12

    @property
    def matmul_flops(self) -> float:
        """The matmul rate: FLOP/s of a GEMM without tile, wave or few-row loss (peak x matmul_efficiency)."""
        return self.peak_flops * self.compute.matmul_efficiency

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def load_hardware(ref: str) -> HardwareProfile:
    """A shipped profile name (`a100-80g`) or the path of a profile YAML."""
    path = SHIPPED_DIR / f"{ref}.yaml"
    if not path.is_file():
        path = Path(ref)
        if not (ref.endswith((".yaml", ".yml")) or "/" in ref):
            raise HfplanError(f"unknown hardware {ref!r}; known hardware: {known_names(shipped_names())} "
                              "(or a profile .yaml path)")
        if not path.is_file():
            raise HfplanError(f"hardware profile not found: {path}")
    data = read_mapping(path, "hardware profile")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as bad:
        raise HfplanError(f"hardware profile {path}: {describe_validation_error(bad)}") from None
