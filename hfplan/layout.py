"""The rules every backend shares about where things run: one home, imported by the simulator, the
planner and the executor alike (pure Python; no torch, no ray).

- Rank order of a layout. A set's ranks are numbered pipeline-major, then data-parallel, then
  tensor-parallel fastest: rank = (pp * dp_size + dp) * tp_size + tp. Tensor-parallel groups are
  adjacent ranks, data-parallel groups are strided by tp, pipeline stages are blocks of tp * dp ranks.
  torch's row-major `init_device_mesh(device, mesh_shape(layout), mesh_dim_names=MESH_DIMS)` numbers
  ranks in exactly this order.
- Generation groups: the ranks the hybrid engine gathers together when the actor switches from its
  training layout to its generation layout.
- Data movement: how a batch field reaches a call on another set (`transfer_path`).
- Routing: which role generates, which set (or the controller) runs each call, which model each
  role holds; over (workload, placement), so the search can use it without building a Plan.
- What the executor can run at all (`unsupported_layout`, `unsupported_split`), consulted by the search
  space and by the executor's pre-flight alike, so the search never returns a plan the executor refuses.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hfplan.dataflow.registry import ROLLOUT, get_algorithm, role_facts
from hfplan.dataflow.roles import RoleFacts

if TYPE_CHECKING:
    from hfplan.profiles.models import ModelArch
    from hfplan.spec import Workload

MESH_DIMS = ("pp", "dp", "tp")  # slowest to fastest
CONTROLLER = "controller"  # the role name of the controller's own steps in a traced program
ON_CONTROLLER = -1  # the set index of calls the controller runs (its steps, `rule:` rewards)


class LayoutLike(Protocol):
    tp: int
    pp: int
    dp: int


class TrainLayoutLike(LayoutLike, Protocol):
    shard: str

    def shards(self, state: str) -> int: ...


# -- rank order ---------------------------------------------------------------------------------------
def mesh_shape(layout: LayoutLike) -> tuple[int, int, int]:
    """(pp, dp, tp): the sizes of MESH_DIMS, slowest first."""
    return layout.pp, layout.dp, layout.tp


def micro_batch_sizes(sequences: int, micro_batch: int) -> tuple[int, ...]:
    """The micro-batches a rank runs its `sequences` in at the plan's `micro_batch`: the fewest equal ones of
    at most micro_batch sequences each (a pipeline's buffers take one shape per call), e.g. 6 at 4 as 3 + 3
    and 5 at 2 as five of 1. The simulator costs exactly these; every engine runs them."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    if sequences < 1:
        return ()
    count = next(n for n in range(-(-sequences // micro_batch), sequences + 1) if sequences % n == 0)
    return (sequences // count,) * count


def rank_coords(layout: LayoutLike, rank: int) -> tuple[int, int, int]:
    """(pp, dp, tp) coordinates of a rank of the set."""
    if not 0 <= rank < layout.pp * layout.dp * layout.tp:
        raise ValueError(f"rank {rank} outside a layout of {layout.pp * layout.dp * layout.tp} ranks")
    rest, tp = divmod(rank, layout.tp)
    pp, dp = divmod(rest, layout.dp)
    return pp, dp, tp


def rank_of(layout: LayoutLike, pp: int, dp: int, tp: int) -> int:
    for name, value, size in (("pp", pp, layout.pp), ("dp", dp, layout.dp), ("tp", tp, layout.tp)):
        if not 0 <= value < size:
            raise ValueError(f"{name} coordinate {value} outside 0..{size - 1}")
    return (pp * layout.dp + dp) * layout.tp + tp


def _groups_along(layout: LayoutLike, axis: int) -> list[list[int]]:
    """Ranks that differ only in the coordinate `axis` of (pp, dp, tp), one group per other coordinates."""
    shape = mesh_shape(layout)
    others = [range(n) if k != axis else range(1) for k, n in enumerate(shape)]
    groups = []
    for fixed in itertools.product(*others):
        coords = list(fixed)
        group = []
        for value in range(shape[axis]):
            coords[axis] = value
            group.append(rank_of(layout, *coords))
        groups.append(group)
    return groups


def tp_groups(layout: LayoutLike) -> list[list[int]]:
    """The tensor-parallel groups (one per pipeline stage and data-parallel rank): adjacent ranks."""
    return _groups_along(layout, 2)


def dp_groups(layout: LayoutLike) -> list[list[int]]:
    """The data-parallel groups (one per stage and tensor-parallel rank): ranks tp apart."""
    return _groups_along(layout, 1)


def pp_groups(layout: LayoutLike) -> list[list[int]]:
    """The pipelines (one per data- and tensor-parallel rank): ranks tp * dp apart."""
    return _groups_along(layout, 0)


def replica_groups(layout: LayoutLike) -> list[list[int]]:
    """The ranks holding each model replica (one group per data-parallel rank, its tp x pp ranks): a
    data-parallel dispatch sends chunk d of a batch (Batch.chunk(dp)) to group d."""
    return [[rank_of(layout, p, d, t) for p in range(layout.pp) for t in range(layout.tp)] for d in range(layout.dp)]


# -- the hybrid engine's generation groups ------------------------------------------------------------
def nests(a: int, b: int) -> bool:
    """Layout sizes nest when one divides the other (what the hybrid engine's resharding needs)."""
    return a % b == 0 or b % a == 0


def nesting_problem(train: LayoutLike, gen: LayoutLike) -> str | None:
    if nests(gen.tp, train.tp) and nests(gen.pp, train.pp):
        return None
    return (f"generation layout tp={gen.tp} pp={gen.pp} does not nest with training layout tp={train.tp} "
            f"pp={train.pp} (the hybrid engine needs one of each pair to divide the other)")


def gather_dims(train: TrainLayoutLike, gen: LayoutLike) -> tuple[tuple[int, int], ...]:
    """(factor, rank stride) along tp, pp and (sharded training) dp of the training ranks whose pieces
    make one GPU's generation shard: the rank of a group member is its first rank plus a sum of
    i_k * stride_k (0 <= i_k < factor_k). Each GPU keeps its own training shard and all-gathers the
    rest from the others (HybridFlow's zero-redundancy grouping): tp_g < tp joins tp / tp_g adjacent
    tensor-parallel ranks, pp_g < pp joins pp / pp_g consecutive stages, and sharded (FSDP) training
    joins the data-parallel peers of its weight shard group (every peer for full sharding, the group of
    consecutive data-parallel ranks for hybrid sharding)."""
    problem = nesting_problem(train, gen)
    if problem:
        raise ValueError(problem)
    dims = [(max(1, train.tp // gen.tp), 1), (max(1, train.pp // gen.pp), train.tp * train.dp)]
    if train.shards("weights") > 1:
        dims.append((train.shards("weights"), train.tp))
    return tuple(dims)


@dataclass(frozen=True)
class Resharding:
    """How much of the model one GPU holds for generation, how much of that it already holds from
    training, and the gather that brings the rest (see gather_dims)."""

    gen_fraction: float  # share of the model one GPU holds for generation
    own_fraction: float  # share of it that the GPU already holds from training
    dims: tuple[tuple[int, int], ...]  # gather_dims

    @property
    def group(self) -> int:
        """GPUs taking part in one all-gather."""
        return math.prod(f for f, _ in self.dims)

    @property
    def received_fraction(self) -> float:
        return self.gen_fraction - self.own_fraction


def resharding(train: TrainLayoutLike, gen: LayoutLike) -> Resharding:
    dims = gather_dims(train, gen)
    gen_fraction = 1.0 / (gen.tp * gen.pp)
    return Resharding(gen_fraction=gen_fraction, own_fraction=gen_fraction / math.prod(f for f, _ in dims),
                      dims=dims)


def generation_groups(train: TrainLayoutLike, gen: LayoutLike) -> list[list[int]]:
    """The all-gather groups of the switch to generation, as ranks of the training layout, each sorted,
    in order of their first rank. Every member of a group ends up with the same generation shard."""
    dims = gather_dims(train, gen)
    tp_f, pp_f = dims[0][0], dims[1][0]
    dp_f = dims[2][0] if len(dims) > 2 else 1
    groups = []
    for p0 in range(0, train.pp, pp_f):
        for d0 in range(0, train.dp, dp_f):
            for t0 in range(0, train.tp, tp_f):
                groups.append(sorted(rank_of(train, p0 + i, d0 + j, t0 + k)
                                     for i in range(pp_f) for j in range(dp_f) for k in range(tp_f)))
    return groups


def stage_params(arch: ModelArch, pp: int, head: str) -> float:
    """Parameters on the most loaded pipeline stage (before tensor-parallel division): equal blocks of
    layers, the embedding on the first stage, the final norm and the head on the last."""
    layers = math.ceil(arch.layers / pp) * arch.params_per_layer
    ends = arch.embedding_params + arch.head_params(head) + arch.hidden
    if pp == 1:
        return layers + ends
    return layers + max(arch.embedding_params, arch.head_params(head) + arch.hidden)


def uneven_stages(arch: ModelArch, pp: int, virtual_stages: int = 1) -> str | None:
    """Why a pipeline of pp ranks with `virtual_stages` stages each cannot cut the model's layers into
    pp * virtual_stages equal stages (None when it can): stage_params' rule, and the executor's split."""
    if arch.layers % pp:
        return f"pp={pp} does not divide the {arch.layers} layers of {arch.name} into equal stages"
    if virtual_stages > 1 and pp == 1:
        return f"virtual_stages={virtual_stages} with pp=1: virtual stages interleave the stages of a pipeline"
    if arch.layers % (pp * virtual_stages):
        return (f"pp={pp} x virtual_stages={virtual_stages} = {pp * virtual_stages} stages do not divide the "
                f"{arch.layers} layers of {arch.name} equally")
    return None


# -- what the executor can run ------------------------------------------------------------------------
def shape_problem(arch: ModelArch, kind: str, tp: int, pp: int, virtual_stages: int = 1) -> str | None:
    """Why a model cannot be split into tp x pp pieces for a `kind` layout at all (None when it can); the rule
    every backend shares, the simulator's `hfplan cost` included.

    Tensor parallelism splits whole heads, the MLP width and the vocabulary evenly over tp ranks (the
    executor's DTensor column / row plans). Training splits the KV heads too; inference and generation
    may instead give each rank a copy of one KV head (tp a multiple of the KV heads). A pipeline cuts the
    layers into pp equal stages, a training pipeline with virtual stages into pp * virtual_stages (rank r
    holding stages r, r + pp, ...: interleaved 1F1B)."""
    if arch.heads % tp:
        return f"tp={tp} does not divide the {arch.heads} attention heads of {arch.name}"
    if kind == "train" and arch.kv_heads % tp:
        return f"training tp={tp} does not divide the {arch.kv_heads} KV heads of {arch.name}"
    if kind != "train" and arch.kv_heads % tp and tp % arch.kv_heads:
        return (f"tp={tp} neither divides nor is a multiple of the {arch.kv_heads} KV heads of {arch.name} "
                "(inference replicates KV heads only a whole number of times)")
    if arch.ffn % tp:
        return f"tp={tp} does not divide the MLP width {arch.ffn} of {arch.name}"
    if arch.vocab % tp:
        return f"tp={tp} does not divide the vocabulary of {arch.vocab} of {arch.name} (vocabulary-parallel head)"
    return uneven_stages(arch, pp, virtual_stages)


def unsupported_layout(arch: ModelArch, kind: str, layout: LayoutLike, train: LayoutLike | None = None
                       ) -> str | None:
    """Why a layout of a model can never be run (None when it can). kind: "train", "infer" or "gen";
    `train`: the role's training layout, which a generation layout must nest with (hybrid engine).
    `shape_problem`, and the executor's limits beyond it."""
    if kind not in ("train", "infer", "gen"):
        raise ValueError(f"unknown layout kind {kind!r}")
    pp = layout.pp
    problem = shape_problem(arch, kind, layout.tp, pp, getattr(layout, "virtual_stages", 1) if kind == "train" else 1)
    if problem:
        return problem
    if kind == "gen" and pp > 1:
        return f"generation with pp={pp}: rollout engines run one pipeline stage"
    if kind == "gen" and getattr(layout, "kv_cache", "reserved") == "paged":
        return ("kv_cache=paged: the executor's torch rollout engine reserves each sequence's KV cache at its "
                "longest (paged caches are vLLM's: plans for verl or OpenRLHF)")
    if kind == "gen" and train is not None:
        return nesting_problem(train, layout)
    if kind == "train" and getattr(layout, "shard", None) in ("zero1", "zero2"):
        return (f"shard={layout.shard}: FSDP2 shards weights, gradients and optimizer states together, so the "
                "executor trains replicated, full or hybrid only (ZeRO-1/2 plans are for other targets)")
    return None


def split_rows(workload: Workload, kind: str) -> int:
    """What a layout's data-parallel ranks split: the prompts of an iteration ("gen"), its sequences
    ("infer"), the sequences of one mini-batch ("train")."""
    return {"gen": workload.batch_prompts, "infer": workload.sequences,
            "train": workload.sequences // workload.mini_batches}[kind]


def unsupported_split(kind: str, dp: int, rows: int) -> str | None:
    """Why `rows` (split_rows) cannot be split over dp data-parallel ranks (None when they can).
    Training needs equal shares: every rank runs the same micro-batches, or the collectives of FSDP
    would wait forever; inference and generation need at least one row per replica."""
    if kind == "train" and rows % dp:
        return f"the {rows} sequences of a mini-batch do not split evenly over dp={dp} data-parallel ranks"
    if kind != "train" and rows < dp:
        what = "prompts" if kind == "gen" else "sequences"
        return f"dp={dp} {kind} replicas but only {rows} {what} per iteration"
    return None


def unsupported_role(workload: Workload, role: str, par) -> str | None:
    """Why a placed role's layouts (par: train / infer / gen, each possibly None) cannot be run, naming
    the layout; None when every one can. The executor's pre-flight over a plan's parallelism."""
    arch = workload.arch(model_role(workload, role))
    for kind in ("train", "infer", "gen"):
        lay = getattr(par, kind)
        if lay is None:
            continue
        problem = (unsupported_layout(arch, kind, lay, par.train if kind == "gen" else None)
                   or unsupported_split(kind, lay.dp, split_rows(workload, kind)))
        if problem:
            return f"{role} {kind} layout: {problem}"
    return None


# -- data movement ------------------------------------------------------------------------------------
def transfer_path(src_set: int, dst_set: int) -> str:
    """How a batch field made at one place reaches a call at another (set indices; ON_CONTROLLER for
    the controller). "none": same place, the field stays where it is. "host": the controller is one
    end (its steps and rules read and write the driver's memory), so the field crosses the host link.
    "direct": between two sets, from the producer's workers to the consumer's, as Ray's object store
    moves an object between nodes; the controller passes the reference on and never fetches it."""
    if src_set == dst_set:
        return "none"
    if ON_CONTROLLER in (src_set, dst_set):
        return "host"
    return "direct"


# -- routing ------------------------------------------------------------------------------------------
def generating_role(workload: Workload) -> str:
    """The workload role that generates (and, with a separate rollout engine, whose weights it holds)."""
    return get_algorithm(workload.algorithm).generator


def generation_role(workload: Workload, placed_roles: Iterable[str]) -> str:
    """The role whose GPUs run `generate`: the rollout engine if placed, else the generating role."""
    return ROLLOUT if ROLLOUT in placed_roles else generating_role(workload)


def model_role(workload: Workload, role: str) -> str:
    """The workload role whose model `role` holds: a rollout engine holds the generating role's."""
    return generating_role(workload) if role == ROLLOUT else role


# A separate rollout engine: an untrained copy of the generating role's language model that only generates.
ROLLOUT_FACTS = RoleFacts(output="", generates=True)


def facts_of(workload: Workload, role: str) -> RoleFacts:
    """The facts of a placed role."""
    return ROLLOUT_FACTS if role == ROLLOUT else role_facts(workload.algorithm, role)


def layouts_of(workload: Workload, role: str, generator: str) -> tuple[str, ...]:
    """The layouts ("train", "infer", "gen") a placed role runs in, given the role that generates."""
    if role == ROLLOUT:
        return ("gen",)
    facts = role_facts(workload.algorithm, role)
    return (("train",) if facts.trains else ()) + ("infer",) + (("gen",) if role == generator else ())


def call_role(workload: Workload, generator: str, role: str, op: str) -> str | None:
    """The placed role whose GPUs and layout run `role.op` (None: the controller runs it, as it runs
    its own steps and `rule:` rewards). `generator`: the role that runs `generate` (generation_role)."""
    if role == CONTROLLER or role not in workload.model_roles:
        return None
    return generator if op == "generate" else role


def set_index(placement: Sequence[Sequence[str]]) -> dict[str, int]:
    """Placed role -> index of its set."""
    return {role: i for i, roles in enumerate(placement) for role in roles}


def call_set(workload: Workload, placement: Sequence[Sequence[str]], role: str, op: str) -> int:
    """Index of the set that runs `role.op`; ON_CONTROLLER for the controller's steps and rules."""
    where = set_index(placement)
    runner = call_role(workload, generation_role(workload, where), role, op)
    return ON_CONTROLLER if runner is None else where[runner]


# -- tensor-parallel shards ---------------------------------------------------------------------------
def kv_head_copies(kv_heads: int, tp: int) -> int:
    """How many times each KV head is copied before a tp-way split: tp / kv_heads when tp exceeds the KV
    heads (inference and generation give each rank a copy of the one KV head its query heads read), else 1.
    tp must divide the KV heads or be a multiple of them (unsupported_layout)."""
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tp={tp} neither divides nor is a multiple of {kv_heads} KV heads")
    return tp // kv_heads if tp > kv_heads else 1


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one of tp tensor-parallel ranks holds (and caches): kv_heads / tp, or the one copied head
    when tp exceeds them (kv_head_copies). The simulator's activation and KV-cache bytes and the executor's
    shards and caches all read this."""
    return kv_heads * kv_head_copies(kv_heads, tp) // tp
