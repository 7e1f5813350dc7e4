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
Where the stack is torch's FSDP1 (Compute.fsdp_engine), full and hybrid sharding also pay its memory passes
(fsdp1_passes): a flat-gradient copy on the compute stream, and casts and divisions beside the collectives.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from hfplan.layout import stage_layers, stage_params
from hfplan.plan import Layout, TrainConfig
from hfplan.simulator import collectives as coll
from hfplan.simulator.kernels import FP32, memory_time

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
    return stage_layers(arch, pp) + 1


def unit_by_unit(collective, hw: HardwareProfile, group: coll.Group, nbytes: float, units: int) -> float:
    """`units` collectives of nbytes / units each (one per FSDP unit: the stage's bytes in even shares)."""
    return units * collective(hw, group, nbytes / units)


def weight_gather_seconds(hw: HardwareProfile, arch: ModelArch, layout: Layout, where: SetShape, head: str,
                          shards: int) -> float:
    """All-gather of a stage's weights (compute precision) among `shards` data-parallel ranks, unit by unit."""
    nbytes = hw.compute.value_bytes * stage_params(arch, layout.pp, head) / layout.tp
    return unit_by_unit(coll.all_gather, hw, shard_group(layout, shards, where), nbytes, fsdp_units(arch, layout.pp))


def gradient_predivide_factor(ranks: int) -> int:
    """What torch's FSDP1 divides a gradient by before reducing it over `ranks` ranks (and by ranks / this after),
    splitting the average to keep bf16 sums in range: doubling from 1 while it divides `ranks` and is below
    ranks / itself (torch/distributed/algorithms/_comm_hooks/default_hooks.py, DefaultState.
    _get_gradient_predivide_factor, which FSDP1's _init_core_state takes; 8 ranks: 4, then 2)."""
    factor = 1
    while ranks % factor == 0 and ranks / factor > factor:
        factor *= 2
    return factor


@functools.lru_cache(maxsize=1 << 14)
def fsdp1_passes(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, shards: int, head: str
                 ) -> tuple[float, float, float]:
    """Seconds of torch FSDP1's own memory passes in one micro-batch of a fully sharded stage over `shards` ranks
    (torch 2.1's torch/distributed/fsdp: _runtime_utils.py, flat_param.py), per pass over every FSDP unit (one
    kernel each): (compute stream, before each weight gather, around the gradient reduce-scatter).
    - Compute stream: the forward uses each parameter as a view of the unsharded flat parameter (flat_param.py,
      _use_unsharded_views(as_params=False): torch.split, then view), so the backward of that split writes the
      units' gradients into one flat gradient (a concatenation: each value read and written, value_bytes each).
    - Before each gather (pre-unshard stream, twice a micro-batch): the fp32 shard cast to the compute precision
      where it is lower (_use_low_precision_shard: 4 bytes read, value_bytes written, of the rank's 1 / shards).
    - Around the reduce-scatter (post-backward stream): the whole flat gradient cast to the reduction's precision
      where it differs (_post_backward_hook) and divided in place before it (_reduce_grad, _div_if_needed by
      gradient_predivide_factor); the shard divided after it where a factor is left, and cast back to the fp32
      of the shard where it was reduced in bf16 (_cast_grad_to_param_dtype).
    No padding copy before the reduce-scatter: with use_orig_params the flat parameter is padded to a multiple of
    the ranks when built (flat_param.py: "to avoid a copy for the post-backward reduce-scatter"). Accumulating the
    shard across micro-batches (12 bytes of the rank's 1 / shards, from the second on) is left out. Zero where the
    engine is FSDP2 (Compute.fsdp_engine)."""
    if hw.compute.fsdp_engine != "fsdp1" or shards == 1:
        return 0.0, 0.0, 0.0
    units = fsdp_units(arch, pp)
    params = stage_params(arch, pp, head) / tp
    value, reduced = hw.compute.value_bytes, hw.compute.gradient_reduce_bytes

    def passes(bytes_per_param: float) -> float:
        return units * memory_time(hw, bytes_per_param * params / units) if bytes_per_param else 0.0

    cast_in = FP32 + value if value != FP32 else 0  # the shard cast to the compute precision
    before = (value + reduced if value != reduced else 0) + 2 * reduced  # cast to the reduction's, predivided
    after = (2 * reduced if shards / gradient_predivide_factor(shards) > 1 else 0) + \
        (reduced + FP32 if reduced != FP32 else 0)  # postdivided, cast back to the shard's fp32
    return passes(2 * value), passes(cast_in / shards), passes(before) + passes(after / shards)


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


def flat_gradient_copy(hw: HardwareProfile, arch: ModelArch, cfg: TrainConfig, head: str) -> float:
    """Seconds one micro-batch's backward spends on the compute stream copying its gradients into FSDP1's flat
    gradient (fsdp1_passes); zero unless the stage is fully sharded (full, hybrid) over more than one rank."""
    if cfg.dp == 1 or cfg.shard not in ("full", "hybrid"):
        return 0.0
    return fsdp1_passes(hw, arch, cfg.tp, cfg.pp, cfg.shard_size, head)[0]


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
    beside them. Under FSDP1 each gather waits for its shard's cast, and the reduce-scatter comes with its
    gradient's divisions and cast (fsdp1_passes), on the same side streams."""
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
    _, before_gather, around_scatter = fsdp1_passes(hw, arch, cfg.tp, cfg.pp, cfg.shard_size, head)
    gather, scatter, replicas = first + before_gather, second + around_scatter, third
    edge = layer_share(arch, cfg.pp, head)
    unhidden = edge * (2 * gather + scatter)
    beside = (1.0 - edge) * gather, (1.0 - edge) * (gather + scatter)
    exposed = n_micro * (unhidden + exposed_beside(hw, beside[0], forward) + exposed_beside(hw, beside[1], backward))
    if cfg.shard_size < cfg.dp:
        exposed += exposed_beside(hw, replicas, backward)
    return exposed
