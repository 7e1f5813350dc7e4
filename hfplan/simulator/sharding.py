"""What each sharding mode of a training layout keeps on one GPU and moves in one optimizer step.

The modes (hfplan.plan.SHARDED_STATES) split some of the three training states over a shard group of
data-parallel ranks: weights (compute precision), gradients (fp32) and optimizer states (the fp32
master copy and Adam's two moments). Ranks of a shard group are consecutive data-parallel ranks, tp
apart (the contract's rank order); hybrid sharding's replicas are the groups' counterparts, g * tp apart.

Per step (one mini-batch of n micro-batches on each rank), with P the rank's parameters (after tp and
pp), v the weight bytes and 4 the fp32 gradient bytes per parameter (Compute.gradient_reduce_bytes: 2 where the
stack reduces bf16 gradients):
- replicated: one all-reduce of 4P over dp, overlapped with the last backward;
- zero1: one reduce-scatter of 4P over dp (overlapped with the last backward), then one all-gather
  of the updated weights, vP, after the optimizer step;
- zero2: a reduce-scatter of 4P after every micro-batch's backward (overlapped with it), and the
  all-gather of the updated weights once per step;
- full and hybrid: every micro-batch all-gathers the weights (vP) before its forward and again
  before its backward, and reduce-scatters its gradients, in its shard group (layer-wise prefetch
  overlaps them with compute); hybrid then all-reduces its gradient shard (4P / g) across the
  replicas once per step, overlapped with the last backward. Each of these runs unit by unit (fsdp_units:
  a collective per decoder layer and one for the stage's root), each paying its own latency.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from hfplan.layout import stage_params
from hfplan.plan import Layout, TrainConfig
from hfplan.simulator import collectives as coll
from hfplan.simulator.kernels import FP32

if TYPE_CHECKING:
    from hfplan.profiles.hardware import HardwareProfile
    from hfplan.profiles.models import ModelArch
    from hfplan.simulator.costs import SetShape


def state_bytes(value_bytes: int) -> dict[str, int]:
    """Bytes per parameter of each training state: weights in the compute precision, fp32 gradients, and
    the optimizer's fp32 master copy (when the weights are not fp32 already) and two Adam moments."""
    master = FP32 if value_bytes < FP32 else 0
    return {"weights": value_bytes, "grads": FP32, "optimizer": master + 2 * FP32}


def resident_bytes_per_param(cfg: TrainConfig, value_bytes: int) -> float:
    """Training-state bytes one GPU keeps per parameter of its (tp, pp) shard."""
    return sum(nbytes / cfg.shards(state) for state, nbytes in state_bytes(value_bytes).items())


def optimizer_fraction(cfg: TrainConfig) -> float:
    """Share of its (tp, pp) shard's parameters whose optimizer step one GPU runs."""
    return 1.0 / cfg.shards("optimizer")


def shard_group(layout: Layout, size: int, where: SetShape) -> coll.Group:
    """`size` consecutive data-parallel ranks (tp apart): the group a sharded state is split over."""
    return coll.group_of(size, layout.tp, where.per_node)


def fsdp_units(arch: ModelArch, pp: int) -> int:
    """The units a fully sharded stage gathers and reduces one by one: each of its decoder layers and its root (the
    embedding, the final norm and the head), each wrapped on its own as the executor's engine wraps them (and as
    FSDP's auto-wrapping by transformer block does). Every unit's collective pays its own latency."""
    return math.ceil(arch.layers / pp) + 1


def unit_by_unit(collective, hw: HardwareProfile, group: coll.Group, nbytes: float, units: int) -> float:
    """`units` collectives of nbytes / units each (one per FSDP unit: the stage's bytes in even shares)."""
    return units * collective(hw, group, nbytes / units)


def weight_gather_seconds(hw: HardwareProfile, arch: ModelArch, layout: Layout, where: SetShape, head: str,
                          shards: int) -> float:
    """All-gather of a stage's weights (compute precision) among `shards` data-parallel ranks, unit by unit."""
    nbytes = hw.compute.value_bytes * stage_params(arch, layout.pp, head) / layout.tp
    return unit_by_unit(coll.all_gather, hw, shard_group(layout, shards, where), nbytes, fsdp_units(arch, layout.pp))


@functools.lru_cache(maxsize=1 << 14)
def _step_collectives(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, dp: int, shard: str, size: int,
                      where: SetShape, head: str) -> tuple[float, float, float]:
    """Seconds of one step's collectives, which depend on the layout alone (not on the micro-batch, the
    recomputation or the virtual stages), for exposed_step_comm: replicated (all-reduce, 0, 0); zero1 and
    zero2 (reduce-scatter, weight all-gather, 0); full and hybrid (layer gather, reduce-scatter, replica
    all-reduce)."""
    layout = Layout(tp=tp, pp=pp, dp=dp)
    local = stage_params(arch, pp, head) / tp
    grads = hw.compute.gradient_reduce_bytes * local  # the gradients as the ranks reduce them (fp32 unless bf16)
    everyone = shard_group(layout, dp, where)
    if shard == "replicated":
        return coll.all_reduce(hw, everyone, grads), 0.0, 0.0
    if shard in ("zero1", "zero2"):
        return (coll.reduce_scatter(hw, everyone, grads),
                coll.all_gather(hw, everyone, hw.compute.value_bytes * local), 0.0)
    units = fsdp_units(arch, pp)
    gather = weight_gather_seconds(hw, arch, layout, where, head, size)
    scatter = unit_by_unit(coll.reduce_scatter, hw, shard_group(layout, size, where), grads, units)
    replicas = 0.0
    if size < dp:
        replicas = unit_by_unit(coll.all_reduce, hw, coll.group_of(dp // size, size * tp, where.per_node),
                                grads / size, units)
    return gather, scatter, replicas


def backward_hides_at_most_once_per_micro_batch(cfg: TrainConfig) -> bool:
    """Whether exposed_step_comm's overlap with the backward counts each micro-batch's backward at most once,
    so that more backward work (recomputation) can never make a step shorter: every mode but hybrid, whose
    replica all-reduce overlaps the last backward a second time."""
    return cfg.dp == 1 or cfg.shard != "hybrid" or cfg.shard_size == cfg.dp


def exposed_beside(hw: HardwareProfile, comm: float, compute: float) -> float:
    """Seconds a collective of `comm` seconds adds to `compute` seconds of kernels it runs beside. While it runs,
    the compute runs 1 + s times slower (Compute.overlap_slowdown: the collective's kernels hold SMs and memory
    bandwidth); the compute left when it ends runs at full speed. So a collective shorter than the slowed compute
    adds comm * s / (1 + s), a longer one all it outlasts the compute by (comm - compute). Never negative, never more
    than comm, and never decreasing by more than the compute grows (more compute never shortens the pair).
    Where the device runs collectives in line (Compute.overlaps_collectives false: CPU processes), all of it."""
    if not hw.compute.overlaps_collectives:
        return comm
    slowdown = hw.compute.overlap_slowdown
    if comm >= compute * (1.0 + slowdown):
        return comm - compute
    return comm * slowdown / (1.0 + slowdown)


def layer_share(arch: ModelArch, pp: int, head: str) -> float:
    """One layer's share of a stage's parameters: of its layer-by-layer collectives, what the first (or the last)
    layer's moves, with no other layer's compute beside it."""
    return arch.params_per_layer / stage_params(arch, pp, head)


def exposed_step_comm(hw: HardwareProfile, arch: ModelArch, cfg: TrainConfig, where: SetShape, head: str,
                      forward: float, backward: float, n_micro: int) -> float:
    """Seconds of data-parallel communication one optimizer step does not hide behind compute
    (`forward`, `backward`: one micro-batch's passes through the stage; `exposed_beside`). Full and hybrid sharding
    gather and reduce layer by layer, each collective beside the next layer's compute (prefetch): the forward's and
    the backward's first gather and the backward's last reduce-scatter, one layer's share each, have no compute
    beside them."""
    if cfg.dp == 1:
        return 0.0
    first, second, third = _step_collectives(hw, arch, cfg.tp, cfg.pp, cfg.dp, cfg.shard, cfg.shard_size, where,
                                             head)
    if cfg.shard == "replicated":
        return exposed_beside(hw, first, backward)
    if cfg.shard == "zero1":
        return exposed_beside(hw, first, backward) + second
    if cfg.shard == "zero2":
        return n_micro * exposed_beside(hw, first, backward) + second
    gather, scatter, replicas = first, second, third
    edge = layer_share(arch, cfg.pp, head)
    unhidden = edge * (2 * gather + scatter)
    beside = (1.0 - edge) * gather, (1.0 - edge) * (gather + scatter)
    exposed = n_micro * (unhidden + exposed_beside(hw, beside[0], forward) + exposed_beside(hw, beside[1], backward))
    if cfg.shard_size < cfg.dp:
        exposed += exposed_beside(hw, replicas, backward)
    return exposed
