"""The device mesh of a layout, one per worker and layout, and the compute dtype of a device.

Every layout runs on a 4-D mesh (pp, replicate, shard, tp), slowest first: the contract's rank order
(hfplan.layout: pp, dp, tp) with dp split as replicate x shard. A training layout's shard dimension is
its shard group (every data-parallel rank for full sharding, ZeRO-3; g ranks for hybrid sharding; one
for replicated, DDP-like plans), the replicate dimension the groups: FSDP2 runs on the (replicate,
shard) sub-mesh. Inference and generation layouts hold unsharded copies: their dp is all replicate.
Ranks of one tensor-parallel group are adjacent, as hfplan.layout numbers them.

`WorkerMeshes` builds each distinct mesh once per worker (a collective: every rank of the set asks for
the same layouts in the same order), so all roles of a worker with the same layout share one mesh and
its process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hfplan.layout import MESH_DIMS, LayoutLike
from hfplan.plan import TrainConfig

PP, _DP, TP = MESH_DIMS
REPLICATE, SHARD = "replicate", "shard"  # the contract's dp, as FSDP2 splits it
DP_DIMS = (REPLICATE, SHARD)
DIMS = (PP, *DP_DIMS, TP)  # the mesh's dimension names, slowest first


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one layout's mesh (each at least 1)."""

    pp: int
    replicate: int
    shard: int
    tp: int

    def __post_init__(self) -> None:
        for name in DIMS:
            if getattr(self, name) < 1:
                raise ValueError(f"mesh degree {name}={getattr(self, name)} must be at least 1")

    @classmethod
    def of(cls, layout: LayoutLike) -> ParallelDims:
        """A training layout's dp as its FSDP shard groups, an inference or generation layout's as replicas."""
        shard = layout.shards("weights") if isinstance(layout, TrainConfig) else 1
        if layout.dp % shard:
            raise ValueError(f"shard group {shard} does not divide dp={layout.dp}")
        return cls(layout.pp, layout.dp // shard, shard, layout.tp)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.pp, self.replicate, self.shard, self.tp

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def build(self, device_type: str) -> DeviceMesh:
        """A new mesh (new process groups; a collective over the world): use WorkerMeshes to share them."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=DIMS)


class WorkerMeshes:
    """The meshes of one worker's roles: one per distinct ParallelDims, built on first use."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._meshes: dict[ParallelDims, DeviceMesh] = {}

    def of(self, layout: LayoutLike) -> DeviceMesh:
        dims = ParallelDims.of(layout)
        if dims not in self._meshes:
            self._meshes[dims] = dims.build(self.device_type)
        return self._meshes[dims]


def parallel_dims(mesh: DeviceMesh) -> ParallelDims:
    """The degrees of a mesh WorkerMeshes (or ParallelDims.build) made."""
    if tuple(mesh.mesh_dim_names or ()) != DIMS:
        raise ValueError(f"mesh dims must be {DIMS}, got {mesh.mesh_dim_names}")
    return ParallelDims(*mesh.mesh.shape)


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype models compute in on a device: bf16 on GPUs, fp32 elsewhere (CPUs lack fast bf16 kernels)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
