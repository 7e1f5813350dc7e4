"""The search space: placements (set partitions of the roles), GPU allocations of the colocated sets,
and the parallel layouts of one role on A GPUs."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import get_args

from hfplan.layout import (
    ROLLOUT,
    micro_batch_sizes,
    model_role,
    nesting_problem,
    unsupported_layout,
    unsupported_role,
    unsupported_split,
)
from hfplan.plan import GenConfig, InferConfig, Layout, Recompute, RoleParallelism, TrainConfig, engine_problem
from hfplan.profiles.models import ModelArch
from hfplan.spec import TRAINED_ROLES, Workload

BATCHING: tuple[str, ...] = get_args(GenConfig.model_fields["batching"].annotation)  # static, continuous
KV_CACHES: tuple[str, ...] = get_args(GenConfig.model_fields["kv_cache"].annotation)  # reserved, paged
# rollout engines: each batching with each KV-cache allocation that goes with it
ENGINES: tuple[tuple[str, str], ...] = tuple((b, kv) for b in BATCHING for kv in KV_CACHES if not engine_problem(b, kv))


def set_partitions(items: Sequence[str]) -> list[tuple[tuple[str, ...], ...]]:
    """Every way to split `items` into non-empty colocated sets (Bell-number many), each set and the
    sets themselves in the order of `items`."""
    items = list(items)
    if not items:
        return [()]
    first, rest = items[0], items[1:]
    out = []
    for partition in set_partitions(rest):
        out.append(((first,), *partition))
        for i in range(len(partition)):
            # `first` leads the set it joins, and that set now comes first
            out.append(((first, *partition[i]), *partition[:i], *partition[i + 1:]))
    return sorted(out, key=lambda p: (len(p), p))


def powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def set_sizes(gpus: int, gpus_per_node: int) -> list[int]:
    """GPU counts a colocated set may get: powers of two inside one node, or whole nodes."""
    sub_node = powers_of_two(gpus_per_node - 1)
    whole = [gpus_per_node * n for n in range(1, gpus // gpus_per_node + 1)]
    return [s for s in sub_node + whole if s <= gpus]


def allocations(sets: int, gpus: int, gpus_per_node: int, powers_only: bool = False, idle: bool = False
                ) -> Iterator[tuple[int, ...]]:
    """GPU counts for `sets` colocated sets using all `gpus` GPUs, or with `idle` at most `gpus` (the rest
    stay idle, so a larger cluster holds every allocation of a smaller one). Sets smaller than a node are
    powers of two, so laid out largest first each starts at a multiple of its size and never straddles a
    node boundary; a remainder of gpus_per_node forms a partial last node."""
    sizes = set_sizes(gpus, gpus_per_node)
    if powers_only:
        sizes = [s for s in sizes if s & (s - 1) == 0]

    def rec(k: int, left: int) -> Iterator[tuple[int, ...]]:
        for size in sizes:
            if size > left - (k - 1):
                break
            if k == 1:
                if idle or size == left:
                    yield (size,)
            else:
                for rest in rec(k - 1, left - size):
                    yield (size, *rest)

    yield from rec(sets, gpus)


@functools.lru_cache(maxsize=65536)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, ascending (pairs d, n // d up to the square root: a set of 32,768 GPUs asks often)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return (*small, *(n // d for d in reversed(small) if d * d != n))


def model_layouts(arch: ModelArch, gpus: int, gpus_per_node: int, kind: str) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) of a "train", "infer" or "gen" layout, tp*pp*dp = gpus: tp a power of two within a
    node, and nothing the executor cannot run (hfplan.layout.unsupported_layout)."""
    out = []
    for tp in powers_of_two(min(gpus, gpus_per_node)):
        if gpus % tp:
            continue
        for pp in divisors(gpus // tp):
            if _runs(arch, kind, tp, pp):
                out.append((tp, pp, gpus // (tp * pp)))
    return out


@functools.lru_cache(maxsize=65536)
def _runs(arch: ModelArch, kind: str, tp: int, pp: int) -> bool:
    """Whether the executor runs a plain layout of `kind` at (tp, pp): unsupported_layout asks a plain Layout (no
    shard, engine or virtual stages) nothing of dp, so one answer per (tp, pp) serves every set size (a search of
    32,768 GPUs asks of millions of layouts)."""
    return unsupported_layout(arch, kind, Layout(tp=tp, pp=pp, dp=1)) is None


def micro_batches(sequences_per_rank: int) -> list[int]:
    return powers_of_two(max(1, sequences_per_rank))


def shard_modes(tp: int, dp: int, gpus_per_node: int) -> list[tuple[str, int | None]]:
    """(shard, shard_group) of a training layout: nothing to shard on one data-parallel rank; else
    replicated, ZeRO-1, ZeRO-2, full, and hybrid sharding with each shard group filling one node
    (sharded within the node, replicated across nodes)."""
    if dp == 1:
        return [("replicated", None)]
    modes: list[tuple[str, int | None]] = [("replicated", None), ("zero1", None), ("zero2", None), ("full", None)]
    group = gpus_per_node // tp
    if 1 < group < dp and dp % group == 0:
        modes.append(("hybrid", group))
    return modes


def virtual_stage_counts(arch: ModelArch, pp: int, n_micro: int | None = None) -> list[int]:
    """Model chunks per pipeline stage: 1, and with a pipeline every count that splits each stage's layers
    into equal chunks (interleaved 1F1B, Narayanan et al. SC'21), where the step's `n_micro` micro-batches are
    a multiple of pp, as that schedule requires (section 2.2.2)."""
    if pp == 1 or arch.layers % pp or (n_micro is not None and n_micro % pp):
        return [1]
    return list(divisors(arch.layers // pp))


def train_configs(arch: ModelArch, gpus: int, gpus_per_node: int, sequences_per_step: int,
                  executable: bool = True) -> list[TrainConfig]:
    """Every training layout: (tp, pp, dp), shard mode, micro-batch, recomputation none | selective | full and
    virtual stages. executable: only what hfplan's executor runs (hfplan.layout.unsupported_layout, asked of
    each complete config); other targets run their plans on their own frameworks, and their rules choose."""
    out = []
    for tp, pp, dp in model_layouts(arch, gpus, gpus_per_node, "train"):
        if unsupported_split("train", dp, sequences_per_step):
            continue
        per_rank = -(-sequences_per_step // dp)
        for micro in micro_batches(per_rank):
            n_micro = len(micro_batch_sizes(per_rank, micro))  # the contract's split, as the executor runs it
            variants = [(recompute, v) for v in virtual_stage_counts(arch, pp, n_micro) for recompute in Recompute]
            for shard, group in shard_modes(tp, dp, gpus_per_node):
                for recompute, v in variants:
                    config = TrainConfig(tp=tp, pp=pp, dp=dp, shard=shard, shard_group=group, micro_batch=micro,
                                         recompute=recompute, virtual_stages=v)
                    if not executable or unsupported_layout(arch, "train", config) is None:
                        out.append(config)
    return out


def infer_configs(arch: ModelArch, gpus: int, gpus_per_node: int, sequences: int,
                  train: TrainConfig | None = None) -> list[InferConfig]:
    """Inference layouts; a trained role infers in its training layout, choosing only the micro-batch."""
    layouts = [(train.tp, train.pp, train.dp)] if train is not None else model_layouts(
        arch, gpus, gpus_per_node, "infer")
    return [InferConfig(tp=tp, pp=pp, dp=dp, micro_batch=micro)
            for tp, pp, dp in layouts if not unsupported_split("infer", dp, sequences)
            for micro in micro_batches(-(-sequences // dp))]


def gen_configs(arch: ModelArch, gpus: int, gpus_per_node: int, train: TrainConfig | None = None,
                prompts: int | None = None, executable: bool = True) -> list[GenConfig]:
    """Generation layouts, each with every engine (static or continuous batching, reserved or paged KV cache:
    ENGINES); for the hybrid engine they must nest with the training layout; given the prompts of an iteration,
    no more replicas than prompts. executable: only the engines hfplan's executor runs
    (hfplan.layout.unsupported_layout)."""
    out = []
    for tp, pp, dp in model_layouts(arch, gpus, gpus_per_node, "gen"):
        if prompts is not None and unsupported_split("gen", dp, prompts):
            continue
        for batching, kv_cache in ENGINES:
            gen = GenConfig(tp=tp, pp=pp, dp=dp, batching=batching, kv_cache=kv_cache)
            if train is not None and nesting_problem(train, gen):
                continue
            if not executable or unsupported_layout(arch, "gen", gen, train) is None:
                out.append(gen)
    return out


def role_strategies(workload: Workload, role: str, gpus: int, gpus_per_node: int, rollout: bool = False,
                    engines: tuple[str, ...] = ("torch",)) -> list[RoleParallelism]:
    """Every parallel strategy of one role on `gpus` GPUs that the executor runs (its pre-flight,
    hfplan.layout.unsupported_role) with the rollout `engines` (as the search's Rules.engines), unpruned: the space
    an exhaustive search multiplies out. `rollout`: a separate rollout set generates (ROLLOUT's strategies are
    generation layouts; the actor then has none)."""
    if role == ROLLOUT:
        pars = [RoleParallelism(gen=gen) for gen in gen_configs(workload.arch(model_role(workload, role)), gpus,
                                                                gpus_per_node)]
    elif role not in TRAINED_ROLES:
        pars = [RoleParallelism(infer=infer)
                for infer in infer_configs(workload.arch(role), gpus, gpus_per_node, workload.sequences)]
    else:
        arch, pars = workload.arch(role), []
        for train in train_configs(arch, gpus, gpus_per_node, workload.sequences // workload.mini_batches):
            gens = gen_configs(arch, gpus, gpus_per_node, train) if role == "actor" and not rollout else [None]
            for infer in infer_configs(arch, gpus, gpus_per_node, workload.sequences, train):
                pars.extend(RoleParallelism(train=train, infer=infer, gen=gen) for gen in gens)
    return [par for par in pars if (par.gen is None or par.gen.engine in engines)
            and unsupported_role(workload, role, par) is None]


def own_placements(workload: Workload) -> list[tuple[tuple[str, ...], ...]]:
    """hfplan's placements: every set partition of the model roles (hybrid engine), and of the model roles
    with a rollout set."""
    roles = tuple(workload.model_roles)
    return set_partitions(roles) + set_partitions((*roles, ROLLOUT))
