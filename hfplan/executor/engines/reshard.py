"""The hybrid engine's switch to generation by hfplan.layout's per-tensor plan: each rank builds only its
generation shard of every weight, keeping what its training shard holds and receiving the rest, point to
point in buckets, from the members of its generation group (layout.reshard_transfers; every rank derives the
same list, so senders and receivers agree without a handshake). Nothing is gathered whole.

A parameter's split dimension is the tensor-parallel plan's (engines.tensor_parallel); a training rank's local
tensor (a DTensor's to_local: FSDP's chunk of dim 0 of its tensor-parallel chunk) must be exactly the slice
layout.training_box names, which is checked. A pipelined rank (pp > 1) holds only its stages' parameters: its
generation shard of every other layer arrives from the ranks of the other stages in its generation group.
Every function here takes the whole model's parameters as TensorSpec (`model_specs`) and this rank's own
tensors by HF name (RoleModel.local_parameters), so the whole and the pipelined model are one case.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hfplan.executor.engines.tensor_parallel import _COLUMNS, _ROWS
from hfplan.layout import (
    SWITCH_BUCKET_BYTES,
    Box,
    GenerationPlace,
    LayoutLike,
    TensorSpec,
    TrainLayoutLike,
    Transfer,
    box_meet,
    generation_box,
    generation_places,
    keeps_own_tensor,
    rank_coords,
    reshard_transfers,
    stage_of,
    sync_transfers,
    training_box,
)

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class SwitchStats:
    """What one rank's switch moved and allocated, in bytes."""

    received: int  # bytes this rank received
    sent: int  # bytes it sent
    made: int  # bytes of the new tensors it made (its generation shards less the training tensors it kept)
    peak: int  # most bytes of tensors the switch held at once: the new tensors plus buffers in flight


def split_dim(name: str) -> int | None:
    """The dimension the tensor-parallel plan splits a parameter along (None: replicated)."""
    module, _, leaf = name.rpartition(".")
    if module.endswith(_COLUMNS) or module in ("model.embed_tokens", "lm_head"):
        return 0
    if module.endswith(_ROWS):
        return 1 if leaf == "weight" else None
    return None


def tensor_specs(module: nn.Module, layers: int, kv_heads: int) -> list[TensorSpec]:
    """The model's parameters (tied ones once) as layout.TensorSpec, by HF name."""
    specs = []
    for name, param in module.named_parameters():
        found = _LAYER.search(name)
        layer = int(found.group(1)) if found else (-1 if "embed_tokens" in name else layers)
        kv = kv_heads if re.search(r"\.(k_proj|v_proj)\.", name) else 0
        specs.append(TensorSpec(name, tuple(param.shape), split_dim(name), layer, kv_heads=kv))
    return specs


def model_specs(hf_class: type[nn.Module], config) -> list[TensorSpec]:
    """The whole HF model's parameters as TensorSpec, from an instance on the meta device (no memory)."""
    with torch.device("meta"):
        model = hf_class(config)
    return tensor_specs(model, config.num_hidden_layers, config.num_key_value_heads)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """A parameter's tensor on this rank: a DTensor's local shard, or the tensor itself (detached)."""
    return (param.to_local() if hasattr(param, "to_local") else param).detach()


def box_view(tensor: torch.Tensor, origin: Box, box: Box) -> torch.Tensor:
    """The part of `tensor` (which holds the slice `origin` of its parameter) that is the slice `box`."""
    for dim, ((start, end), (base, _)) in enumerate(zip(box, origin, strict=True)):
        tensor = tensor.narrow(dim, start - base, end - start)
    return tensor


def _held(held: dict[str, torch.Tensor], plan: SwitchPlan, name: str) -> torch.Tensor:
    """This rank's local training tensor of a parameter, checked to be the slice the plan says it holds."""
    return _checked_local(held[name], name, plan.held[name])


def _checked_local(param: torch.Tensor, name: str, box: Box) -> torch.Tensor:
    local = local_tensor(param)
    if tuple(local.shape) != tuple(e - s for s, e in box):
        raise RuntimeError(f"{name}: the local training shard {tuple(local.shape)} is not the slice {box} "
                           "the resharding plan assumes")
    return local


def _buckets(transfers: list[Transfer], itemsize: int, bucket_bytes: int) -> list[list[Transfer]]:
    out: list[list[Transfer]] = [[]]
    size = 0
    for t in transfers:
        if out[-1] and size + t.numel * itemsize > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel * itemsize
    return [b for b in out if b]


def _rounds(transfers: list[Transfer], itemsize: int, bucket_bytes: int) -> list[list[Transfer]]:
    """The transfers, in order, cut into rounds in which no rank has more than `bucket_bytes` in flight (sent
    plus received; a slice larger than that travels alone). Every rank derives the same rounds from the same
    list, so the messages between any two ranks come in the same order on both."""
    rounds: list[list[Transfer]] = [[]]
    load: dict[int, int] = {}
    for t in transfers:
        size = t.numel * itemsize
        if any(load.get(r, 0) and load[r] + size > bucket_bytes for r in (t.src, t.dst)):
            rounds.append([])
            load = {}
        rounds[-1].append(t)
        for r in (t.src, t.dst):
            load[r] = load.get(r, 0) + size
    return [r for r in rounds if r]


@dataclass(frozen=True)
class ShardPlan:
    """One parameter's generation shard on this rank: its slice of the parameter, and the part of it this
    rank's training shard already holds (None: nothing)."""

    name: str
    need: Box
    own: Box | None


@dataclass(frozen=True)
class SwitchPlan:
    """One rank's switch to generation, derived once per pair of layouts (the plan is pure Python over every
    tensor of every rank: too slow to redo at each switch): the shards it builds, and the rounds of the
    transfers it takes part in, each as (sends by peer, receives by peer)."""

    rank: int
    shards: tuple[ShardPlan, ...]
    held: dict[str, Box]  # the slice of each parameter on this rank's training stage its training shard is
    rounds: tuple[tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]], ...]
    itemsize: int  # of the generation dtype the rounds are cut for


def switch_plan(specs: list[TensorSpec], train: TrainLayoutLike, gen: LayoutLike, layers: int, rank: int,
                itemsize: int, bucket_bytes: int = SWITCH_BUCKET_BYTES) -> SwitchPlan:
    """The rank's SwitchPlan (layout.reshard_transfers, cut by _rounds)."""
    stage = rank_coords(train, rank)[0]
    place = generation_places(train, gen)[rank]
    held = {spec.name: training_box(train, spec, rank) for spec in specs
            if stage_of(spec.layer, layers, train.pp, train.virtual_stages) == stage}
    shards = []
    for spec in specs:
        if stage_of(spec.layer, layers, gen.pp) == place.pp:
            need = generation_box(gen, spec, place)
            shards.append(ShardPlan(spec.name, need, box_meet(need, held.get(spec.name))))
    rounds = []
    for transfers in _rounds(reshard_transfers(train, gen, specs, layers), itemsize, bucket_bytes):
        sends: dict[int, list[Transfer]] = {}
        receives: dict[int, list[Transfer]] = {}
        for t in transfers:
            if t.src == rank:
                sends.setdefault(t.dst, []).append(t)
            elif t.dst == rank:
                receives.setdefault(t.src, []).append(t)
        if sends or receives:
            rounds.append((sends, receives))
    return SwitchPlan(rank, tuple(shards), held, tuple(rounds), itemsize)


def generation_shards(held: dict[str, torch.Tensor], plan: SwitchPlan, dtype: torch.dtype
                      ) -> tuple[dict[str, torch.Tensor], SwitchStats]:
    """This rank's generation shard of every parameter on its generation stage, by HF name, in `dtype`, and what
    the switch moved. A parameter whose training tensor is exactly its generation shard, in `dtype`, is that tensor
    itself (layout.keeps_own_tensor: a pipelined rank's own stages, replicated norms, FSDP chunks that are the
    finer tensor-parallel split); every other shard is a new tensor. Generation only reads them; dropping them frees
    the switch's memory. `held`: this rank's training parameters by HF name (its stages' only, when pipelined). A
    collective over the training layout's world (ranks in layout order): every rank runs its own plan."""
    if torch.empty((), dtype=dtype).element_size() != plan.itemsize:
        raise ValueError(f"the switch plan was cut for {plan.itemsize}-byte values, not {dtype}")
    device = local_tensor(next(iter(held.values()))).device
    by_name = {p.name: p for p in plan.shards}
    shards: dict[str, torch.Tensor] = {}
    made = 0
    for part in plan.shards:
        if keeps_own_tensor(part.need, plan.held.get(part.name)):
            own = _held(held, plan, part.name)
            if own.dtype == dtype:
                shards[part.name] = own
                continue
        shard = torch.empty([e - s for s, e in part.need], dtype=dtype, device=device)
        if part.own is not None:
            box_view(shard, part.need, part.own).copy_(box_view(_held(held, plan, part.name), plan.held[part.name],
                                                          part.own))
        shards[part.name] = shard
        made += shard.numel() * shard.element_size()
    peak, sent, received = made, 0, 0
    for sends, receives in plan.rounds:
        ops = [dist.P2POp(dist.isend, _flat_slices(held, plan.held, transfers, dtype, device), peer)
               for peer, transfers in sends.items()]
        receipts = [(transfers, torch.empty(sum(t.numel for t in transfers), dtype=dtype, device=device))
                    for transfers in receives.values()]
        ops += [dist.P2POp(dist.irecv, buffer, peer) for peer, (_, buffer) in zip(receives, receipts, strict=True)]
        round_sent = plan.itemsize * sum(t.numel for transfers in sends.values() for t in transfers)
        round_received = plan.itemsize * sum(t.numel for transfers in receives.values() for t in transfers)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        sent, received = sent + round_sent, received + round_received
        peak = max(peak, made + round_sent + round_received)
        ops.clear()  # the send buffers go; each receive buffer goes once copied in
        while receipts:
            transfers, buffer = receipts.pop()
            offset = 0
            for t in transfers:
                target = box_view(shards[t.name], by_name[t.name].need, t.box)
                target.copy_(buffer[offset:offset + t.numel].view(target.shape))
                offset += t.numel
            del buffer
    return shards, SwitchStats(received=received, sent=sent, made=made, peak=peak)


def _flat_slices(held: dict[str, torch.Tensor], boxes: dict[str, Box], transfers: list[Transfer],
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The slices of `transfers` from this rank's training tensors (`held`, each checked to be the slice `boxes`
    names), flat, in `dtype`: each copied (and cast) straight into its place, so no training-dtype copy of them is
    held beside the buffer. A round of the switch's sends to one peer, or a weight sync's bucket."""
    flat = torch.empty(sum(t.numel for t in transfers), dtype=dtype, device=device)
    offset = 0
    for t in transfers:
        local = _checked_local(held[t.name], t.name, boxes[t.name])
        flat[offset:offset + t.numel].view([e - s for s, e in t.box]).copy_(box_view(local, boxes[t.name], t.box))
        offset += t.numel
    return flat


# (parameter, slice) keys and the bytes of their values, flat. Ray hands a numpy array over through its object store
# without copies of its own (written once by the sender, read in place by the receiver), where a tensor is pickled
# whole: `bench/weight_sync.py` between two Ray actors on the project's 2-core VM (2026-12-07 17:21) handed 48 MiB
# over in 0.18 s as a float32 tensor and 0.06 s as an array, and the receiver of a tensor held an unpickled copy
# beside its shards.
Bucket = tuple[list[tuple[str, Box]], np.ndarray]


def bucket_array(flat: torch.Tensor) -> np.ndarray:
    """A bucket's values as the flat array of their bytes it travels as (a view where `flat` is a contiguous CPU
    tensor)."""
    return flat.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy()


def bucket_values(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The values a bucket's bytes hold, as a tensor over the same memory (Ray's arrays are read-only: read it,
    never write it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw).view(dtype)


@dataclass(frozen=True)
class SyncPlan:
    """What one training rank sends at a separate rollout set's weight sync (layout.sync_transfers: every
    rollout rank gets exactly its generation shard), derived once per pair of layouts: by rollout rank, the
    buckets of at most about bucket_bytes (a slice larger than a bucket travels alone), and the slice of each
    parameter this rank's training shard is."""

    buckets: dict[int, list[list[Transfer]]]
    held: dict[str, Box]


def sync_plan(specs: list[TensorSpec], train: TrainLayoutLike, rollout: LayoutLike, layers: int, rank: int,
              itemsize: int, bucket_bytes: int = SWITCH_BUCKET_BYTES) -> SyncPlan:
    mine: dict[int, list[Transfer]] = {}
    for t in sync_transfers(train, rollout, specs, layers):
        if t.src == rank:
            mine.setdefault(t.dst, []).append(t)
    by_name = {s.name: s for s in specs}
    held = {name: training_box(train, by_name[name], rank) for name in {t.name for ts in mine.values() for t in ts}}
    return SyncPlan({dst: _buckets(ts, itemsize, bucket_bytes) for dst, ts in mine.items()}, held)


def sync_buckets(held: dict[str, torch.Tensor], plan: SyncPlan, dtype: torch.dtype) -> dict[int, list[Bucket]]:
    """This training rank's buckets for each rollout rank, by rollout rank (`held` as generation_shards takes
    it), its values in `dtype` (the rollout set's). No collective."""
    device = local_tensor(next(iter(held.values()))).device

    def packed(bucket: list[Transfer]) -> Bucket:
        return [(t.name, t.box) for t in bucket], bucket_array(_flat_slices(held, plan.held, bucket, dtype, device))

    return {dst: [packed(bucket) for bucket in buckets] for dst, buckets in plan.buckets.items()}


def empty_shards(specs: list[TensorSpec], rollout: LayoutLike, dtype: torch.dtype, device: torch.device
                 ) -> dict[str, torch.Tensor]:
    """This rollout rank's generation shard of every parameter, by HF name, unfilled (`assemble` fills them)."""
    place = GenerationPlace(*rank_coords(rollout, dist.get_rank()))
    return {spec.name: torch.empty([e - s for s, e in generation_box(rollout, spec, place)], dtype=dtype,
                                   device=device) for spec in specs}


def assemble(shards: dict[str, torch.Tensor], specs: list[TensorSpec], rollout: LayoutLike, buckets: list[Bucket],
             dtype: torch.dtype) -> None:
    """Fill this rollout rank's generation shards (`empty_shards`' tensors, or the last sync's: in place, so an
    engine that reads them sees the new weights) from the buckets sent to it, whose values are in `dtype`."""
    place = GenerationPlace(*rank_coords(rollout, dist.get_rank()))
    need = {spec.name: generation_box(rollout, spec, place) for spec in specs}
    filled = dict.fromkeys(shards, 0)
    for keys, raw in buckets:
        flat, offset = bucket_values(raw, dtype), 0
        for name, box in keys:
            target = box_view(shards[name], need[name], box)
            target.copy_(flat[offset:offset + target.numel()].view(target.shape))
            offset += target.numel()
            filled[name] += target.numel()
        if offset != flat.numel():  # values of another dtype than the sender's would fill the slices with garbage
            raise RuntimeError(f"a weight-sync bucket held {flat.numel()} {dtype} values for slices of {offset}")
    missing = [name for name, count in filled.items() if count != shards[name].numel()]
    if missing:
        raise RuntimeError(f"the weight sync left parts of {', '.join(missing[:3])} unsent")
