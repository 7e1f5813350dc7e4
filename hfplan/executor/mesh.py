"""Device meshes of a role's layouts, in the contract's rank order.

Data-parallel training runs FSDP2 on a 2-D (replicate, shard) mesh: the shard dimension is the plan's
shard group (every data-parallel rank for full sharding, ZeRO-3; g ranks for hybrid sharding; one for
replicated, DDP-like plans), the replicate dimension the groups.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hfplan.executor.engines.training import FSDP_MESH_DIMS
from hfplan.plan import TrainConfig


def fsdp_mesh_shape(train: TrainConfig) -> tuple[int, int]:
    group = train.shards("weights")
    return (train.dp // group, group)


def training_mesh(train: TrainConfig, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, fsdp_mesh_shape(train), mesh_dim_names=FSDP_MESH_DIMS)
