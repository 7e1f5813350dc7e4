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

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hfplan.dataflow.registry import ROLLOUT, get_algorithm, role_facts
from hfplan.dataflow.roles import RoleFacts

if TYPE_CHECKING:
    from hfplan.profiles.models import ModelArch
    from hfplan.spec import Workload

MESH_DIMS = ("pp", "dp", "tp")  # slowest to fastest
# The most bytes one rank has in flight in a round of the hybrid engine's switch (sent and received together; a
# larger slice travels alone), and the size of a separate rollout set's weight-sync buckets: the executor cuts its
# transfers by it and the simulator prices the switch's memory with it.
SWITCH_BUCKET_BYTES = 256 << 20
CONTROLLER = "controller"  # the role name of the controller's own steps in a traced program
ON_CONTROLLER = -1  # the set index of calls the controller runs (its steps, `rule:` rewards)


class LayoutLike(Protocol):
    tp: int
    pp: int
    dp: int


class TrainLayoutLike(LayoutLike, Protocol):
    shard: str
    virtual_stages: int  # model stages per pipeline rank (interleaved 1F1B); 1 otherwise

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


def stage_layers(arch: ModelArch, pp: int) -> int:
    """Decoder layers of the most loaded of `pp` pipeline stages (equal blocks, the last ones short)."""
    return math.ceil(arch.layers / pp)


def stage_params(arch: ModelArch, pp: int, head: str) -> float:
    """Parameters on the most loaded pipeline stage (before tensor-parallel division): equal blocks of
    layers, the embedding on the first stage, the final norm and the head on the last."""
    layers = stage_layers(arch, pp) * arch.params_per_layer
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
    if kind == "gen" and getattr(layout, "engine", "torch") == "vllm" and layout.tp > 1 and (
            train is None or reshards_by_plan(train, layout)):
        return (f"engine=vllm at tp={layout.tp}: vLLM cuts whole weights over its own tensor-parallel group, so it "
                "generates in the actor's training tp and pp (hybrid engine), not from the pre-cut shards of "
                "another tp, a pipelined actor or a rollout set's weight sync")
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


def engine_max_seqs(workload: Workload, gen) -> int:
    """Sequences a generation replica runs at once (vLLM's max_num_seqs): the plan's max_batch, or the replica's
    share of an iteration's sequences."""
    return gen.max_batch or -(-workload.sequences // gen.dp)


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


def runs_on_controller(workload: Workload, role: str) -> bool:
    """Whether the controller runs `role`'s calls itself: its own steps and `rule:` rewards."""
    return role == CONTROLLER or role not in workload.model_roles


def call_role(workload: Workload, generator: str, role: str, op: str) -> str | None:
    """The placed role whose GPUs and layout run `role.op` (None: the controller runs it, as it runs
    its own steps and `rule:` rewards). `generator`: the role that runs `generate` (generation_role)."""
    if runs_on_controller(workload, role):
        return None
    return generator if op == "generate" else role


def staleness_problem(workload: Workload, placement: Sequence[Sequence[str]]) -> str | None:
    """Why a placement cannot run the workload asynchronously (None when it can, or when it runs synchronously):
    generation must have GPUs that no training uses, a rollout set holding no trained role."""
    if not workload.staleness:
        return None
    rollout = [roles for roles in placement if ROLLOUT in roles]
    if not rollout:
        return (f"workload.staleness {workload.staleness} needs a separate {ROLLOUT!r} set to generate on while the "
                "actor trains; this plan's actor generates on its own GPUs (set staleness to 0, or place the "
                "rollout engine on GPUs of its own)")
    trained = [role for role in rollout[0] if role != ROLLOUT and facts_of(workload, role).trains]
    if trained:
        return (f"workload.staleness {workload.staleness} needs generation on GPUs that no training uses; the "
                f"{ROLLOUT!r} set also holds {', '.join(trained)}, which trains")
    return None


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


# -- the hybrid engine's per-tensor resharding plan ---------------------------------------------------
# A box is a tensor's slice: one [start, end) range per dimension.
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TensorSpec:
    """One parameter as the resharding sees it. tp_dim: the dimension tensor parallelism splits (None:
    replicated on every tensor-parallel rank). layer: its decoder layer, -1 for the embedding (first
    stage), the model's layer count for the final norm and the head (last stage). count: identical tensors
    of `count` consecutive layers from `layer` on (the cost model's compressed form). kv_heads: a K or V
    projection's KV heads (a tp above them gives each rank a copy of one head, kv_head_copies); 0 otherwise."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    layer: int
    count: int = 1
    kv_heads: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Transfer:
    """A slice of one parameter that rank `src` sends rank `dst` (both ranks of the set) at the switch."""

    name: str
    src: int
    dst: int
    box: Box
    numel: int  # elements of the box, times the spec's count
    layer: int = 0  # the first layer of the spec's piece it belongs to (compressed specs span several)


def box_numel(box: Box | None) -> int:
    return 0 if box is None else math.prod(max(0, e - s) for s, e in box)


def box_meet(a: Box | None, b: Box | None) -> Box | None:
    """The intersection of two boxes (None when empty)."""
    if a is None or b is None:
        return None
    meet = tuple((max(s1, s2), min(e1, e2)) for (s1, e1), (s2, e2) in zip(a, b, strict=True))
    return meet if all(s < e for s, e in meet) else None


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk `index` of `size` rows split as torch.chunk (and DTensor's Shard) splits them."""
    step = -(-size // parts)
    return min(index * step, size), min((index + 1) * step, size)


def stage_of(layer: int, layers: int, pp: int, virtual_stages: int = 1) -> int:
    """The pipeline rank holding a decoder layer (-1: the embedding, `layers`: the final norm and head) when
    the model is cut into pp * virtual_stages stages of equal layers and rank r holds the stages r, r + pp, ..."""
    if layer < 0:
        return 0
    if layer >= layers:
        return pp - 1
    return (layer // -(-layers // (pp * virtual_stages))) % pp


def _stage_pieces(spec: TensorSpec, layers: int, cuts_into: Sequence[int]) -> list[TensorSpec]:
    """`spec` cut where a stage of any of the given model cuts (stage counts) starts: each piece lies on one
    stage of each."""
    cuts = {spec.layer, spec.layer + spec.count}
    for stages in cuts_into:
        step = -(-layers // stages)
        cuts |= {b for b in range(step, layers, step) if spec.layer < b < spec.layer + spec.count}
    edges = sorted(cuts)
    return [TensorSpec(spec.name, spec.shape, spec.tp_dim, a, b - a, spec.kv_heads)
            for a, b in itertools.pairwise(edges)]


def _tp_range(spec: TensorSpec, tp: int, index: int) -> tuple[int, int]:
    size = spec.shape[spec.tp_dim]
    if spec.kv_heads and tp > spec.kv_heads:
        return chunk_range(size, spec.kv_heads, index // kv_head_copies(spec.kv_heads, tp))
    return chunk_range(size, tp, index)


def training_box(train: TrainLayoutLike, spec: TensorSpec, rank: int) -> Box:
    """A training rank's slice of a parameter, its stage aside: the tensor-parallel chunk along tp_dim, then
    (sharded training) FSDP's chunk of dim 0 of that, by the rank's place in its weight-shard group."""
    _, dp, tp = rank_coords(train, rank)
    shards = train.shards("weights")
    return _shard_box(spec, train.tp, tp, shards, dp % shards)


def _shard_box(spec: TensorSpec, tp_size: int, tp: int, shards: int, chunk: int) -> Box:
    """training_box of the rank at tensor-parallel coordinate `tp` of `tp_size` holding FSDP chunk `chunk` of
    `shards`: all a rank's slice depends on."""
    box = [(0, n) for n in spec.shape]
    if spec.tp_dim is not None and tp_size > 1:
        box[spec.tp_dim] = _tp_range(spec, tp_size, tp)
    if shards > 1 and spec.shape:
        start, end = box[0]
        lo, hi = chunk_range(end - start, shards, chunk)
        box[0] = (start + lo, start + hi)
    return tuple(box)


@dataclass(frozen=True)
class GenerationPlace:
    """Where a training rank sits in the generation layout: (pp, dp, tp) coordinates of gen."""

    pp: int
    dp: int
    tp: int


def generation_places(train: TrainLayoutLike, gen: LayoutLike) -> list[GenerationPlace]:
    """Each training rank's place in the generation layout, by rank. The training ranks holding pieces of
    one coarse shard (the generation shard where generation splits no finer than training) become its
    generation replicas, so the shard they gather is made of their own training pieces: with training
    tp 4, dp 2 on 8 GPUs and generation tp 2, the groups [0,1] [2,3] [4,5] [6,7] gather and the generation
    tensor-parallel groups are [0,2] [1,3] [4,6] [5,7]. Where generation splits finer (tp_g > tp or
    pp_g > pp), those ranks take the coarse shard's k sub-shards in consecutive blocks ordered by their FSDP
    chunk, so a rank's sub-shard lies where its own chunk of dim 0 does (column-split tensors then need
    nothing from the peers)."""
    k_tp, k_pp = max(1, gen.tp // train.tp), max(1, gen.pp // train.pp)
    f_tp, f_pp = max(1, train.tp // gen.tp), max(1, train.pp // gen.pp)
    shards = train.shards("weights")
    classes: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for rank in range(train.pp * train.dp * train.tp):
        pp, dp, tp = rank_coords(train, rank)
        chunk = dp % shards if k_tp * k_pp > 1 else 0  # only a finer split picks by the FSDP chunk
        classes.setdefault((pp // f_pp, tp // f_tp), []).append((chunk, dp, pp, rank))
    places: dict[int, GenerationPlace] = {}
    for (pp_c, tp_c), members in classes.items():
        block = len(members) // (k_tp * k_pp)
        for j, (*_, rank) in enumerate(sorted(members)):
            sub, dp = divmod(j, block)
            places[rank] = GenerationPlace(pp=pp_c * k_pp + sub // k_tp, dp=dp, tp=tp_c * k_tp + sub % k_tp)
    return [places[r] for r in range(len(places))]


def reshards_by_plan(train: TrainLayoutLike | None, gen: LayoutLike | None) -> bool:
    """Whether a hybrid actor's switch builds its generation shards by the per-tensor plan (another tp, or
    pipelined training: generation runs pp = 1); otherwise it generates in the training layout, its weights
    unsharded by the training engine (FSDP2's all-gathers where it trains through FSDP2)."""
    return train is not None and gen is not None and (train.pp != gen.pp or gen.tp != train.tp)


def generation_ranks(train: TrainLayoutLike, gen: LayoutLike) -> list[int]:
    """Each training rank's rank in the generation layout's own order (rank_of its generation place), by
    training rank: the identity where generation keeps the training tp and pp."""
    return [rank_of(gen, p.pp, p.dp, p.tp) for p in generation_places(train, gen)]


def generation_box(gen: LayoutLike, spec: TensorSpec, place: GenerationPlace) -> Box:
    box = [(0, n) for n in spec.shape]
    if spec.tp_dim is not None and gen.tp > 1:
        box[spec.tp_dim] = _tp_range(spec, gen.tp, place.tp)
    return tuple(box)


def _placed_pieces(train: TrainLayoutLike, gen: LayoutLike, specs: Sequence[TensorSpec], layers: int
                   ) -> list[tuple[TensorSpec, int, int]]:
    """(piece, its training pipeline rank, its generation stage) of every spec cut at both models' stage starts."""
    virtual = train.virtual_stages
    return [(p, stage_of(p.layer, layers, train.pp, virtual), stage_of(p.layer, layers, gen.pp))
            for spec in specs for p in _stage_pieces(spec, layers, (train.pp * virtual, gen.pp))]


def received_numel(train: TrainLayoutLike, gen: LayoutLike, specs: Sequence[TensorSpec], layers: int,
                   places: Sequence[GenerationPlace] | None = None) -> list[int]:
    """Elements each training rank receives at the switch to generation: its generation shard less what its
    training shard already holds of it (reshard_transfers says from whom; the simulator prices these).
    Counted once per kind of rank (_KindCounts): a rank's count depends only on its training stage, tp coordinate
    and FSDP chunk (training_box) and its generation stage and tp coordinate (generation_box), given the layouts'
    tp, stages and weight shards; never on their data-parallel sizes, so layouts alike in those share the counts
    whatever their set size."""
    return _per_rank(train, gen, specs, layers, places, _KindCounts.count)


def new_numel(train: TrainLayoutLike, gen: LayoutLike, specs: Sequence[TensorSpec], layers: int,
              keeps_own: bool) -> list[int]:
    """Elements of the new tensors each training rank's switch makes (by rank): its generation shard, less the
    parameters whose training tensor it keeps as their generation shard (keeps_own_tensor) where keeps_own (the
    training tensors are in the generation dtype). Counted by kind of rank, as received_numel."""
    return _per_rank(train, gen, specs, layers, None, _KindCounts.count_new if keeps_own else _KindCounts.count_shard)


def _per_rank(train: TrainLayoutLike, gen: LayoutLike, specs: Sequence[TensorSpec], layers: int,
              places: Sequence[GenerationPlace] | None, count: Callable[..., int]) -> list[int]:
    """`count` (a _KindCounts method) of every training rank, by rank."""
    places = places if places is not None else generation_places(train, gen)
    shards = train.shards("weights")
    counts = _kind_counts(tuple(specs), layers, train.tp, train.pp, train.virtual_stages, shards, gen.tp, gen.pp)
    out = []
    for rank, place in enumerate(places):
        stage, dp, tp = rank_coords(train, rank)
        out.append(count(counts, stage, tp, dp % shards, place.pp, place.tp))
    return out


def keeps_own_tensor(need: Box, held: Box | None) -> bool:
    """Whether a rank's generation shard of a parameter can be its training tensor itself (the switch makes no new
    tensor for it, engines.reshard.generation_shards): the rank trains exactly that slice on its own stage (held:
    None where the parameter is on another stage). The caller asks the dtype too: the training tensor must be in the
    generation dtype (new_numel's keeps_own)."""
    return held is not None and need == held


class _KindCounts:
    """received_numel's and new_numel's counts of each kind of rank for one shape of the switch: the layouts' tp,
    stages and weight shards (the parameters cut at both models' stage starts, and pieces alike in shape, split and
    stages, whatever their name or layer, added up as one with their counts summed)."""

    def __init__(self, specs: tuple[TensorSpec, ...], layers: int, train_tp: int, train_pp: int, virtual: int,
                 shards: int, gen_tp: int, gen_pp: int) -> None:
        self.train_tp, self.shards, self.gen = train_tp, shards, _Sizes(gen_tp, gen_pp, 1)
        stages = SwitchLayout(train_tp, train_pp, 1, virtual, shards)
        self.alike: dict[tuple, int] = {}
        for piece, train_stage, gen_stage in _placed_pieces(stages, self.gen, specs, layers):
            key = (TensorSpec("", piece.shape, piece.tp_dim, 0, 1, piece.kv_heads), train_stage, gen_stage)
            self.alike[key] = self.alike.get(key, 0) + piece.count
        self._by_stages: dict[tuple[int, int], list[tuple[TensorSpec, int]]] = {}  # (training, generation stage)
        for (piece, train_stage, gen_stage), count in self.alike.items():
            self._by_stages.setdefault((train_stage, gen_stage), []).append((piece, count))
        self._needed: dict[tuple[int, int], int] = {}  # (generation stage, tp coordinate) -> elements of the shard
        self._held: dict[tuple[int, int, int, int, bool], np.ndarray] = {}
        self._piece_held: dict[tuple[TensorSpec, int, int, bool], np.ndarray] = {}  # (piece, tp, generation tp, kept)

    def count(self, stage: int, tp: int, chunk: int, gen_stage: int, gen_tp: int) -> int:
        """Elements a rank at training (stage, tp, FSDP chunk) and generation (stage, tp) receives."""
        return self._needed_numel(gen_stage, gen_tp) - int(self._by_chunk(stage, tp, gen_stage, gen_tp, False)[chunk])

    def count_new(self, stage: int, tp: int, chunk: int, gen_stage: int, gen_tp: int) -> int:
        """Elements of the new tensors such a rank's switch makes: its generation shard less the tensors it keeps
        (keeps_own_tensor)."""
        return self._needed_numel(gen_stage, gen_tp) - int(self._by_chunk(stage, tp, gen_stage, gen_tp, True)[chunk])

    def count_shard(self, stage: int, tp: int, chunk: int, gen_stage: int, gen_tp: int) -> int:
        """Elements of such a rank's whole generation shard."""
        return self._needed_numel(gen_stage, gen_tp)

    def _needed_numel(self, gen_stage: int, gen_tp: int) -> int:
        shard = (gen_stage, gen_tp)
        if shard not in self._needed:
            place = GenerationPlace(gen_stage, 0, gen_tp)
            self._needed[shard] = sum(box_numel(generation_box(self.gen, piece, place)) * count
                                      for (piece, _, g), count in self.alike.items() if g == gen_stage)
        return self._needed[shard]

    def _by_chunk(self, stage: int, tp: int, gen_stage: int, gen_tp: int, kept: bool) -> np.ndarray:
        """For each FSDP chunk: the elements of its generation shard that a rank at training (stage, tp) and
        generation (gen_stage, gen_tp) holds already (kept: in tensors it keeps whole), summed over the pieces of
        those stages (_piece_held: the same at every stage, so pieces alike in shape across stages are met once)."""
        key = (stage, tp, gen_stage, gen_tp, kept)
        if key in self._held:
            return self._held[key]
        held = np.zeros(self.shards, dtype=np.int64)
        for piece, count in self._by_stages.get((stage, gen_stage), ()):
            piece_key = (piece, tp, gen_tp, kept)
            if piece_key not in self._piece_held:
                self._piece_held[piece_key] = self._meet_by_chunk(piece, tp, gen_tp, kept)
            held += self._piece_held[piece_key] * count
        self._held[key] = held
        return held

    def _meet_by_chunk(self, piece: TensorSpec, tp: int, gen_tp: int, kept: bool) -> np.ndarray:
        """For each FSDP chunk: the size of the meet of one piece's generation_box at generation tp coordinate
        `gen_tp` and its training_box at tp coordinate `tp` (only dim 0 of the training box depends on the chunk);
        kept: only where the two boxes are the same (keeps_own_tensor), else 0."""
        if not piece.shape:
            return np.ones(self.shards, dtype=np.int64)
        need = generation_box(self.gen, piece, GenerationPlace(0, 0, gen_tp))
        have = _shard_box(piece, self.train_tp, tp, 1, 0)  # before FSDP's chunk of dim 0
        other = math.prod(max(0, min(e1, e2) - max(s1, s2)) for (s1, e1), (s2, e2) in zip(need[1:], have[1:],
                                                                                          strict=True))
        start, end = have[0]
        if self.shards > 1:  # chunk_range of every chunk
            chunks = np.arange(self.shards, dtype=np.int64)
            step = -(-(end - start) // self.shards)
            lo = start + np.minimum(chunks * step, end - start)
            hi = start + np.minimum((chunks + 1) * step, end - start)
        else:
            lo, hi = np.array([start]), np.array([end])
        meet = np.maximum(0, np.minimum(hi, need[0][1]) - np.maximum(lo, need[0][0])) * other
        if not kept:
            return meet
        if need[1:] != have[1:]:
            return np.zeros_like(meet)
        return np.where((lo == need[0][0]) & (hi == need[0][1]), meet, 0)


@functools.lru_cache(maxsize=1024)
def _kind_counts(specs: tuple[TensorSpec, ...], layers: int, train_tp: int, train_pp: int, virtual: int,
                 shards: int, gen_tp: int, gen_pp: int) -> _KindCounts:
    return _KindCounts(specs, layers, train_tp, train_pp, virtual, shards, gen_tp, gen_pp)


def reshard_transfers(train: TrainLayoutLike, gen: LayoutLike, specs: Sequence[TensorSpec], layers: int,
                      receiver: int | None = None) -> list[Transfer]:
    """Every slice sent at the switch to generation (only those `receiver` gets, if given): each rank keeps
    what it holds of its generation shard and receives the rest from the members of its generation group,
    each missing slice from the first member (in group order) holding it, so every needed slice arrives
    once. Raises ValueError where the group does not hold a needed slice (shapes that do not split evenly)."""
    places = generation_places(train, gen)
    group_of = {r: g for g in generation_groups(train, gen) for r in g}
    ranks = range(len(places)) if receiver is None else [receiver]
    out: list[Transfer] = []
    for piece_spec, stage, gen_stage in _placed_pieces(train, gen, specs, layers):
        for dst in ranks:
            if places[dst].pp != gen_stage:
                continue
            need = generation_box(gen, piece_spec, places[dst])
            own = box_meet(need, training_box(train, piece_spec, dst)) if rank_coords(train, dst)[0] == stage else None
            have = [own] if own is not None else []
            for src in group_of[dst]:
                if src == dst or rank_coords(train, src)[0] != stage:
                    continue
                piece = box_meet(need, training_box(train, piece_spec, src))
                if piece is not None and piece not in have:
                    have.append(piece)
                    out.append(Transfer(piece_spec.name, src, dst, piece, box_numel(piece) * piece_spec.count,
                                        piece_spec.layer))
            if sum(box_numel(b) for b in have) != box_numel(need):
                raise ValueError(f"{piece_spec.name}: the generation group {group_of[dst]} does not hold rank "
                                 f"{dst}'s generation slice (a dimension that does not split evenly)")
    return out


def sync_transfers(train: TrainLayoutLike, gen: LayoutLike, specs: Sequence[TensorSpec], layers: int
                   ) -> list[Transfer]:
    """A separate rollout set's weight sync: every rollout rank (dst, in gen's own rank order) receives exactly
    its generation shard, each slice once, from a training rank (src) holding it; the holders of one slice
    (data-parallel replicas) take the rollout ranks in turn."""
    out: list[Transfer] = []
    for piece, stage, gen_stage in _placed_pieces(train, gen, specs, layers):
        holders: dict[Box, list[int]] = {}
        for src in range(train.pp * train.dp * train.tp):
            if rank_coords(train, src)[0] == stage:
                holders.setdefault(training_box(train, piece, src), []).append(src)
        for dst in range(gen.pp * gen.dp * gen.tp):
            place = GenerationPlace(*rank_coords(gen, dst))
            if place.pp != gen_stage:
                continue
            need = generation_box(gen, piece, place)
            for box, ranks in holders.items():
                part = box_meet(need, box)
                if part is not None:
                    out.append(Transfer(piece.name, ranks[dst % len(ranks)], dst, part, box_numel(part) * piece.count,
                                        piece.layer))
    return out


def generation_numel(gen: LayoutLike, specs: Sequence[TensorSpec], layers: int, place: GenerationPlace) -> int:
    """Elements of one GPU's generation shard (the most the switch makes: M / (tp_g * pp_g) when every tensor
    splits evenly)."""
    return sum(box_numel(generation_box(gen, p, place)) * p.count
               for spec in specs for p in _stage_pieces(spec, layers, (gen.pp,))
               if stage_of(p.layer, layers, gen.pp) == place.pp)


def arch_specs(arch: ModelArch) -> list[TensorSpec]:
    """The language model's parameters as the executor's tensor-parallel plan splits them (column-parallel
    q, k, v, gate, up, embedding and head along dim 0; row-parallel o and down along dim 1; norms
    replicated), each kind of layer tensor once with count = the layers."""
    h, n = arch.hidden, arch.layers
    layer = [("q_proj", (arch.q_dim, h), 0, 0), ("k_proj", (arch.kv_dim, h), 0, arch.kv_heads),
             ("v_proj", (arch.kv_dim, h), 0, arch.kv_heads), ("o_proj", (h, arch.q_dim), 1, 0)]
    layer += [("gate_proj", (arch.ffn, h), 0, 0)] if arch.mlp == "swiglu" else []
    layer += [("up_proj", (arch.ffn, h), 0, 0), ("down_proj", (h, arch.ffn), 1, 0)]
    if arch.attention_bias:
        layer += [("q_bias", (arch.q_dim,), 0, 0), ("k_bias", (arch.kv_dim,), 0, arch.kv_heads),
                  ("v_bias", (arch.kv_dim,), 0, arch.kv_heads)]
    layer += [("input_norm", (h,), None, 0), ("post_norm", (h,), None, 0)]
    specs = [TensorSpec(f"layers.{name}", shape, dim, 0, n, kv) for name, shape, dim, kv in layer]
    specs += [TensorSpec("embed", (arch.vocab, h), 0, -1), TensorSpec("norm", (h,), None, n)]
    if not arch.tied_embeddings:
        specs.append(TensorSpec("head", (arch.vocab, h), 0, n))
    return specs


FP32_BYTES = 4


def trains_through_fsdp(data_parallel: int, compute_bytes: int) -> bool:
    """Whether the training engine wraps a trained role in FSDP2: over more than one data-parallel rank, or to
    compute in a precision below its fp32 master weights. One rank in fp32 trains the module as it is (FSDP
    would only copy gradients through collectives of one rank), and its passes and optimizer steps cost less."""
    return data_parallel > 1 or compute_bytes != FP32_BYTES


def keeps_trained_tensors(train: TrainLayoutLike, gen: LayoutLike, compute_bytes: int) -> bool:
    """Whether a hybrid actor generates with the very tensors it trains (executor.engines.hybrid keeps its
    generation module on them): in its training layout, not split by tp, trained as it is (no FSDP2)."""
    return (not reshards_by_plan(train, gen) and train.tp == 1
            and not trains_through_fsdp(train.dp, compute_bytes))


@functools.lru_cache(maxsize=4096)
def stage_parameter_tensors(arch: ModelArch, pp: int, head: str) -> int:
    """Parameter tensors of the busiest of pp pipeline stages (each GPU of a stage holds a piece of every one):
    what a training step's per-tensor work (zeroing, clipping, the optimizer's update) runs over. The embedding
    is on the first stage; the final norm and the head on the last: an untied LM head's weight, or a scalar
    head's weight and bias (the executor's value and score heads have one)."""
    per_layer = sum(1 for spec in arch_specs(arch) if spec.count == arch.layers and 0 <= spec.layer < arch.layers)
    step = -(-arch.layers // pp)
    head_tensors = 1 + (2 if head == "scalar" else int(not arch.tied_embeddings))
    return max(per_layer * max(0, min((stage + 1) * step, arch.layers) - stage * step)
               + (stage == 0) + (head_tensors if stage == pp - 1 else 0) for stage in range(pp))


def most_received_numel(arch: ModelArch, train: TrainLayoutLike, gen: LayoutLike) -> int:
    """The most parameters any GPU receives at the switch to generation (received_numel over arch_specs):
    what the simulator's transition cost prices, and switch_round_bytes' bound reads. Cached by what the plan reads
    of the layouts (SwitchLayout, and gen's sizes), so training configs differing only in micro-batch,
    recomputation or the sharding of other states share one count."""
    return _most_received_numel(arch, SwitchLayout.of(train), (gen.tp, gen.pp, gen.dp))


def most_new_numel(arch: ModelArch, train: TrainLayoutLike, gen: LayoutLike, keeps_own: bool) -> int:
    """The most elements of new tensors any GPU's switch to generation makes (new_numel over arch_specs): what the
    simulator's generation memory prices, beside one round of transfers (switch_round_bytes)."""
    return _most_new_numel(arch, SwitchLayout.of(train), (gen.tp, gen.pp, gen.dp), keeps_own)


@functools.lru_cache(maxsize=4096)
def _most_new_numel(arch: ModelArch, train: SwitchLayout, gen: tuple[int, int, int], keeps_own: bool) -> int:
    sizes = _Sizes(*gen)
    counts = _kind_counts(tuple(arch_specs(arch)), arch.layers, train.tp, train.pp, train.virtual_stages,
                          train.weight_shards, sizes.tp, sizes.pp)
    count = counts.count_new if keeps_own else counts.count_shard
    return max(count(*(int(x) for x in kind)) for kind in _rank_kinds(train, sizes))


def switch_round_bytes(arch: ModelArch, train: TrainLayoutLike, gen: LayoutLike, value_bytes: int) -> int:
    """A bound on the bytes one GPU holds in flight in a round of its switch (sent and received buffers together):
    a round holds at most SWITCH_BUCKET_BYTES of a rank's transfers, or one slice larger than that alone
    (engines.reshard's rounds), and never more than all the rank sends and receives: at most what the busiest GPU
    receives, plus its training shard sent to each other member of its generation group (a pipeline stage's
    layers go to every other stage's rank). A slice is a piece of one tensor, at most that tensor split by the
    coarser of the two tensor-parallel layouts."""
    total, largest = _switch_traffic(arch, SwitchLayout.of(train), (gen.tp, gen.pp, gen.dp))
    return min(value_bytes * total, max(SWITCH_BUCKET_BYTES, value_bytes * largest))


@functools.lru_cache(maxsize=4096)
def _switch_traffic(arch: ModelArch, train: SwitchLayout, gen: tuple[int, int, int]) -> tuple[int, int]:
    """(a bound on the elements one GPU sends and receives in all, elements of its largest slice)."""
    tp = min(train.tp, gen[0])
    largest = max(spec.numel // (tp if spec.tp_dim is not None else 1) for spec in arch_specs(arch))
    group = resharding(train, _Sizes(*gen)).group
    return _most_received_numel(arch, train, gen) + (group - 1) * _most_held_numel(arch, train), largest


def _most_held_numel(arch: ModelArch, train: SwitchLayout) -> int:
    """The most elements any rank's training shard holds (training_box over arch_specs, on its pipeline rank's
    stages): FSDP's first chunk of each tensor is its largest, so chunk 0 of every tp coordinate and stage."""
    held = [[0] * train.tp for _ in range(train.pp)]
    for spec in arch_specs(arch):
        for piece in _stage_pieces(spec, arch.layers, (train.pp * train.virtual_stages,)):
            stage = stage_of(piece.layer, arch.layers, train.pp, train.virtual_stages)
            for tp in range(train.tp):
                held[stage][tp] += box_numel(_shard_box(piece, train.tp, tp, train.weight_shards, 0)) * piece.count
    return max(max(row) for row in held)


@dataclass(frozen=True)
class SwitchLayout:
    """What the switch's per-tensor plan reads of a training layout: its sizes, its stages per pipeline rank and
    how many pieces its weights are sharded into (received_numel, generation_places)."""

    tp: int
    pp: int
    dp: int
    virtual_stages: int
    weight_shards: int

    @classmethod
    def of(cls, train: TrainLayoutLike) -> SwitchLayout:
        return cls(train.tp, train.pp, train.dp, train.virtual_stages, train.shards("weights"))

    def shards(self, state: str) -> int:
        return self.weight_shards if state == "weights" else 1


@dataclass(frozen=True)
class _Sizes:
    tp: int
    pp: int
    dp: int


@functools.lru_cache(maxsize=4096)
def _most_received_numel(arch: ModelArch, train: SwitchLayout, gen: tuple[int, int, int]) -> int:
    """max(received_numel(...)), counted once per kind of rank that occurs (_rank_kinds)."""
    sizes = _Sizes(*gen)
    counts = _kind_counts(tuple(arch_specs(arch)), arch.layers, train.tp, train.pp, train.virtual_stages,
                          train.weight_shards, sizes.tp, sizes.pp)
    return max(counts.count(*(int(x) for x in kind)) for kind in _rank_kinds(train, sizes))


def _rank_kinds(train: TrainLayoutLike, gen: LayoutLike) -> np.ndarray:
    """The kinds of rank received_numel counts, each once: rows (training stage, tp coordinate, FSDP chunk,
    generation stage, generation tp coordinate) over every training rank, its place as generation_places gives it
    (the same rule, on arrays: within each class of ranks gathering one coarse shard, the members in order of
    (chunk, dp, pp, rank), the j-th taking sub-shard j // (members / sub-shards))."""
    k_tp, k_pp = max(1, gen.tp // train.tp), max(1, gen.pp // train.pp)
    f_tp, f_pp = max(1, train.tp // gen.tp), max(1, train.pp // gen.pp)
    shards = train.shards("weights")
    rank = np.arange(train.pp * train.dp * train.tp, dtype=np.int64)
    rest, tp = np.divmod(rank, train.tp)
    pp, dp = np.divmod(rest, train.dp)
    chunk = dp % shards
    pp_c, tp_c = pp // f_pp, tp // f_tp
    if k_tp * k_pp > 1:
        klass = pp_c * (train.tp // f_tp + 1) + tp_c
        order = np.lexsort((rank, pp, dp, chunk, klass))  # the last key sorts first
        members = np.bincount(klass)
        start = np.cumsum(members) - members
        j = np.empty_like(rank)
        j[order] = np.arange(len(rank)) - start[klass[order]]
        sub = j // (members[klass] // (k_tp * k_pp))
    else:
        sub = np.zeros_like(rank)
    kinds = np.stack([pp, tp, chunk, pp_c * k_pp + sub // k_tp, tp_c * k_tp + sub % k_tp], axis=1)
    return np.unique(kinds, axis=0)


def most_generation_numel(arch: ModelArch, gen: LayoutLike) -> int:
    """The most parameters one GPU of a generation layout holds (generation_numel over arch_specs, in gen's own
    rank order): what a separate rollout set's weight sync sends each of its GPUs (sync_transfers). A shard
    depends on its rank's pipeline stage and tp coordinate alone (generation_box), so one replica's ranks say it."""
    return _most_generation_numel(arch, gen.tp, gen.pp)


@functools.lru_cache(maxsize=4096)
def _most_generation_numel(arch: ModelArch, tp: int, pp: int) -> int:
    gen, specs = _Sizes(tp, pp, 1), arch_specs(arch)
    return max(generation_numel(gen, specs, arch.layers, GenerationPlace(stage, 0, rank))
               for stage in range(pp) for rank in range(tp))
