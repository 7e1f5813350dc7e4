"""One mesh per worker and layout (hfplan.executor.mesh), the contract's rules in the engine: the
micro-batch split the simulator costs, and the layout rule for tensor parallelism."""

import math

import pytest
import torch
from test_engine_training import HP, LR, actor_batch

from hfplan.executor.engines import forward
from hfplan.executor.engines.training import RoleModel, check_layout
from hfplan.executor.mesh import DIMS, ParallelDims, WorkerMeshes, compute_dtype
from hfplan.layout import micro_batch_sizes
from hfplan.plan import GenConfig, InferConfig, TrainConfig
from hfplan.simulator.costs import _per_rank
from tests.support.engine_models import PAD, dp_mesh, llama_actor, llama_config, llama_critic, one_rank_world
from tests.support.worlds import run_world


def test_parallel_dims_split_dp_by_the_shard_group():
    assert ParallelDims.of(TrainConfig(pp=2, dp=4, tp=2, shard="hybrid", shard_group=2)) == ParallelDims(2, 2, 2, 2)
    assert ParallelDims.of(TrainConfig(dp=4, shard="full")) == ParallelDims(1, 1, 4, 1)
    assert ParallelDims.of(TrainConfig(dp=4, shard="replicated")) == ParallelDims(1, 4, 1, 1)
    assert ParallelDims.of(InferConfig(pp=2, dp=3)) == ParallelDims(2, 3, 1, 1)  # inference holds copies
    assert ParallelDims(2, 3, 1, 4).world_size == 24 and DIMS == ("pp", "replicate", "shard", "tp")
    with pytest.raises(ValueError, match="at least 1"):
        ParallelDims(1, 0, 1, 1)


def test_compute_dtype_is_bf16_on_gpus_only():
    assert compute_dtype("cuda") is torch.bfloat16 and compute_dtype(torch.device("cpu")) is torch.float32


def _shared_meshes(rank: int, world: int) -> dict:
    meshes = WorkerMeshes("cpu")
    train = TrainConfig(dp=2, shard="full")
    actor = RoleModel(llama_actor(), meshes.of(train), HP, "cpu", torch.float32, pad_id=PAD, lr=LR)
    critic = RoleModel(llama_critic(), meshes.of(TrainConfig(dp=2, shard="full", micro_batch=2)), HP, "cpu",
                       torch.float32, pad_id=PAD, lr=LR)
    reference = RoleModel(llama_actor(), meshes.of(InferConfig(dp=2)), HP, "cpu", torch.float32, pad_id=PAD)
    generation = meshes.of(GenConfig(dp=2))
    batch = {k: v.chunk(world)[rank] for k, v in actor_batch().items()}
    sequence = (batch["prompts"], batch["responses"], batch["response_mask"])
    return {
        "same_mesh": actor.mesh is critic.mesh,
        "same_groups": all(actor.mesh.get_group(d) is critic.mesh.get_group(d) for d in DIMS),
        "other_mesh": reference.mesh is not actor.mesh and reference.mesh is generation,
        "other_groups": reference.mesh.get_group("shard") is not actor.mesh.get_group("shard"),
        "shapes": (ParallelDims.of(train).shape, ParallelDims.of(InferConfig(dp=2)).shape),
        # the shared groups work for both roles
        "log_probs": actor.log_probs(*sequence, micro_batch=2), "values": critic.values(*sequence, micro_batch=2),
        "reference": reference.log_probs(*sequence, micro_batch=2),
    }


@pytest.mark.slow
def test_roles_of_one_layout_share_the_workers_mesh():
    for out in run_world(_shared_meshes, 2, timeout=120):
        assert out["same_mesh"] and out["same_groups"]
        assert out["other_mesh"] and out["other_groups"]
        assert out["shapes"] == ((1, 1, 2, 1), (1, 2, 1, 1))
        torch.testing.assert_close(out["log_probs"], out["reference"], atol=1e-6, rtol=0)  # the same weights
        assert out["values"].shape == out["log_probs"].shape


@pytest.mark.parametrize(("sequences", "dp", "micro_batch"),
                         [(6, 1, 4), (5, 1, 2), (8, 2, 2), (12, 2, 4), (7, 3, 2), (16, 4, 8), (4, 1, 8), (9, 2, 3)])
def test_the_simulator_costs_the_micro_batches_the_engine_runs(sequences, dp, micro_batch):
    per_rank = math.ceil(sequences / dp)  # the most loaded rank
    run = [part.stop - part.start for part in forward.micro_batches(per_rank, micro_batch)]
    assert tuple(run) == micro_batch_sizes(per_rank, micro_batch)
    assert len(set(run)) == 1 and max(run) <= micro_batch  # equal, as a pipeline's buffers need
    assert _per_rank(sequences, dp, micro_batch) == (run[0], len(run))


@pytest.fixture(scope="module")
def world_of_one():
    with one_rank_world():
        yield


def _batch_sizes(module: torch.nn.Module) -> list[int]:
    seen: list[int] = []
    module.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                     with_kwargs=True)
    return seen


def test_updates_and_forwards_run_the_contracts_micro_batches(world_of_one):
    model = RoleModel(llama_actor(), dp_mesh(1, True), HP, "cpu", torch.float32, pad_id=PAD, lr=LR)
    seen = _batch_sizes(model.module)
    data = {k: v[:6] for k, v in actor_batch().items()}
    model.update_actor(data, mini_batches=1, epochs=1, micro_batch=4, use_kl_loss=True)
    assert seen == [3, 3]  # 6 at 4: 3 + 3, as the simulator costs
    seen.clear()
    model.log_probs(data["prompts"][:5], data["responses"][:5], data["response_mask"][:5], micro_batch=2)
    assert seen == [1] * 5


def test_the_engine_refuses_a_layout_with_the_contracts_reason():
    config = llama_config()  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ValueError, match="tp=3 does not divide the 4 attention heads"):
        check_layout(config, True, ParallelDims(1, 1, 1, 3), 1)
    with pytest.raises(ValueError, match="training tp=4 does not divide the 2 KV heads"):
        check_layout(config, True, ParallelDims(1, 1, 1, 4), 1)
    check_layout(config, False, ParallelDims(1, 1, 1, 4), 1)  # inference copies each KV head twice
    with pytest.raises(ValueError, match="stages do not divide"):
        check_layout(config, True, ParallelDims(2, 1, 1, 1), 2)
