"""Bytes, memory and seconds of the hybrid engine's switch to generation beside two whole-model references.

A tiny Llama trains on a gloo world of 4 or 8 CPU processes in a grid of training layouts (tensor-parallel,
FSDP-sharded, pipelined, and mixes of them) and switches to a generation layout of another tp (generation pp is
always 1). Three ways to build every rank's generation shard, each from the same training shards
(RoleModel.local_parameters) on the same world:

- engine: the hybrid engine as built (HybridEngine.enter_generation: engines.reshard's per-tensor plan, point to
  point in buckets of --bucket-mb).
- world: the vanilla way (DeepSpeed-Chat's): every rank all-gathers every parameter whole over the whole world,
  then cuts its generation shard out of the whole model.
- group: HybridFlow-V's way: FSDP first unshards each rank's tensor-parallel slice over its shard group (sharded
  training only), then every rank all-gathers the whole model from its model-parallel group (the tp x pp ranks
  of one replica) and cuts its generation shard.

The references gather in buckets of --bucket-mb as well: each rank packs its slices flat (a stage's k-th layer
beside every other stage's, so the buckets line up), zero-padded to the largest member's, one
`all_gather_single` a bucket; their "expect" column is that rule's count from the layout alone.

Bytes are counted by wrapping torch.distributed's calls in each rank process while a method runs (received:
what arrives from peers; sent: what leaves for them; the padding is on the wire, so it counts); any other
collective called meanwhile is reported as uncounted. Peak is the most bytes of tensors a method holds at once
beyond the training shards: the engine's own SwitchStats.peak (the generation shards it makes, those it keeps from
training aside, plus the buckets in flight);
for a reference, its allocations as it makes them (the whole model, the bucket buffers, FSDP's unsharded
slices, the generation shards it cuts). Seconds: the median of --reps switches after the counted one, a barrier
before each, the slowest rank's.

Beside them: the plan's figures (hfplan.layout received_numel and generation_numel, what the simulator's
transition cost prices) and HybridFlow's Table 2: (tp*pp - tp_g*pp_g) / (tp_g*pp_g*tp*pp) * M received and
M / (tp_g*pp_g) held. Table 2 assumes every tensor splits over tp and unsharded training shards: the norms are
replicated, so the plan differs a little, and with FSDP (marked *) each rank holds only a 1/dp chunk of its
slice, so it receives more. Prints `mismatch` and exits 1 if the engine's bytes differ from the plan's (or from
its own SwitchStats), the tensors it makes differ from the plan's (hfplan.layout.new_numel: in fp32 it keeps a
trained tensor that is already its generation shard), its peak exceeds those plus one bucket (what it has in
flight a round, sent and received together), a reference's bytes differ from its expected count, a collective
went uncounted, or any method's shards differ from the world gather's.

    PYTHONPATH=. python bench/reshard.py [--quick] [--bucket-mb MB] [--reps N]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from hfplan.executor.engines.hybrid import HybridEngine
from hfplan.executor.engines.reshard import box_view, local_tensor, model_specs
from hfplan.executor.engines.training import RoleModel
from hfplan.executor.loopback import gloo_on_loopback
from hfplan.executor.mesh import ParallelDims
from hfplan.hyperparams import Hyperparameters
from hfplan.layout import (
    Box,
    TensorSpec,
    box_numel,
    dp_groups,
    generation_box,
    generation_numel,
    generation_places,
    new_numel,
    rank_coords,
    received_numel,
    replica_groups,
    reshard_transfers,
    stage_of,
    training_box,
)
from hfplan.plan import GenConfig, TrainConfig

MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)
QUICK_MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
# World size -> (training layout, generation tps).
GRID = {4: [(TrainConfig(tp=4), (2, 1)), (TrainConfig(tp=2, dp=2, shard="replicated"), (1, 4)),
            (TrainConfig(dp=4, shard="full"), (2,)), (TrainConfig(pp=2, dp=2, shard="full"), (1, 2)),
            (TrainConfig(pp=2, tp=2), (1, 2))],
        8: [(TrainConfig(tp=4, dp=2, shard="replicated"), (2,)),
            (TrainConfig(pp=2, tp=2, dp=2, shard="full"), (1, 2, 4))]}
QUICK = {4: [(TrainConfig(tp=2, dp=2, shard="replicated"), (1,)), (TrainConfig(dp=4, shard="full"), (2,)),
             (TrainConfig(pp=2, tp=2), (1,))]}
METHODS = ("engine", "world", "group")
COUNTED = ("batch_isend_irecv", "all_gather_single")
# Collectives none of the methods should call; a call while counting is reported, not counted.
GUARDED = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "send", "recv", "reduce",
           "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
           "all_gather_object", "broadcast_object_list")
MB = 1e6
DTYPE = torch.float32  # training and generation weights alike, so every method moves the same bytes
ITEM = DTYPE.itemsize


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Traffic:
    """Bytes this rank hands torch.distributed's calls while `counting` (patched in this process only): a
    point-to-point op's tensor, an all-gather's other members' pieces in and this rank's piece out to each.
    isend and irecv stay unwrapped: P2POp takes only the originals, and the engine posts them in batches."""

    def __init__(self) -> None:
        self.received = self.sent = 0
        self.uncounted: list[str] = []

    def _batch(self, original: Callable) -> Callable:
        def batch_isend_irecv(ops):
            for op in ops:
                if op.op is dist.isend:
                    self.sent += nbytes(op.tensor)
                else:
                    self.received += nbytes(op.tensor)
            return original(ops)
        return batch_isend_irecv

    def _gather(self, original: Callable) -> Callable:
        def all_gather_single(output, input, group=None, async_op=False):
            self.received += nbytes(output) - nbytes(input)
            self.sent += nbytes(input) * (dist.get_world_size(group) - 1)
            return original(output, input, group=group, async_op=async_op)
        return all_gather_single

    def _guard(self, name: str, original: Callable) -> Callable:
        def guarded(*args, **kwargs):
            self.uncounted.append(name)
            return original(*args, **kwargs)
        return guarded

    @contextlib.contextmanager
    def counting(self) -> Iterator[Traffic]:
        originals = {name: getattr(dist, name) for name in (*COUNTED, *GUARDED)}
        wrappers = {"batch_isend_irecv": self._batch(originals["batch_isend_irecv"]),
                    "all_gather_single": self._gather(originals["all_gather_single"])}
        wrappers |= {name: self._guard(name, originals[name]) for name in GUARDED}
        for name, wrapper in wrappers.items():
            setattr(dist, name, wrapper)
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)


class Held:
    """The bytes of the tensors a reference holds beyond the training shards, and the most at once: it
    allocates through `new` and drops through `free`, so its peak is read off its own allocations."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def new(self, shape, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.live += nbytes(tensor)
        self.peak = max(self.peak, self.live)
        return tensor

    def free(self, *tensors: torch.Tensor) -> None:
        self.live -= sum(nbytes(t) for t in tensors)


def whole_box(spec: TensorSpec) -> Box:
    return tuple((0, n) for n in spec.shape)


Packing = list[tuple[str, Box]]


def packing(train: TrainConfig, specs: list[TensorSpec], layers: int, rank: int) -> Packing:
    """The slices a rank contributes to a reference gather (training_box under `train`), in an order that lines
    up across pipeline stages: its k-th layer beside every other stage's, then its end tensors largest first
    (the embedding beside the head), so a bucket takes about as much from every member and little is padded."""
    stage = rank_coords(train, rank)[0]
    mine = [s for s in specs if stage_of(s.layer, layers, train.pp, train.virtual_stages) == stage]
    order = {layer: k for k, layer in enumerate(sorted({s.layer for s in mine if 0 <= s.layer < layers}))}
    mine.sort(key=lambda s: (0, order[s.layer]) if s.layer in order else (1, -s.numel))
    return [(s.name, training_box(train, s, rank)) for s in mine]


def buckets(packings: list[Packing], bucket_numel: int) -> list[tuple[int, int, int]]:
    """(first, end position, padded width) of a reference gather's buckets: each takes at most bucket_numel
    elements from every member (or one position), and each member's part is padded to the widest."""
    cost = [max((box_numel(p[j][1]) for p in packings if j < len(p)), default=0)
            for j in range(max(len(p) for p in packings))]
    cuts, size = [0], 0
    for j, c in enumerate(cost):
        if j > cuts[-1] and size + c > bucket_numel:
            cuts.append(j)
            size = 0
        size += c
    cuts.append(len(cost))
    out = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        width = max(sum(box_numel(b) for _, b in p[lo:hi]) for p in packings)
        if width:
            out.append((lo, hi, width))
    return out


def gather_numel(packings: list[Packing], bucket_numel: int) -> int:
    """Elements a member receives in a reference gather (padding included): the expected count."""
    return sum(width * (len(packings) - 1) for *_, width in buckets(packings, bucket_numel))


def gather_slices(targets: dict[str, tuple[torch.Tensor, Box]], packings: list[Packing],
                  mine: list[torch.Tensor], group, bucket_numel: int, held: Held) -> None:
    """Fill `targets` (name -> tensor and the parameter slice it is) with every member's slices over a process
    group whose members pack as `packings` (in group rank order), one all_gather_single per bucket."""
    dtype = mine[0].dtype
    for lo, hi, width in buckets(packings, bucket_numel):
        flat = held.new(width, dtype)
        offset = 0
        for tensor in mine[lo:hi]:
            flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
            offset += tensor.numel()
        flat[offset:].zero_()
        out = held.new(width * len(packings), dtype)
        dist.all_gather_single(out, flat, group=group)
        held.free(flat)
        for member, pieces in enumerate(packings):
            offset = member * width
            for name, box in pieces[lo:hi]:
                target, origin = targets[name]
                part = box_view(target, origin, box)
                part.copy_(out[offset:offset + part.numel()].view(part.shape))
                offset += part.numel()
        held.free(out)


def cut(whole: dict[str, tuple[torch.Tensor, Box]], specs: list[TensorSpec], gen: GenConfig, place,
        held: Held) -> dict[str, torch.Tensor]:
    """Each generation shard copied out of the whole model, each whole tensor dropped once cut."""
    shards = {}
    for spec in specs:
        tensor, origin = whole.pop(spec.name)
        box = generation_box(gen, spec, place)
        shards[spec.name] = held.new([e - s for s, e in box], tensor.dtype)
        shards[spec.name].copy_(box_view(tensor, origin, box))
        held.free(tensor)
    return shards


def unsharded(train: TrainConfig) -> TrainConfig:
    """The layout with the weights unsharded: what each rank holds once FSDP has unsharded it."""
    return TrainConfig(pp=train.pp, tp=train.tp, dp=train.dp, shard="replicated", virtual_stages=train.virtual_stages)


def shard_groups(train: TrainConfig) -> list[list[int]]:
    """FSDP's weight-shard groups (consecutive data-parallel ranks of one stage and tp rank); none unsharded."""
    size = train.shards("weights")
    return [g[i:i + size] for g in dp_groups(train) for i in range(0, len(g), size)] if size > 1 else []


def member_of(groups: list[list[int]]) -> list[int]:
    return next(g for g in groups if dist.get_rank() in g)


Switch = tuple[dict[str, torch.Tensor], int]  # a method's generation shards by HF name, its peak extra bytes


class Setup:
    """One grid point on this rank: the trained model, the engine, the references' process groups."""

    def __init__(self, train: TrainConfig, tp_g: int, sizes: dict, bucket_bytes: int) -> None:
        self.train, self.gen = train, GenConfig(tp=tp_g, dp=dist.get_world_size() // tp_g)
        self.bucket_bytes, self.bucket_numel = bucket_bytes, bucket_bytes // ITEM
        config = LlamaConfig(**sizes, max_position_embeddings=64, pad_token_id=0)
        torch.manual_seed(0)
        self.trained = RoleModel(LlamaForCausalLM(config), ParallelDims.of(train).build("cpu"), Hyperparameters(),
                                 "cpu", DTYPE, pad_id=0, lr=1e-3)
        self.specs, self.layers = model_specs(self.trained.hf_class, config), config.num_hidden_layers
        self.hybrid = HybridEngine(self.trained, (train, self.gen), bucket_bytes)
        self.place = generation_places(train, self.gen)[dist.get_rank()]
        self.shard_groups, self.model_groups = shard_groups(train), replica_groups(train)
        self.shard_group = dist.new_subgroups_by_enumeration(self.shard_groups)[0] if self.shard_groups else None
        self.model_group = dist.new_subgroups_by_enumeration(self.model_groups)[0]

    def packings(self, layout: TrainConfig, ranks) -> list[Packing]:
        return [packing(layout, self.specs, self.layers, r) for r in ranks]

    def engine(self) -> Switch:
        """Method (a): the hybrid engine's switch (its shards, read before it hands them back)."""
        module = self.hybrid.enter_generation()
        shards = {name: p.detach() for name, p in module.named_parameters()}
        self.hybrid.exit_generation()
        return shards, self.hybrid.last_switch.peak

    def world(self) -> Switch:
        """Method (b): every parameter gathered whole over the world, then cut."""
        held, params = Held(), self.trained.local_parameters()
        whole = {s.name: (held.new(s.shape, DTYPE), whole_box(s)) for s in self.specs}
        packings = self.packings(self.train, range(dist.get_world_size()))
        mine = [local_tensor(params[name]) for name, _ in packings[dist.get_rank()]]
        gather_slices(whole, packings, mine, None, self.bucket_numel, held)
        return cut(whole, self.specs, self.gen, self.place, held), held.peak

    def group(self) -> Switch:
        """Method (c): FSDP's unshard over the shard group, then the model-parallel group's whole model, cut."""
        held, params, rank, full = Held(), self.trained.local_parameters(), dist.get_rank(), unsharded(self.train)
        mine = [local_tensor(params[name]) for name, _ in packing(self.train, self.specs, self.layers, rank)]
        if self.shard_group is not None:
            pieces = {name: (held.new([e - s for s, e in box], DTYPE), box)
                      for name, box in packing(full, self.specs, self.layers, rank)}
            gather_slices(pieces, self.packings(self.train, member_of(self.shard_groups)), mine, self.shard_group,
                          self.bucket_numel, held)
            if self.train.tp * self.train.pp == 1:  # FSDP alone: the unsharded slices are the whole model
                return cut(pieces, self.specs, self.gen, self.place, held), held.peak
            mine = [tensor for tensor, _ in pieces.values()]  # in the unsharded packing's order, as built
        whole = {s.name: (held.new(s.shape, DTYPE), whole_box(s)) for s in self.specs}
        gather_slices(whole, self.packings(full, member_of(self.model_groups)), mine, self.model_group,
                      self.bucket_numel, held)
        if self.shard_group is not None:
            held.free(*mine)
        return cut(whole, self.specs, self.gen, self.place, held), held.peak

    def expected_received(self) -> dict[str, int]:
        """Bytes this rank should receive by each method, from the layouts alone."""
        world = gather_numel(self.packings(self.train, range(dist.get_world_size())), self.bucket_numel)
        group = gather_numel(self.packings(unsharded(self.train), member_of(self.model_groups)), self.bucket_numel)
        if self.shard_groups:
            group += gather_numel(self.packings(self.train, member_of(self.shard_groups)), self.bucket_numel)
        plan = received_numel(self.train, self.gen, self.specs, self.layers)[dist.get_rank()]
        return {"engine": ITEM * plan, "world": ITEM * world, "group": ITEM * group}

    def in_flight_bound(self) -> int:
        """The most bytes the engine's buckets may hold at once: one bucket, sent and received together (more only
        to carry one slice larger than that, alone)."""
        rank = dist.get_rank()
        mine = [ITEM * t.numel for t in reshard_transfers(self.train, self.gen, self.specs, self.layers)
                if rank in (t.src, t.dst)]
        return min(sum(mine), max([self.bucket_bytes, *mine]))


def counted(run: Callable[[], Switch]) -> tuple[dict[str, torch.Tensor], dict]:
    """One switch with this rank's traffic counted: its shards, and its bytes and peak."""
    dist.barrier()
    with Traffic().counting() as traffic:
        shards, peak = run()
    return shards, {"received": traffic.received, "sent": traffic.sent, "peak": peak, "uncounted": traffic.uncounted}


def timed(run: Callable[[], Switch], reps: int) -> list[float]:
    """Seconds of `reps` switches on this rank, each started together with the other ranks (a barrier)."""
    seconds = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(setup: Setup, reps: int) -> dict:
    """Every method once counted (its warm-up, its shards compared with the world gather's), then timed."""
    out: dict = {"expect": setup.expected_received()}
    shards = {}
    for name in METHODS:
        shards[name], out[name] = counted(getattr(setup, name))
    stats = setup.hybrid.last_switch  # the counted switch's
    out["switch"] = {"received": stats.received, "sent": stats.sent, "made": stats.made, "peak": stats.peak}
    out["diff"] = max((got[k] - shards["world"][k]).abs().max().item() for got in shards.values() for k in got)
    del shards
    for name in METHODS:
        out[name]["seconds"] = timed(getattr(setup, name), reps)
    out["generation"] = ITEM * generation_numel(setup.gen, setup.specs, setup.layers, setup.place)
    out["made"] = ITEM * new_numel(setup.train, setup.gen, setup.specs, setup.layers, keeps_own=True)[dist.get_rank()]
    out["bound"] = out["made"] + setup.in_flight_bound()
    out["model"] = ITEM * sum(s.numel for s in setup.specs)
    return out


def rank_main(rank: int, world: int, folder: str, points: list, sizes: dict, bucket_bytes: int, reps: int) -> None:
    """One rank of the world: every grid point of this world size, its figures to a file of its own."""
    torch.set_num_threads(1)
    results = []
    with gloo_on_loopback():
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(folder) / "store"), world), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        try:
            for train, tp_g in points:
                results.append(measure(Setup(TrainConfig(**train), tp_g, sizes, bucket_bytes), reps))
        finally:
            dist.destroy_process_group()
    (Path(folder) / f"{rank}.json").write_text(json.dumps(results))


def run_world(world: int, points: list[tuple[TrainConfig, int]], sizes: dict, bucket_bytes: int, reps: int
              ) -> list[list[dict]]:
    """Per grid point, every rank's figures, from one gloo world of `world` processes. They are forked: this
    process has imported torch and transformers but run no torch op yet, so each rank starts with them imported
    (spawned, each would import them again: most of a quick run's time on a 2-core machine)."""
    with tempfile.TemporaryDirectory(prefix="hfplan-reshard-") as folder:
        plain = [(train.model_dump(), tp_g) for train, tp_g in points]
        mp.start_processes(rank_main, args=(world, folder, plain, sizes, bucket_bytes, reps), nprocs=world,
                           join=True, start_method="fork")
        per_rank = [json.loads((Path(folder) / f"{r}.json").read_text()) for r in range(world)]
    return [list(ranks) for ranks in zip(*per_rank, strict=True)]


def problems(ranks: list[dict]) -> list[str]:
    """What disagrees at one grid point (empty: nothing)."""
    out = []
    for rank, r in enumerate(ranks):
        engine, switch = r["engine"], r["switch"]
        if not engine["received"] == switch["received"] == r["expect"]["engine"]:
            out.append(f"rank {rank}: engine received {engine['received']} B counted, {switch['received']} B by "
                       f"SwitchStats, {r['expect']['engine']} B by the plan")
        if engine["sent"] != switch["sent"]:
            out.append(f"rank {rank}: engine sent {engine['sent']} B counted, {switch['sent']} B by SwitchStats")
        if switch["made"] != r["made"]:
            out.append(f"rank {rank}: engine made {switch['made']} B of new tensors, the plan {r['made']} B")
        if switch["peak"] > r["bound"]:
            out.append(f"rank {rank}: engine peak {switch['peak']} B over what it makes plus buckets {r['bound']} B")
        for name in ("world", "group"):
            if r[name]["received"] != r["expect"][name]:
                out.append(f"rank {rank}: {name} received {r[name]['received']} B, expected {r['expect'][name]} B")
        if any(r[m]["uncounted"] for m in METHODS):
            out.append(f"rank {rank}: uncounted calls {[r[m]['uncounted'] for m in METHODS]}")
        if r["diff"] != 0.0:
            out.append(f"rank {rank}: generation shards differ between methods by {r['diff']}")
    return out


def label(train: TrainConfig) -> str:
    return f"p{train.pp}t{train.tp}d{train.dp}" + (" fsdp" if train.shards("weights") > 1 else "")


def row(train: TrainConfig, tp_g: int, ranks: list[dict]) -> list[str]:
    """One grid point's cells (TABLE's columns): the most over ranks, in MB and ms."""
    def most(method: str, key: str) -> float:
        return max(r[method][key] for r in ranks) / MB

    def expect(method: str) -> float:
        return max(r["expect"][method] for r in ranks) / MB

    def ms(method: str) -> float:  # the slowest rank's switch, median over the repetitions
        return 1e3 * statistics.median(max(times) for times in zip(*(r[method]["seconds"] for r in ranks),
                                                                    strict=True))

    model, shards = ranks[0]["model"] / MB, train.tp * train.pp
    table2 = f"{max(0, shards - tp_g) / (tp_g * shards) * model:.3f}" + ("*" if train.shards("weights") > 1 else "")
    volume = {m: most(m, "received") for m in METHODS}
    times = {m: ms(m) for m in METHODS}
    cells = [label(train), f"t{tp_g}", f"{volume['engine']:.3f}", f"{expect('engine'):.3f}", table2,
             f"{volume['world']:.3f}", f"{expect('world'):.3f}", f"{volume['group']:.3f}", f"{expect('group'):.3f}",
             f"{most('engine', 'peak'):.3f}", f"{max(r['generation'] for r in ranks) / MB:.3f}",
             f"{model / tp_g:.3f}", f"{most('world', 'peak'):.3f}", f"{most('group', 'peak'):.3f}",
             *(f"{times[m]:.1f}" for m in METHODS)]
    for ref in ("world", "group"):
        share = volume["engine"] / volume[ref] if volume[ref] else float("nan")
        cells += [f"{share:.2f}", f"{times['engine'] / times[ref]:.2f}"]
    return cells


# (heading, its columns): the table's layout, one row per grid point.
TABLE = [("", ["train", "gen"]),
         ("received MB, most over ranks", ["engine", "plan", "table2", "world", "expect", "group", "expect"]),
         ("peak extra MB, most over ranks", ["engine", "shard", "M/tp_g", "world", "group"]),
         ("switch ms", ["engine", "world", "group"]), ("engine/world", ["bytes", "time"]),
         ("engine/group", ["bytes", "time"])]
WIDTHS = [12, 3] + [8] * 15 + [6] * 4


def table_lines(rows: list[list[str]]) -> list[str]:
    """The heading line, the column line and the rows, each column right-aligned (the layout left)."""
    names = [name for _, columns in TABLE for name in columns]
    align = ["<", "<"] + [">"] * (len(names) - 2)

    def line(cells: list[str]) -> str:
        return " ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, WIDTHS, strict=True))

    spans, at = [], 0
    for heading, columns in TABLE:
        width = sum(WIDTHS[at:at + len(columns)]) + len(columns) - 1
        spans.append(f"{heading:^{width}}")
        at += len(columns)
    return [" ".join(spans), line(names), *(line(r) for r in rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4-process subset on a smaller model")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size of every method (MB)")
    parser.add_argument("--reps", type=int, default=5, help="timed switches per method after the counted one")
    args = parser.parse_args(argv)
    if args.reps < 1:
        raise SystemExit("--reps must be at least 1")
    grid, sizes = (QUICK, QUICK_MODEL) if args.quick else (GRID, MODEL)
    bucket_bytes = int(args.bucket_mb * MB)
    started = time.perf_counter()
    print(f"switch to generation: engine (per-tensor plan) vs world gather vs model-parallel group gather; "
          f"Llama {sizes}, fp32, buckets {args.bucket_mb:g} MB, median of {args.reps}; "
          f"{torch.get_num_threads()} threads here, load average {os.getloadavg()[0]:.1f}")
    rows, found = [], []
    for world, layouts in grid.items():
        points = [(train, tp_g) for train, tps in layouts for tp_g in tps]
        for (train, tp_g), ranks in zip(points, run_world(world, points, sizes, bucket_bytes, args.reps),
                                        strict=True):
            rows.append(row(train, tp_g, ranks))
            found += [f"{label(train)} -> t{tp_g}: {p}" for p in problems(ranks)]
    print("\n".join(table_lines(rows)))
    print("* FSDP: Table 2 assumes unsharded training shards; each rank holds 1/dp of its slice and receives more.")
    print(f"done in {time.perf_counter() - started:.0f} s")
    for problem in found:
        print(f"mismatch: {problem}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
