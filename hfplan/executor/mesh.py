"""Device meshes of a role's layouts, in the contract's rank order.

Data-parallel training runs FSDP2 on a 2-D (replicate, shard) mesh: the shard dimension is the plan's
shard group (every data-parallel rank for full sharding, ZeRO-3; g ranks for hybrid sharding; one for
replicated, DDP-like plans), the replicate dimension the groups.
Tensor-parallel training adds a third, fastest dimension "tp" (ranks of one tensor-parallel group are
adjacent, as hfplan.layout numbers them). Inference and generation layouts take the tp dimension of
the contract's (pp, dp, tp) mesh.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hfplan.executor.engines.training import FSDP_MESH_DIMS, TP_MESH_DIM
from hfplan.layout import MESH_DIMS, LayoutLike, mesh_shape
from hfplan.plan import TrainConfig


def fsdp_mesh_shape(train: TrainConfig) -> tuple[int, int]:
    group = train.shards("weights")
    return (train.dp // group, group)


def training_mesh(train: TrainConfig, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, fsdp_mesh_shape(train), mesh_dim_names=FSDP_MESH_DIMS)


def parallel_training_mesh(train: TrainConfig, device_type: str) -> DeviceMesh:
    """(replicate, shard, tp): FSDP2's mesh of `fsdp_mesh_shape` with the tensor-parallel dim fastest."""
    return init_device_mesh(device_type, (*fsdp_mesh_shape(train), train.tp),
                            mesh_dim_names=(*FSDP_MESH_DIMS, TP_MESH_DIM))


def tensor_parallel_mesh(layout: LayoutLike, device_type: str) -> DeviceMesh:
    """The 1-D tensor-parallel mesh of this rank in an inference or generation layout."""
    return init_device_mesh(device_type, mesh_shape(layout), mesh_dim_names=MESH_DIMS)[MESH_DIMS[-1]]
