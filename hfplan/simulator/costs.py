"""Seconds of each RLHF call on a set of GPUs: training step, inference, generation, resharding.

Ranks of a layout are numbered as hfplan.layout says (pipeline-major, then data-parallel, then
tensor-parallel fastest), so tensor-parallel groups are adjacent GPUs, data-parallel groups are strided
by tp, and pipeline stages are blocks of tp*dp GPUs. Every rate comes from the hardware profile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from hfplan.layout import (
    keeps_trained_tensors,
    micro_batch_sizes,
    most_generation_numel,
    most_received_numel,
    resharding,
    reshards_by_plan,
    stage_layers,
    stage_parameter_tensors,
    stage_params,
    trains_through_fsdp,
)
from hfplan.plan import GenConfig, InferConfig, Layout, Recompute, TrainConfig
from hfplan.profiles.hardware import HardwareProfile
from hfplan.profiles.models import ModelArch
from hfplan.simulator import collectives as coll
from hfplan.simulator import sharding
from hfplan.simulator.kernels import (
    FP32,
    LayerCost,
    embedding_forward,
    head_forward,
    kv_cache_write_time,
    layer_forward,
    memory_time,
)
from hfplan.simulator.memory import generation_step_bytes, kv_sequence
from hfplan.spec import ResponseLengths

# One optimizer step's memory traffic per parameter, bytes over the device's fp32 shard (parameters, gradients and
# both moments are fp32: FSDP2 keeps the sharded parameters in fp32 and casts at the all-gather), by how the stack
# runs AdamW (Compute.optimizer). fused: torch.optim.AdamW(fused=True), which the executor's training engine steps on
# CPU and CUDA (torch/optim/adamw.py, _fused_adamw, torch._fused_adamw_): one pass that reads each parameter, its
# gradient and both moments and writes the parameter and the moments.
FUSED_ADAMW_BYTES = 4 * 4 + 3 * 4
# unfused: one kernel per line of the update, each reading its operands and writing its result in full (torch's
# default foreach path, _multi_tensor_adamw; composer's DecoupledAdamW alike).
UNFUSED_ADAMW_PASS_BYTES = (
    4 + 4,  # params *= 1 - lr * weight_decay
    8 + 4,  # exp_avg.lerp_(grad, 1 - beta1)
    4 + 4,  # exp_avg_sq *= beta2
    8 + 4,  # exp_avg_sq.addcmul_(grad, grad, 1 - beta2): the gradient read once for both operands
    4 + 4,  # denom = sqrt(exp_avg_sq)
    4 + 4,  # denom /= sqrt(bias_correction2)
    4 + 4,  # denom += eps
    12 + 4,  # params.addcdiv_(exp_avg, denom, -step_size)
)
# Before it, the training engine clips the gradients: their norm reads them, the scaling by the clip coefficient
# reads and writes them.
CLIP_PASS_BYTES = (4, 4 + 4)
ADAMW_BYTES = {"fused": FUSED_ADAMW_BYTES, "unfused": sum(UNFUSED_ADAMW_PASS_BYTES)}


def optimizer_bytes_per_param(hw: HardwareProfile) -> int:
    """Bytes an optimizer step and its gradient clip move per fp32 parameter on the profile's stack."""
    return ADAMW_BYTES[hw.compute.optimizer] + sum(CLIP_PASS_BYTES)


# Vocabulary-parallel log-softmax reduces a max and a sum per token across tensor-parallel ranks.
LOGSOFTMAX_REDUCTIONS = 2
LAYER_ALL_REDUCES = 2  # a tensor-parallel layer pass sums its hidden state after attention and after the MLP


F = TypeVar("F", bound=Callable[..., Any])
_MISSING = object()  # no entry yet (None is a value)


class CostMemo:
    """Memo tables of the cost functions marked @memoized, owned by one search or one simulation and
    passed in (`memo=`): the same arguments always cost the same, so each is computed once per owner.
    Without a memo the functions compute directly.

    Keys hold the hardware profile and the architecture (every memoized function's first two arguments) by
    identity: hashing them field by field on every lookup cost more than many of the costs looked up. The
    memo keeps each one it has keyed, so its id is no other object's while the memo holds entries for it."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[tuple, Any]] = {}
        self._keyed: dict[int, object] = {}

    def clear(self) -> None:
        self.tables.clear()
        self._keyed.clear()


def memoized(fn: F) -> F:
    """fn(hw, arch, *args, memo=None, **kwargs): with a CostMemo, answer from (and fill) its table for fn."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(hw, arch, *args, memo: CostMemo | None = None, **kwargs):
        if memo is None:
            return fn(hw, arch, *args, memo=None, **kwargs)
        table = memo.tables.get(name)
        if table is None:
            table = memo.tables[name] = {}
        keyed = memo._keyed
        keyed.setdefault(id(hw), hw)
        keyed.setdefault(id(arch), arch)
        key = (id(hw), id(arch), *args, *sorted(kwargs.items())) if kwargs else (id(hw), id(arch), *args)
        value = table.get(key, _MISSING)
        if value is _MISSING:
            value = table[key] = fn(hw, arch, *args, memo=memo, **kwargs)
        return value

    return wrapper  # type: ignore[return-value]


class SetShape(NamedTuple):
    """The shape of one placement set: its GPU count, and how many of them share one node. A named tuple:
    every cost call makes one and every cost-table key hashes one."""

    gpus: int
    gpus_per_node: int

    @property
    def per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)


def tp_group(tp: int, where: SetShape) -> coll.Group:
    return coll.group_of(tp, 1, where.per_node)


def stages_share_node(layout: Layout, where: SetShape) -> bool:
    return layout.gpus <= where.per_node


class Parts(dict):
    """Seconds of one call by part, adding up to the call's seconds: kernel kinds (gemm, attention,
    elementwise), each collective (tp_comm, pp_comm, dp_comm), bubble, recompute, optimizer, runtime (fixed
    costs of passes and engine steps) and controller. Read-only by convention: memoized values are shared."""

    @property
    def total(self) -> float:
        return sum(self.values())

    def plus(self, other: dict[str, float], times: float = 1.0) -> Parts:
        out = Parts(self)
        get = out.get
        for name, seconds in other.items():
            out[name] = get(name, 0.0) + times * seconds
        return out

    def times(self, factor: float) -> Parts:
        return Parts({name: factor * seconds for name, seconds in self.items()})


# Parts that are not the rank's own computing: collectives and the controller's dispatch. On a shared host they
# were measured with the world's processes all running (hfplan.profiler.comm), so host_slowdown leaves them: a rank
# that waits in a collective leaves its core to another, and with more ranks than cores a gloo all-reduce after a
# burst of compute cost 0.3-1.5x what it did with one rank a core (bench/oversubscribed.py).
NOT_COMPUTED = frozenset({"tp_comm", "pp_comm", "dp_comm", "controller"})


def pipeline_busy(pp: int, n_micro: int, bubble_slots: float) -> float:
    """The fraction of a pipeline's stages computing at once, on average over a call of n_micro micro-batch slots
    per stage and bubble_slots idle ones: each stage is busy n_micro of n_micro + bubble_slots slots."""
    return 1.0 if pp == 1 else n_micro / (n_micro + bubble_slots)


def on_shared_host(hw: HardwareProfile, where: SetShape, parts: Parts, busy: float = 1.0) -> Parts:
    """`parts` of a call whose set's ranks on a node compute at once, `busy` of them on average (a pipeline's
    stages take turns): its kernels and fixed costs slowed by the host's sharing (Compute.host_slowdown: CPU
    processes share the host's cores; GPUs compute alone)."""
    slowdown = hw.compute.host_slowdown(busy * where.per_node)
    if slowdown == 1.0:
        return parts
    return Parts({name: seconds if name in NOT_COMPUTED else slowdown * seconds for name, seconds in parts.items()})


AllReduce = Callable[[HardwareProfile, coll.Group, float], float]


STEP_COLLECTIVE_GROUP = coll.group_of(2, 1, 2)  # Runtime.step_collective_us is measured on two ranks of a node


def step_all_reduce(hw: HardwareProfile, group: coll.Group, nbytes: float) -> float:
    """One tensor-parallel all-reduce of a generation step: the link's model, or where the profile measured a
    step's collectives whole (Runtime.step_collective_us, over STEP_COLLECTIVE_GROUP) that figure in place of the
    link's latency for that pair: the link's model shifted by the difference, never below its term for the bytes."""
    link = coll.all_reduce(hw, group, nbytes)
    measured = hw.runtime.step_collective_us
    if measured is None or group.size <= 1:
        return link
    latency = coll.all_reduce(hw, group, 1.0)
    return max(link - latency, link + measured * 1e-6 - coll.all_reduce(hw, STEP_COLLECTIVE_GROUP, 1.0))


def _layer_tp_comm(hw: HardwareProfile, arch: ModelArch, tokens: float, tp: int, where: SetShape,
                   reduce: AllReduce = coll.all_reduce) -> float:
    """LAYER_ALL_REDUCES all-reduces of the hidden state per layer pass."""
    if tp == 1:
        return 0.0
    return LAYER_ALL_REDUCES * reduce(hw, tp_group(tp, where), hw.compute.value_bytes * tokens * arch.hidden)


def step_tp_collectives(arch: ModelArch) -> int:
    """Tensor-parallel collectives of one generation step through every layer: LAYER_ALL_REDUCES a layer and the
    vocabulary's LOGSOFTMAX_REDUCTIONS (the torch rollout engine makes as many: two a layer, its embedding's
    lookups summed and its logits gathered)."""
    return LAYER_ALL_REDUCES * arch.layers + LOGSOFTMAX_REDUCTIONS


def _step_collectives_fixed(hw: HardwareProfile, arch: ModelArch, tp: int) -> float:
    """The fixed cost of a generation step's tensor-parallel collectives beyond their modelled transfers
    (Runtime.tp_step_collective_us, where no step_collective_us replaces the link's latency)."""
    if tp == 1 or hw.runtime.step_collective_us is not None:
        return 0.0
    return step_tp_collectives(arch) * hw.runtime.tp_step_collective_s()


def _head_tp_comm(hw: HardwareProfile, tokens: float, tp: int, where: SetShape, head: str,
                  reduce: AllReduce = coll.all_reduce) -> float:
    if tp == 1 or head != "lm":
        return 0.0
    return LOGSOFTMAX_REDUCTIONS * reduce(hw, tp_group(tp, where), FP32 * tokens)


@memoized
def _layer_forward(hw: HardwareProfile, arch: ModelArch, tokens: float, keys_per_token: float, tp: int,
                   decode: bool = False, seq_len: float | None = None, cached: bool = False, *,
                   memo: CostMemo | None = None) -> LayerCost:
    """kernels.layer_forward, memoized: it depends on neither the pipeline, the set nor the engine, so the
    training, inference, prefill and decode costs of a search share far fewer layer shapes than calls."""
    return layer_forward(hw, arch, tokens, keys_per_token, tp, decode, seq_len, cached)


@memoized
def _head_forward(hw: HardwareProfile, arch: ModelArch, tokens: float, tp: int, head: str, cached: bool = False, *,
                  memo: CostMemo | None = None) -> LayerCost:
    """kernels.head_forward, memoized as _layer_forward is."""
    return head_forward(hw, arch, tokens, tp, head, cached)


def step_operands_cached(hw: HardwareProfile, arch: ModelArch, cfg: Layout, batch: float, context: float) -> bool:
    """Whether a generation step's GEMMs find their operands in the cache (kernels.gemm_time's `cached`): the
    profile measured such products and the step's weights and KV cache (memory.generation_step_bytes) fit the cache
    a process keeps between steps (Compute.cache_bytes)."""
    compute = hw.compute
    return (compute.cached_row_efficiency is not None and compute.cache_bytes is not None
            and generation_step_bytes(arch, cfg, batch, context, compute.value_bytes) <= compute.cache_bytes)


@dataclass(frozen=True)
class StagePass:
    """One micro-batch through the most loaded pipeline stage, by part (both passes have the same parts);
    `layers` is the forward of its transformer layers alone (kernels and TP all-reduces), what full
    recomputation repeats; `attention` the layers' forward attention kernels, what selective recomputation
    repeats."""

    forward_parts: Parts
    backward_parts: Parts
    layers: float
    attention: float
    forward: float  # totals of the two passes
    backward: float


@memoized
def stage_pass(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, micro_seqs: float,
               seq_len: int, head: str, *, memo: CostMemo | None = None) -> StagePass:
    tokens = micro_seqs * seq_len
    layer = _layer_forward(hw, arch, tokens, (seq_len + 1) / 2, tp, False, seq_len, False, memo=memo)
    comm = _layer_tp_comm(hw, arch, tokens, tp, where)
    n_layers = stage_layers(arch, pp)
    head_cost = _head_forward(hw, arch, tokens, tp, head, False, memo=memo)
    head_comm = _head_tp_comm(hw, tokens, tp, where, head)
    embed = embedding_forward(hw, arch, tokens)
    # The last stage carries the head; with one stage it carries the embedding too.
    ends: list[LayerCost] = [head_cost] + ([embed] if pp == 1 else [])
    tp_comm = n_layers * comm + head_comm
    gemm = n_layers * layer.gemm + sum(c.gemm for c in ends)
    elementwise = n_layers * layer.elementwise + sum(c.elementwise for c in ends)
    attention = n_layers * layer.attention
    forward = Parts(gemm=gemm, attention=attention, elementwise=elementwise, tp_comm=tp_comm)
    gemm_backward = n_layers * layer.gemm_backward + sum(c.gemm_backward for c in ends)
    backward = Parts(gemm=gemm_backward, attention=layer.attention_backward * attention,
                     elementwise=2 * elementwise + n_layers * layer.backward_only, tp_comm=tp_comm)
    return StagePass(forward, backward, layers=n_layers * (layer.total + comm), attention=attention,
                     forward=forward.total, backward=backward.total)


def _p2p(hw: HardwareProfile, arch: ModelArch, layout: Layout, where: SetShape, tokens: float) -> float:
    if layout.pp == 1:
        return 0.0
    return coll.point_to_point(hw, hw.compute.value_bytes * tokens * arch.hidden / layout.tp,
                               stages_share_node(layout, where),
                               where.per_node)


def _per_rank(sequences: int, dp: int, micro_batch: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches) of the most loaded data-parallel rank: the contract's split."""
    sizes = micro_batch_sizes(math.ceil(sequences / dp), micro_batch)
    return sizes[0], len(sizes)


def _recompute_seconds(sp: StagePass, mode: Recompute, layers_host: float) -> float:
    """What the backward repeats: every layer's forward (full: its kernels and `layers_host`, the stage's layers'
    fixed cost of a forward) or attention's score work (selective)."""
    if mode is Recompute.FULL:
        return sp.layers + layers_host
    if mode is Recompute.SELECTIVE:
        return sp.attention
    return 0.0


def call_dispatch(hw: HardwareProfile) -> float:
    """Seconds every role call pays beyond its work (its `controller` part): its dispatch within a Ray task. A
    call that opens a task pays Runtime.task_opening_s on top, in the schedule (schedule.task_openers says which)."""
    return hw.runtime.call_dispatch_s()


def _controller(hw: HardwareProfile) -> Parts:
    return Parts(controller=call_dispatch(hw))


def _pipelined(per_micro: dict[str, float], n_micro: int, bubble_slots: float, **extra: float) -> Parts:
    """n_micro micro-batches of per_micro each, bubble_slots micro-batch slots of pipeline fill and drain,
    and the extra parts."""
    out = Parts({name: n_micro * seconds for name, seconds in per_micro.items()})
    out["bubble"] = bubble_slots * sum(per_micro.values())
    for name, seconds in extra.items():
        out[name] = out.get(name, 0.0) + seconds
    return out


def train_step_parts(hw: HardwareProfile, arch: ModelArch, cfg: TrainConfig, where: SetShape, sequences: int,
                     seq_len: int, head: str, *, memo: CostMemo | None = None) -> Parts:
    """One optimizer step over `sequences` sequences (one mini-batch), by part. 1F1B pipeline schedule; with
    virtual_stages v > 1 the interleaved schedule of Narayanan et al. (SC'21): the bubble shrinks to (pp-1)/v
    micro-batch slots, and every micro-batch crosses v times as many stage boundaries (and runs v chunk
    passes, each paying the fixed cost of a forward pass)."""
    micro, n_micro = _per_rank(sequences, cfg.dp, cfg.micro_batch)
    sp = stage_pass(hw, arch, cfg.tp, cfg.pp, where, micro, seq_len, head, memo=memo)
    v = cfg.virtual_stages
    forward, backward = sp.forward_parts, sp.backward_parts
    per_micro = {name: seconds + backward[name] for name, seconds in forward.items()}
    layers = stage_layers(arch, cfg.pp)
    fsdp, split = trains_through_fsdp(cfg.dp, hw.compute.value_bytes), cfg.tp > 1
    per_micro["recompute"] = _recompute_seconds(sp, Recompute.of(cfg.recompute),
                                                layers * hw.runtime.layer_forward_s(fsdp, split))
    # FSDP1's flat-gradient copy: a memory-bound pass of the backward, on the compute stream (sharding.fsdp1_passes).
    flat_copy = sharding.flat_gradient_copy(hw, arch, cfg, head)
    per_micro["elementwise"] += flat_copy
    per_micro["pp_comm"] = 2 * v * _p2p(hw, arch, cfg, where, micro * seq_len)
    # Per token: the busiest stage's share of the model's layers.
    per_micro["runtime"] = (v * hw.runtime.train_pass_s(fsdp, split, cfg.pp > 1)
                            + layers * hw.runtime.layer_train_s(fsdp, split)
                            + micro * seq_len * hw.runtime.train_token_us * 1e-6 / cfg.pp)
    local_params = stage_params(arch, cfg.pp, head) / cfg.tp
    exposed = sharding.exposed_step_comm(hw, arch, cfg, where, head, sp.forward,
                                         sp.backward + per_micro["recompute"] + flat_copy, n_micro)
    optimizer_params = local_params * sharding.optimizer_fraction(cfg)
    optimizer = memory_time(hw, optimizer_bytes_per_param(hw) * optimizer_params)
    per_tensor = stage_parameter_tensors(arch, cfg.pp, head) * hw.runtime.optimizer_tensor_s(fsdp, split)
    bubble = (cfg.pp - 1) / v
    parts = _pipelined(per_micro, n_micro, bubble, dp_comm=exposed, optimizer=optimizer, runtime=per_tensor)
    return on_shared_host(hw, where, parts, pipeline_busy(cfg.pp, n_micro, bubble))


def train_step_time(hw: HardwareProfile, arch: ModelArch, cfg: TrainConfig, where: SetShape, sequences: int,
                    seq_len: int, head: str, *, memo: CostMemo | None = None) -> float:
    return train_step_parts(hw, arch, cfg, where, sequences, seq_len, head, memo=memo).total


def update_parts(hw: HardwareProfile, arch: ModelArch, cfg: TrainConfig, where: SetShape, sequences: int,
                 seq_len: int, head: str, mini_batches: int, epochs: int, *, memo: CostMemo | None = None) -> Parts:
    step = train_step_parts(hw, arch, cfg, where, sequences // mini_batches, seq_len, head, memo=memo)
    out = step.times(epochs * mini_batches)
    out["controller"] = call_dispatch(hw)
    return out


@memoized
def update_time(hw: HardwareProfile, arch: ModelArch, cfg: TrainConfig, where: SetShape, sequences: int,
                seq_len: int, head: str, mini_batches: int, epochs: int, *, memo: CostMemo | None = None) -> float:
    return update_parts(hw, arch, cfg, where, sequences, seq_len, head, mini_batches, epochs, memo=memo).total


def inference_parts(hw: HardwareProfile, arch: ModelArch, cfg: InferConfig, where: SetShape, sequences: int,
                    seq_len: int, head: str, weight_shards: int = 1, fsdp: bool = False, *,
                    memo: CostMemo | None = None) -> Parts:
    """Forward passes over all sequences (log-probs, values or scores), by part. `weight_shards`: the weights
    are split over this many data-parallel ranks (a trained role in its FSDP layout) and gathered per
    micro-batch; `fsdp`: the passes run through a trained role's FSDP2-wrapped engine."""
    micro, n_micro = _per_rank(sequences, cfg.dp, cfg.micro_batch)
    sp = stage_pass(hw, arch, cfg.tp, cfg.pp, where, micro, seq_len, head, memo=memo)
    per_micro = dict(sp.forward_parts, pp_comm=_p2p(hw, arch, cfg, where, micro * seq_len),
                     runtime=hw.runtime.forward_pass_s(fsdp, cfg.tp > 1, cfg.pp > 1)
                     + stage_layers(arch, cfg.pp) * hw.runtime.layer_forward_s(fsdp, cfg.tp > 1)
                     + micro * seq_len * hw.runtime.forward_token_us * 1e-6 / cfg.pp)
    exposed = 0.0
    if weight_shards > 1:
        gather = sharding.weight_gather_seconds(hw, arch, cfg, where, head, weight_shards)
        first = sharding.layer_share(arch, cfg.pp, head) * gather  # the first layer's: nothing to run beside
        exposed = n_micro * (first + sharding.exposed_beside(hw, gather - first, sp.forward))
    parts = _pipelined(per_micro, n_micro, cfg.pp - 1, dp_comm=exposed, controller=call_dispatch(hw))
    return on_shared_host(hw, where, parts, pipeline_busy(cfg.pp, n_micro, cfg.pp - 1))


@memoized
def inference_time(hw: HardwareProfile, arch: ModelArch, cfg: InferConfig, where: SetShape, sequences: int,
                   seq_len: int, head: str, weight_shards: int = 1, fsdp: bool = False, *,
                   memo: CostMemo | None = None) -> float:
    return inference_parts(hw, arch, cfg, where, sequences, seq_len, head, weight_shards, fsdp, memo=memo).total


def decode_step_parts(hw: HardwareProfile, arch: ModelArch, cfg: Layout, where: SetShape, batch: float,
                      context: float, batching: str = "static", *, memo: CostMemo | None = None) -> Parts:
    """One decode step of `batch` sequences at `context` tokens, through all pipeline stages in turn, on an
    engine batching `batching` (its fixed cost per step)."""
    cached = step_operands_cached(hw, arch, cfg, batch, context)
    layer = _layer_forward(hw, arch, batch, context, cfg.tp, True, None, cached, memo=memo)
    head = _head_forward(hw, arch, batch, cfg.tp, "lm", cached, memo=memo)
    sample = memory_time(hw, FP32 * batch * arch.vocab / cfg.tp)
    n = arch.layers
    return on_shared_host(hw, where, Parts(
        gemm=n * layer.gemm + head.gemm, attention=n * layer.attention,
        elementwise=n * layer.elementwise + head.elementwise + sample,
        tp_comm=(n * _layer_tp_comm(hw, arch, batch, cfg.tp, where, step_all_reduce)
                 + _head_tp_comm(hw, batch, cfg.tp, where, "lm", step_all_reduce)
                 + _step_collectives_fixed(hw, arch, cfg.tp)),
        pp_comm=(cfg.pp - 1) * _p2p(hw, arch, cfg, where, batch),
        runtime=_engine_step_runtime(hw, arch, batching, batch)), 1 / cfg.pp)


def decode_step_time(hw: HardwareProfile, arch: ModelArch, cfg: Layout, where: SetShape, batch: float,
                     context: float) -> float:
    return decode_step_parts(hw, arch, cfg, where, batch, context).total


def prefill_parts(hw: HardwareProfile, arch: ModelArch, cfg: Layout, where: SetShape, batch: float,
                  prompt_len: int, batching: str = "static", *, memo: CostMemo | None = None) -> Parts:
    """One prefill of `batch` prompts: one step of the generation engine (batching `batching`)."""
    tokens = batch * prompt_len
    cached = step_operands_cached(hw, arch, cfg, batch, prompt_len)
    layer = _layer_forward(hw, arch, tokens, (prompt_len + 1) / 2, cfg.tp, False, prompt_len, cached, memo=memo)
    head = _head_forward(hw, arch, batch, cfg.tp, "lm", cached, memo=memo)  # logits of the last prompt token only
    embed = embedding_forward(hw, arch, tokens)
    n = arch.layers
    cache = kv_cache_write_time(hw, arch, tokens, cfg.tp)  # the prompt's keys and values into the KV cache
    return on_shared_host(hw, where, Parts(
        gemm=n * layer.gemm + head.gemm, attention=n * layer.attention,
        elementwise=n * (layer.elementwise + cache) + head.elementwise + embed.elementwise,
        tp_comm=(n * _layer_tp_comm(hw, arch, tokens, cfg.tp, where, step_all_reduce)
                 + _head_tp_comm(hw, batch, cfg.tp, where, "lm", step_all_reduce)  # the last prompt token's logits
                 + _step_collectives_fixed(hw, arch, cfg.tp)),
        pp_comm=(cfg.pp - 1) * _p2p(hw, arch, cfg, where, tokens),
        runtime=_engine_step_runtime(hw, arch, batching, batch)), 1 / cfg.pp)


def _engine_step_runtime(hw: HardwareProfile, arch: ModelArch, batching: str, batch: float) -> float:
    """A generation engine step's fixed cost: the step's own and each decoder layer's (every stage's in turn)."""
    return hw.runtime.engine_step_s(batching, batch) + arch.layers * hw.runtime.layer_step_us * 1e-6


def _lengths(response_len: int, lengths: ResponseLengths | None) -> ResponseLengths:
    return lengths if lengths is not None else ResponseLengths.fixed(response_len)


class WavePhases(NamedTuple):
    """One wave (or a continuous engine's run) by phase: its prefills' parts with the generation's own fixed cost
    (Runtime.generate_call_us), its decode steps' parts, and how many decode steps (the decode parts are that many
    steps of one step's parts)."""

    prefill: Parts
    decode: Parts
    decode_steps: float


@memoized
def wave_parts(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, batch: int,
               prompt_len: int, response_len: int, lengths: ResponseLengths | None = None, batching: str = "static",
               sequences: int = 0, *, memo: CostMemo | None = None) -> Parts:
    """Generation of `sequences` sequences (`batch` when 0) with `batch` of them in the engine at once: its
    prefill and decode phases (`wave_phases`) together."""
    phases = wave_phases(hw, arch, tp, pp, where, batch, prompt_len, response_len, lengths, batching, sequences,
                         memo=memo)
    return phases.prefill.plus(phases.decode)


def wave_phases(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, batch: int,
                prompt_len: int, response_len: int, lengths: ResponseLengths | None = None, batching: str = "static",
                sequences: int = 0, *, memo: CostMemo | None = None) -> WavePhases:
    """Generation of `sequences` sequences (`batch` when 0) with `batch` of them in the engine at once, by phase.

    A sequence's first response token is sampled from its prefill's logits, so a response of l tokens takes
    l - 1 decode steps. static: one prefill, then one decode step fewer than the longest of the batch's responses
    (expected, from the length distribution), every row decoding until the batch ends; costed at the mean context
    length (the step cost is close to linear in the context). continuous (sequences > batch): finished sequences
    are replaced, so the batch stays full: a slot holds each sequence for its l - 1 steps and, where lengths vary
    and other slots go on, one more (the torch engine runs a slot that has just finished through the next step,
    as padding, and refills it after; vLLM refills at once, a step a sequence fewer, under 1% at its lengths):
    sequences x (mean - 1 + that) / batch decode steps, plus the drain of the last batch (its expected longest
    less the mean), at the token-weighted mean context; every sequence's prompt is prefilled in batches of
    `batch`. The wave's call pays the engine's fixed cost of a generation (Runtime.generate_call_us) with its
    prefill phase."""
    dist = _lengths(response_len, lengths)
    sequences = sequences or batch
    layout = Layout(tp=tp, pp=pp)
    if batching == "continuous" and sequences > batch:
        engine = "continuous"
        ride = 1.0 if batch > 1 and dist.mean < dist.max_len else 0.0  # fixed lengths end every slot at once
        steps = sequences * max(0.0, dist.mean - 1 + ride) / batch + max(0.0, dist.expected_max(batch) - dist.mean)
        context = prompt_len + dist.held_by_slot
        prefills = sequences / batch
    else:  # one static batch (a continuous engine with a slot for every sequence runs one too)
        engine = "static"
        steps = max(0.0, dist.expected_max(batch) - 1)
        context = prompt_len + (steps + 1) / 2
        prefills = 1.0
    prefill = prefill_parts(hw, arch, layout, where, batch, prompt_len, engine, memo=memo).times(prefills)
    call = on_shared_host(hw, where, Parts(runtime=hw.runtime.generate_call_us * 1e-6))
    return WavePhases(prefill.plus(call),
                      decode_step_parts(hw, arch, layout, where, batch, context, engine, memo=memo).times(steps),
                      steps)


@dataclass(frozen=True)
class GenerationCost:
    seconds: float
    max_batch: int  # sequences one replica holds in its KV cache at once
    waves: int
    parts: Parts | None = None  # by part (None when infeasible)


@memoized
def generation_time(hw: HardwareProfile, arch: ModelArch, cfg: GenConfig, where: SetShape, sequences: int,
                    prompt_len: int, response_len: int, kv_budget_bytes: float, *, memo: CostMemo | None = None,
                    lengths: ResponseLengths | None = None) -> GenerationCost:
    """Batched generation on cfg.dp replicas, responses of `lengths` (every one response_len when None).
    Each replica holds at most as many sequences as its KV-cache budget has room for (memory.KvSequence.slots:
    at their longest in a reserved cache, as they grow in a paged one), and no more than cfg.max_batch where the
    plan caps its engine. A static engine (cfg.batching) runs its share in equal waves, no more at once than is
    fastest, so more memory never makes generation slower; a continuous one keeps its slots full (`wave_parts`)."""
    per_replica = math.ceil(sequences / cfg.dp)
    kv = kv_sequence(arch, cfg, prompt_len, _lengths(response_len, lengths), hw.compute.value_bytes)
    max_batch = kv.slots(kv_budget_bytes, per_replica, cfg.max_batch)
    if max_batch < 1:
        return GenerationCost(seconds=math.inf, max_batch=0, waves=0)
    best = _best_waves(hw, arch, cfg.tp, cfg.pp, where, per_replica, max_batch, prompt_len, response_len, lengths,
                       cfg.batching, memo=memo)
    parts = best.parts.plus(_controller(hw))
    return GenerationCost(seconds=parts.total, max_batch=best.batch, waves=best.waves, parts=parts)


def _waves_parts(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, sequences: int,
                 waves: int, prompt_len: int, response_len: int, lengths: ResponseLengths | None, batching: str,
                 memo: CostMemo | None) -> Parts:
    """`sequences` in `waves` equal static waves, or through a continuous batch of as many slots."""
    small, bigger = divmod(sequences, waves)  # `bigger` waves of small + 1, the rest of small
    if batching == "continuous":
        return wave_parts(hw, arch, tp, pp, where, small + (1 if bigger else 0), prompt_len, response_len,
                          lengths, batching, sequences, memo=memo)
    out = Parts()
    if bigger:
        out = out.plus(wave_parts(hw, arch, tp, pp, where, small + 1, prompt_len, response_len, lengths,
                                  memo=memo), times=bigger)
    if small:
        out = out.plus(wave_parts(hw, arch, tp, pp, where, small, prompt_len, response_len, lengths,
                                  memo=memo), times=waves - bigger)
    return out


def waves_phases(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, sequences: int,
                 waves: int, prompt_len: int, response_len: int, lengths: ResponseLengths | None = None,
                 batching: str = "static", *, memo: CostMemo | None = None) -> WavePhases:
    """`_waves_parts` by phase (what `hfplan cost generate` shows): the same waves, their prefills' and decode
    steps' parts summed apart; the decode steps are every wave's, one after another."""
    small, bigger = divmod(sequences, waves)
    if batching == "continuous":
        return wave_phases(hw, arch, tp, pp, where, small + (1 if bigger else 0), prompt_len, response_len, lengths,
                           batching, sequences, memo=memo)
    prefill, decode, steps = Parts(), Parts(), 0.0
    for size, count in ((small + 1, bigger), (small, waves - bigger)):
        if size and count:
            one = wave_phases(hw, arch, tp, pp, where, size, prompt_len, response_len, lengths, memo=memo)
            prefill, decode = prefill.plus(one.prefill, times=count), decode.plus(one.decode, times=count)
            steps += count * one.decode_steps
    return WavePhases(prefill, decode, steps)


@functools.lru_cache(maxsize=1 << 12)
def _wave_counts(sequences: int) -> tuple[int, ...]:
    """The wave counts equal batches of `sequences` can make, fewest first."""
    return tuple(sorted({-(-sequences // size) for size in range(1, sequences + 1)}))


class _WaveTotals:
    """Seconds of one replica's sequences by wave count (_waves_parts' totals) for one layout and engine, each
    computed when first asked. It holds no memo (a memo holds it: a cycle would outlive the search)."""

    def __init__(self, *args: Any) -> None:
        self._args = args  # _waves_parts' arguments before and after the wave count
        self._seconds: dict[int, float] = {}

    def seconds(self, waves: int, memo: CostMemo | None) -> float:
        value = self._seconds.get(waves)
        if value is None:
            hw, arch, tp, pp, where, sequences, *rest = self._args
            value = self._seconds[waves] = _waves_parts(hw, arch, tp, pp, where, sequences, waves, *rest, memo).total
        return value


@memoized
def _wave_totals(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, sequences: int,
                 prompt_len: int, response_len: int, lengths: ResponseLengths | None, batching: str, *,
                 memo: CostMemo | None = None) -> _WaveTotals:
    """The wave counts' seconds of one layout and engine: one memo entry for all of them, since the loops over
    wave counts below ask for many, and a lookup keyed on every argument costs more than the arithmetic."""
    return _WaveTotals(hw, arch, tp, pp, where, sequences, prompt_len, response_len, lengths, batching)


def _fewest_waves(sequences: int, max_batch: int) -> int:
    """Batches of at most max_batch sequences make at least this many waves (every count above it too)."""
    return -(-sequences // max(1, min(sequences, max_batch)))


class Waves(NamedTuple):
    """How one replica runs its sequences: in `waves` static waves of at most `batch`, or through `batch`
    continuous slots, and what that costs."""

    parts: Parts
    waves: int
    batch: int  # the largest number of sequences held at once


@memoized
def _best_waves(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, sequences: int,
                max_batch: int, prompt_len: int, response_len: int, lengths: ResponseLengths | None = None,
                batching: str = "static", *, memo: CostMemo | None = None) -> Waves:
    """The fastest way to run `sequences` with at most max_batch at once: static, equal waves; continuous, a
    batch of slots kept full (its size chosen the same way)."""
    fewest = _fewest_waves(sequences, max_batch)
    totals = _wave_totals(hw, arch, tp, pp, where, sequences, prompt_len, response_len, lengths, batching, memo=memo)
    best_seconds, best_waves = math.inf, 0
    for waves in _wave_counts(sequences):
        if waves < fewest:
            continue
        seconds = totals.seconds(waves, memo)
        if seconds < best_seconds:
            best_seconds, best_waves = seconds, waves
    parts = _waves_parts(hw, arch, tp, pp, where, sequences, best_waves, prompt_len, response_len, lengths,
                         batching, memo)
    return Waves(parts, best_waves, -(-sequences // best_waves))


@memoized
def batching_never_slower(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, sequences: int,
                          most: int, prompt_len: int, response_len: int, lengths: ResponseLengths | None, first: str,
                          second: str, *, memo: CostMemo | None = None) -> bool:
    """Whether generating `sequences` on one replica with batching `first` is at most as slow as with `second`
    whatever KV-cache room up to `most` sequences at once: generation_time takes the fastest wave count the room
    allows (every count from ceil(sequences / max_batch) up), so compare the two engines' best over each such
    range, from one sequence at a time up to `most`."""
    fewest = _fewest_waves(sequences, most)
    args = (hw, arch, tp, pp, where, sequences, prompt_len, response_len, lengths)
    first_totals, second_totals = (_wave_totals(*args, batching, memo=memo) for batching in (first, second))
    best_first = best_second = math.inf
    for waves in reversed(_wave_counts(sequences)):
        if waves < fewest:
            break
        best_first = min(best_first, first_totals.seconds(waves, memo))
        best_second = min(best_second, second_totals.seconds(waves, memo))
        if best_first > best_second:
            return False
    return True


def _engine_weights_fixed(hw: HardwareProfile, arch: ModelArch, gen: GenConfig, train: TrainConfig | None = None
                          ) -> float:
    """The engines' fixed cost of a switch, per parameter tensor a GPU generates with: the rollout engine's, or
    for a hybrid actor generating in its training layout (`train`, not resharded by plan) its training engine's
    unshard and reshard through FSDP2 and tensor parallelism as well, or one resharded by plan that plan's cutting
    and assembling (Runtime.reshard_tensor_us); for one that generates with the very
    tensors it trains, nothing is handed over: the profile's cost of that whole switch (Runtime.kept_switch_us)."""
    if (train is not None and hw.runtime.kept_switch_us is not None
            and keeps_trained_tensors(train, gen, hw.compute.value_bytes)):
        return hw.runtime.kept_switch_us * 1e-6
    by_plan = train is not None and reshards_by_plan(train, gen)
    in_place = train is not None and not by_plan
    fsdp = in_place and trains_through_fsdp(train.dp, hw.compute.value_bytes)
    split = in_place and train.tp > 1
    return stage_parameter_tensors(arch, gen.pp, "lm") * hw.runtime.switch_tensor_s(fsdp, split, by_plan)


@memoized
def transition_time(hw: HardwareProfile, arch: ModelArch, train: TrainConfig, gen: GenConfig,
                    where: SetShape, *, memo: CostMemo | None = None) -> float:
    """Training layout -> generation layout: an all-gather of each GPU's generation shard among the
    GPUs holding its pieces (its generation group), sized by the slices the busiest GPU receives
    (hfplan.layout's per-tensor plan, as the executor moves them); where generation keeps the training layout, the
    training engine's FSDP2 gathers it unit by unit (sharding.fsdp_units). Going back moves nothing: the generation
    copy is dropped. Both ways, the engines pay a fixed cost per parameter tensor of the generation model
    (Runtime.switch_tensor_s)."""
    fixed = hw.compute.host_slowdown(where.per_node) * _engine_weights_fixed(hw, arch, gen, train)
    plan = resharding(train, gen)
    received = most_received_numel(arch, train, gen)
    if plan.group <= 1 or received == 0:
        return fixed
    group = coll.grid_group(list(plan.dims), where.per_node)
    # A ring all-gather in which each GPU receives (group - 1) / group of the result: one for each FSDP unit where
    # generation keeps the training layout (the training engine unshards unit by unit), else one.
    gathered = hw.compute.value_bytes * received * plan.group / (plan.group - 1)
    if reshards_by_plan(train, gen):
        return fixed + coll.all_gather(hw, group, gathered)
    return fixed + sharding.unit_by_unit(coll.all_gather, hw, group, gathered, sharding.fsdp_units(arch, train.pp))


def weight_sync_time(hw: HardwareProfile, arch: ModelArch, gen: GenConfig, rollout: SetShape,
                     same_node: bool) -> float:
    """Separate generation engine: every rollout GPU receives its generation shard of the freshly
    trained weights (hfplan.layout's sync plan: the norms whole, the rest split); the receiving node's
    links carry the shards of all its GPUs. The receiving engine takes them tensor by tensor, as the hybrid
    engine's rollout engine does (Runtime.switch_tensor_us). The rollout ranks' loads take the actor ranks'
    buckets as arguments, which Ray resolves where the references live, in the controller's process: the buckets'
    readiness reaches the controller and the loads go out from it (Runtime.weight_sync_s: that way through Ray's
    object store, measured, or one round trip). The bytes go through Ray's object store where the profile measured
    it (Links.object_store), else as a point-to-point send."""
    fixed = (hw.compute.host_slowdown(rollout.per_node) * _engine_weights_fixed(hw, arch, gen)
             + hw.runtime.weight_sync_s())
    shard_bytes = hw.compute.value_bytes * most_generation_numel(arch, gen)
    node_bytes = shard_bytes * rollout.per_node
    if hw.links.object_store is not None:
        # The executor's path: each rollout rank reads its shard through Ray's object store in its own process
        # (a GPU's buckets leave and reach the devices through the host link); Ray moves them between nodes first.
        # Its bytes only: the sync's fixed cost on that path is weight_sync_s, measured whole through the executor.
        through_host = 0.0 if hw.on_host else 2 * coll.host_transfer(hw, shard_bytes)
        across = 0.0 if same_node else coll.point_to_point(hw, node_bytes, same_node=False)
        return fixed + coll.object_store_bytes(hw, shard_bytes) + through_host + across
    if same_node:
        return fixed + coll.point_to_point(hw, shard_bytes, same_node=True)
    return fixed + coll.point_to_point(hw, node_bytes, same_node=False)
