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
from typing import Any, TypeVar

from hfplan.layout import resharding, stage_params
from hfplan.plan import GenConfig, InferConfig, Layout, TrainConfig
from hfplan.profiles.hardware import HardwareProfile
from hfplan.profiles.models import ModelArch
from hfplan.simulator import collectives as coll
from hfplan.simulator import sharding
from hfplan.simulator.kernels import (
    FP32,
    LayerCost,
    embedding_forward,
    head_forward,
    layer_forward,
    memory_time,
)
from hfplan.simulator.memory import kv_bytes_per_token_per_gpu

# Adam step traffic per parameter: read the fp32 gradient (4), read and write the fp32 master weight,
# first and second moments (3 x 8), write the bf16 weight (2).
ADAM_BYTES_PER_PARAM = 4 + 3 * 8 + 2
# Vocabulary-parallel log-softmax reduces a max and a sum per token across tensor-parallel ranks.
LOGSOFTMAX_REDUCTIONS = 2


F = TypeVar("F", bound=Callable[..., Any])


class CostMemo:
    """Memo tables of the cost functions marked @memoized, owned by one search or one simulation and
    passed in (`memo=`): the same arguments always cost the same, so each is computed once per owner.
    Without a memo the functions compute directly."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[tuple, Any]] = {}

    def clear(self) -> None:
        self.tables.clear()


def memoized(fn: F) -> F:
    """fn(*args, memo=None): with a CostMemo, answer from (and fill) its table for fn."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, memo: CostMemo | None = None):
        if memo is None:
            return fn(*args, memo=None)
        table = memo.tables.get(name)
        if table is None:
            table = memo.tables[name] = {}
        try:
            return table[args]
        except KeyError:
            value = table[args] = fn(*args, memo=memo)
            return value

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class SetShape:
    """The shape of one placement set: its GPU count, and how many of them share one node."""

    gpus: int
    gpus_per_node: int

    @property
    def per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)


def tp_group(tp: int, where: SetShape) -> coll.Group:
    return coll.group_of(tp, 1, where.per_node)


def stages_share_node(layout: Layout, where: SetShape) -> bool:
    return layout.gpus <= where.per_node


def _layer_tp_comm(hw: HardwareProfile, arch: ModelArch, tokens: float, tp: int, where: SetShape) -> float:
    """Two all-reduces of the hidden state per layer pass (after attention and after the MLP)."""
    if tp == 1:
        return 0.0
    return 2 * coll.all_reduce(hw, tp_group(tp, where), hw.compute.value_bytes * tokens * arch.hidden)


def _head_tp_comm(hw: HardwareProfile, tokens: float, tp: int, where: SetShape, head: str) -> float:
    if tp == 1 or head != "lm":
        return 0.0
    return LOGSOFTMAX_REDUCTIONS * coll.all_reduce(hw, tp_group(tp, where), FP32 * tokens)


@dataclass(frozen=True)
class StagePass:
    """Seconds of one micro-batch through the most loaded pipeline stage."""

    forward: float
    backward: float


@memoized
def stage_pass(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, micro_seqs: float,
               seq_len: int, head: str, *, memo: CostMemo | None = None) -> StagePass:
    tokens = micro_seqs * seq_len
    layer = layer_forward(hw, arch, tokens, keys_per_token=(seq_len + 1) / 2, tp=tp)
    comm = _layer_tp_comm(hw, arch, tokens, tp, where)
    n_layers = math.ceil(arch.layers / pp)
    head_cost = head_forward(hw, arch, tokens, tp, head)
    head_comm = _head_tp_comm(hw, tokens, tp, where, head)
    embed = embedding_forward(hw, arch, tokens)
    # The last stage carries the head; with one stage it carries the embedding too.
    ends: list[LayerCost] = [head_cost] + ([embed] if pp == 1 else [])
    forward = n_layers * (layer.total + comm) + sum(c.total for c in ends) + head_comm
    backward = n_layers * (layer.backward() + comm) + sum(c.backward() for c in ends) + head_comm
    return StagePass(forward=forward, backward=backward)


def _p2p(hw: HardwareProfile, arch: ModelArch, layout: Layout, where: SetShape, tokens: float) -> float:
    if layout.pp == 1:
        return 0.0
    return coll.point_to_point(hw, hw.compute.value_bytes * tokens * arch.hidden / layout.tp,
                               stages_share_node(layout, where),
                               where.per_node)


def _per_rank(sequences: int, dp: int, micro_batch: int) -> tuple[int, int]:
    """(sequences per data-parallel rank, micro-batches per rank)."""
    seqs = math.ceil(sequences / dp)
    micro = min(micro_batch, seqs)
    return micro, math.ceil(seqs / micro)


@memoized
def train_step_time(hw: HardwareProfile, arch: ModelArch, cfg: TrainConfig, where: SetShape, sequences: int,
                    seq_len: int, head: str, *, memo: CostMemo | None = None) -> float:
    """One optimizer step over `sequences` sequences (one mini-batch), 1F1B pipeline schedule."""
    micro, n_micro = _per_rank(sequences, cfg.dp, cfg.micro_batch)
    sp = stage_pass(hw, arch, cfg.tp, cfg.pp, where, micro, seq_len, head, memo=memo)
    fwd = sp.forward
    bwd = sp.backward + (sp.forward if cfg.recompute else 0.0)
    p2p = 2 * _p2p(hw, arch, cfg, where, micro * seq_len)
    local_params = stage_params(arch, cfg.pp, head) / cfg.tp
    exposed = sharding.exposed_step_comm(hw, arch, cfg, where, head, fwd, bwd, n_micro)
    pipeline = (n_micro + cfg.pp - 1) * (fwd + bwd + p2p)
    optimizer_params = local_params * sharding.optimizer_fraction(cfg)
    optimizer = memory_time(hw, ADAM_BYTES_PER_PARAM * optimizer_params)
    return pipeline + exposed + optimizer


def update_time(hw: HardwareProfile, arch: ModelArch, cfg: TrainConfig, where: SetShape, sequences: int,
                seq_len: int, head: str, mini_batches: int, epochs: int, *, memo: CostMemo | None = None) -> float:
    step = train_step_time(hw, arch, cfg, where, sequences // mini_batches, seq_len, head, memo=memo)
    return epochs * mini_batches * step


@memoized
def inference_time(hw: HardwareProfile, arch: ModelArch, cfg: InferConfig, where: SetShape, sequences: int,
                   seq_len: int, head: str, weight_shards: int = 1, *, memo: CostMemo | None = None) -> float:
    """Forward passes over all sequences (log-probs, values or scores). `weight_shards`: the weights are
    split over this many data-parallel ranks (a trained role in its FSDP layout) and gathered per micro-batch."""
    micro, n_micro = _per_rank(sequences, cfg.dp, cfg.micro_batch)
    fwd = stage_pass(hw, arch, cfg.tp, cfg.pp, where, micro, seq_len, head, memo=memo).forward
    p2p = _p2p(hw, arch, cfg, where, micro * seq_len)
    exposed = 0.0
    if weight_shards > 1:
        exposed = n_micro * max(0.0, sharding.weight_gather_seconds(hw, arch, cfg, where, head, weight_shards) - fwd)
    return (n_micro + cfg.pp - 1) * (fwd + p2p) + exposed


def decode_step_time(hw: HardwareProfile, arch: ModelArch, cfg: Layout, where: SetShape, batch: float,
                     context: float) -> float:
    """One decode step of `batch` sequences at `context` tokens, through all pipeline stages in turn."""
    layer = layer_forward(hw, arch, batch, keys_per_token=context, tp=cfg.tp, decode=True)
    comm = _layer_tp_comm(hw, arch, batch, cfg.tp, where)
    head = head_forward(hw, arch, batch, cfg.tp, "lm")
    sample = memory_time(hw, FP32 * batch * arch.vocab / cfg.tp)
    p2p = (cfg.pp - 1) * _p2p(hw, arch, cfg, where, batch)
    return arch.layers * (layer.total + comm) + head.total + _head_tp_comm(hw, batch, cfg.tp, where, "lm") \
        + sample + p2p


def prefill_time(hw: HardwareProfile, arch: ModelArch, cfg: Layout, where: SetShape, batch: float,
                 prompt_len: int) -> float:
    tokens = batch * prompt_len
    layer = layer_forward(hw, arch, tokens, keys_per_token=(prompt_len + 1) / 2, tp=cfg.tp)
    comm = _layer_tp_comm(hw, arch, tokens, cfg.tp, where)
    head = head_forward(hw, arch, batch, cfg.tp, "lm")  # logits of the last prompt token only
    p2p = (cfg.pp - 1) * _p2p(hw, arch, cfg, where, tokens)
    return arch.layers * (layer.total + comm) + head.total + embedding_forward(hw, arch, tokens).total + p2p


@memoized
def wave_time(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, batch: int,
              prompt_len: int, response_len: int, *, memo: CostMemo | None = None) -> float:
    """One prefill of `batch` prompts, then response_len decode steps at the mean context length (the
    step cost is close to linear in the context)."""
    layout = Layout(tp=tp, pp=pp)
    mean_context = prompt_len + (response_len - 1) / 2
    return prefill_time(hw, arch, layout, where, batch, prompt_len) + response_len * decode_step_time(
        hw, arch, layout, where, batch, mean_context)


@dataclass(frozen=True)
class GenerationCost:
    seconds: float
    max_batch: int  # sequences one replica holds in its KV cache at once
    waves: int


def generation_time(hw: HardwareProfile, arch: ModelArch, cfg: GenConfig, where: SetShape, sequences: int,
                    prompt_len: int, response_len: int, kv_budget_bytes: float, *, memo: CostMemo | None = None
                    ) -> GenerationCost:
    """Batched generation on cfg.dp replicas (every response runs to response_len). Each replica runs
    its share in waves of at most as many sequences as its KV-cache budget holds; a wave is one prefill
    then response_len memory-bound decode steps, costed at the mean context length. The engine splits
    the share into equal waves and runs no more at once than is fastest, so more memory never makes
    generation slower."""
    per_replica = math.ceil(sequences / cfg.dp)
    per_seq = kv_bytes_per_token_per_gpu(arch, cfg, hw.compute.value_bytes) * (prompt_len + response_len)
    max_batch = min(per_replica, int(kv_budget_bytes // per_seq))
    if max_batch < 1:
        return GenerationCost(seconds=math.inf, max_batch=0, waves=0)
    seconds, waves, batch = _best_waves(hw, arch, cfg.tp, cfg.pp, where, per_replica, max_batch, prompt_len,
                                        response_len, memo=memo)
    return GenerationCost(seconds=seconds, max_batch=batch, waves=waves)


@memoized
def _best_waves(hw: HardwareProfile, arch: ModelArch, tp: int, pp: int, where: SetShape, sequences: int,
                max_batch: int, prompt_len: int, response_len: int, *, memo: CostMemo | None = None
                ) -> tuple[float, int, int]:
    """(seconds, waves, largest wave) of the fastest split of `sequences` into equal waves of at most
    max_batch each."""
    best = (math.inf, 0, 0)
    for waves in sorted({-(-sequences // size) for size in range(1, max_batch + 1)}):
        small, bigger = divmod(sequences, waves)  # `bigger` waves of small + 1, the rest of small
        seconds = bigger * wave_time(hw, arch, tp, pp, where, small + 1, prompt_len, response_len, memo=memo)
        if small:
            seconds += (waves - bigger) * wave_time(hw, arch, tp, pp, where, small, prompt_len, response_len,
                                                    memo=memo)
        if seconds < best[0]:
            best = (seconds, waves, small + (1 if bigger else 0))
    return best


@memoized
def transition_time(hw: HardwareProfile, arch: ModelArch, train: TrainConfig, gen: GenConfig,
                    where: SetShape, *, memo: CostMemo | None = None) -> float:
    """Training layout -> generation layout: an all-gather of each GPU's generation shard among the
    GPUs holding its pieces (adjacent ranks). Going back is free: the generation copy is dropped."""
    plan = resharding(train, gen)
    if plan.group <= 1:
        return 0.0
    group = coll.grid_group(list(plan.dims), where.per_node)
    return coll.all_gather(hw, group, hw.compute.value_bytes * arch.params("lm") * plan.gen_fraction)


def weight_sync_time(hw: HardwareProfile, arch: ModelArch, gen: GenConfig, rollout: SetShape,
                     same_node: bool) -> float:
    """Separate generation engine: every rollout GPU receives its generation shard of the freshly
    trained weights; the receiving node's links carry the shards of all its GPUs."""
    shard_bytes = hw.compute.value_bytes * arch.params("lm") / (gen.tp * gen.pp)
    node_bytes = shard_bytes * rollout.per_node
    if same_node:
        return coll.point_to_point(hw, shard_bytes, same_node=True)
    return coll.point_to_point(hw, node_bytes, same_node=False)
