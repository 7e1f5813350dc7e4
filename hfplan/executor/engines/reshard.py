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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hfplan.executor.engines.tensor_parallel import _COLUMNS, _ROWS
from hfplan.layout import (
    Box,
    GenerationPlace,
    LayoutLike,
    TensorSpec,
    TrainLayoutLike,
    Transfer,
    generation_box,
    generation_places,
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
    peak: int  # most bytes of tensors the switch held at once: the generation shards plus buffers in flight


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


def _local(param: torch.Tensor) -> torch.Tensor:
    return (param.to_local() if hasattr(param, "to_local") else param).detach()


def _view(tensor: torch.Tensor, origin: Box, box: Box) -> torch.Tensor:
    """The part of `tensor` (which holds the slice `origin` of its parameter) that is the slice `box`."""
    for dim, ((start, end), (base, _)) in enumerate(zip(box, origin, strict=True)):
        tensor = tensor.narrow(dim, start - base, end - start)
    return tensor


def _held(held: dict[str, torch.Tensor], train: TrainLayoutLike, spec: TensorSpec, rank: int
          ) -> tuple[torch.Tensor, Box]:
    """This rank's local training tensor of a parameter and the slice of the parameter it is, checked."""
    local = _local(held[spec.name])
    box = training_box(train, spec, rank)
    if tuple(local.shape) != tuple(e - s for s, e in box):
        raise RuntimeError(f"{spec.name}: the local training shard {tuple(local.shape)} is not the slice {box} "
                           "the resharding plan assumes")
    return local, box


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


def generation_shards(held: dict[str, torch.Tensor], specs: list[TensorSpec], train: TrainLayoutLike,
                      gen: LayoutLike, layers: int, dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20
                      ) -> tuple[dict[str, torch.Tensor], SwitchStats]:
    """This rank's generation shard of every parameter on its generation stage, by HF name (new tensors in
    `dtype`, default the training shards' own, which stay untouched; dropping them frees the switch's
    memory), and what the switch moved. `held`: this rank's training parameters by HF name (its stages' only,
    when pipelined). A collective over the training layout's world (ranks in layout order)."""
    rank = dist.get_rank()
    stage = rank_coords(train, rank)[0]
    sample = _local(next(iter(held.values())))
    dtype, device = dtype or sample.dtype, sample.device
    by_name = {s.name: s for s in specs}
    place = generation_places(train, gen)[rank]
    transfers = reshard_transfers(train, gen, specs, layers)
    shards: dict[str, torch.Tensor] = {}
    for name, spec in by_name.items():
        if stage_of(spec.layer, layers, gen.pp) != place.pp:
            continue
        need = generation_box(gen, spec, place)
        shard = torch.empty([e - s for s, e in need], dtype=dtype, device=device)
        if stage_of(spec.layer, layers, train.pp, train.virtual_stages) == stage:
            local, box = _held(held, train, spec, rank)
            own = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(need, box, strict=True))
            if all(s < e for s, e in own):
                _view(shard, need, own).copy_(_view(local, box, own))
        shards[name] = shard
    held_bytes = sum(t.numel() * t.element_size() for t in shards.values())
    peak, sent, received = held_bytes, 0, 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    to_peer: dict[int, list[Transfer]] = {}
    from_peer: dict[int, list[Transfer]] = {}
    for t in transfers:
        if t.src == rank:
            to_peer.setdefault(t.dst, []).append(t)
        elif t.dst == rank:
            from_peer.setdefault(t.src, []).append(t)
    outgoing = {peer: _buckets(ts, itemsize, bucket_bytes) for peer, ts in to_peer.items()}
    incoming = {peer: _buckets(ts, itemsize, bucket_bytes) for peer, ts in from_peer.items()}
    rounds = max((len(b) for b in (*outgoing.values(), *incoming.values())), default=0)
    for k in range(rounds):
        ops, receipts, live = [], [], 0
        for peer, buckets in outgoing.items():
            if k < len(buckets):
                flat = torch.cat([_view(*_held(held, train, by_name[t.name], rank), t.box).reshape(-1)
                                  for t in buckets[k]]).to(dtype)
                ops.append(dist.P2POp(dist.isend, flat, peer))
                sent += flat.numel() * flat.element_size()
                live += flat.numel() * flat.element_size()
        for peer, buckets in incoming.items():
            if k < len(buckets):
                first = shards[buckets[k][0].name]
                flat = torch.empty(sum(t.numel for t in buckets[k]), dtype=first.dtype, device=first.device)
                ops.append(dist.P2POp(dist.irecv, flat, peer))
                receipts.append((buckets[k], flat))
                received += flat.numel() * flat.element_size()
                live += flat.numel() * flat.element_size()
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        peak = max(peak, held_bytes + live)
        for bucket, flat in receipts:
            offset = 0
            for t in bucket:
                need = generation_box(gen, by_name[t.name], place)
                target = _view(shards[t.name], need, t.box)
                target.copy_(flat[offset:offset + t.numel].view(target.shape))
                offset += t.numel
    return shards, SwitchStats(received=received, sent=sent, peak=peak)


Bucket = tuple[list[tuple[str, Box]], torch.Tensor]  # (parameter, slice) keys and their values, flat


def sync_buckets(held: dict[str, torch.Tensor], specs: list[TensorSpec], train: TrainLayoutLike,
                 rollout: LayoutLike, layers: int, dtype: torch.dtype, bucket_bytes: int = 256 << 20
                 ) -> dict[int, list[Bucket]]:
    """What this training rank sends each rollout rank at a separate rollout set's weight sync (layout's
    sync_transfers: every rollout rank gets exactly its generation shard), by rollout rank, in buckets of
    at most about `bucket_bytes` (a slice larger than a bucket travels alone). `held` as generation_shards
    takes it. No collective."""
    rank = dist.get_rank()
    by_name = {s.name: s for s in specs}
    itemsize = torch.empty((), dtype=dtype).element_size()
    mine: dict[int, list[Transfer]] = {}
    for t in sync_transfers(train, rollout, specs, layers):
        if t.src == rank:
            mine.setdefault(t.dst, []).append(t)
    out: dict[int, list[Bucket]] = {}
    for dst, transfers in mine.items():
        out[dst] = []
        for bucket in _buckets(transfers, itemsize, bucket_bytes):
            flat = torch.cat([_view(*_held(held, train, by_name[t.name], rank), t.box).reshape(-1)
                              for t in bucket]).to(dtype)
            out[dst].append(([(t.name, t.box) for t in bucket], flat))
    return out


def assemble(specs: list[TensorSpec], rollout: LayoutLike, buckets: list[Bucket], dtype: torch.dtype,
             device: torch.device) -> dict[str, torch.Tensor]:
    """A rollout rank's generation shard of every parameter, by HF name, from the buckets sent to it."""
    place = GenerationPlace(*rank_coords(rollout, dist.get_rank()))
    need = {spec.name: generation_box(rollout, spec, place) for spec in specs}
    shards = {name: torch.empty([e - s for s, e in box], dtype=dtype, device=device) for name, box in need.items()}
    filled = dict.fromkeys(shards, 0)
    for keys, flat in buckets:
        offset = 0
        for name, box in keys:
            target = _view(shards[name], need[name], box)
            target.copy_(flat[offset:offset + target.numel()].view(target.shape))
            offset += target.numel()
            filled[name] += target.numel()
    missing = [name for name, count in filled.items() if count != shards[name].numel()]
    if missing:
        raise RuntimeError(f"the weight sync left parts of {', '.join(missing[:3])} unsent")
    return shards
