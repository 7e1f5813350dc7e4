"""Device meshes of a role's layouts, in the contract's rank order.

Data-parallel training runs FSDP2 on a 2-D (replicate, shard) mesh: sharded plans (ZeRO-3) put every
data-parallel rank on the shard dimension, replicated plans (DDP-like) on the replicate dimension.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hfplan.executor.engines.training import FSDP_MESH_DIMS
from hfplan.plan import TrainConfig


def fsdp_mesh_shape(train: TrainConfig) -> tuple[int, int]:
    return (1, train.dp) if train.shard else (train.dp, 1)


def training_mesh(train: TrainConfig, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, fsdp_mesh_shape(train), mesh_dim_names=FSDP_MESH_DIMS)
