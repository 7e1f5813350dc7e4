"""Hybrid sharding on the executor: FSDP2 on the (replicate, shard) mesh of a plan's shard groups, over a
real 4-process gloo world, matches a single-process step on the full batch."""

import pytest
import torch
from test_engine_training import HP, LR, _actor_loss, _global_mini_batches, actor_batch, full_params

from hfplan.executor.engines.training import RoleModel
from hfplan.executor.mesh import ParallelDims
from hfplan.plan import TrainConfig
from tests.support.engine_models import PAD, llama_actor
from tests.support.worlds import run_world

WORLD, MINI_BATCHES = 4, 2
HYBRID = TrainConfig(dp=WORLD, micro_batch=1, shard="hybrid", shard_group=2)


def _hsdp_actor(rank: int, world: int, data: dict) -> dict:
    local = {k: v.chunk(world)[rank] for k, v in data.items()}
    trained = RoleModel(llama_actor(), ParallelDims.of(HYBRID).build("cpu"), HP, "cpu", torch.float32, pad_id=PAD,
                        lr=LR)
    local_shapes = {n: tuple(p.to_local().shape) for n, p in trained.module.named_parameters()}
    metrics = trained.update_actor(local, mini_batches=MINI_BATCHES, epochs=1, micro_batch=HYBRID.micro_batch,
                                   use_kl_loss=True)
    return {"metrics": metrics, "params": full_params(trained.module), "local_shapes": local_shapes}


@pytest.mark.slow
def test_hybrid_sharded_actor_update_matches_single_process():
    assert ParallelDims.of(HYBRID) == ParallelDims(pp=1, replicate=2, shard=2, tp=1)
    data = actor_batch()
    results = run_world(_hsdp_actor, WORLD, data, timeout=180)
    model = llama_actor().train()
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=HP.weight_decay)
    for mb in _global_mini_batches(data, WORLD, MINI_BATCHES):
        loss, _ = _actor_loss(model, mb)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HP.max_grad_norm)
        opt.step()
    expected = full_params(model)
    for out in results:
        for name, value in expected.items():
            torch.testing.assert_close(out["params"][name], value, atol=1e-5, rtol=0, msg=name)
        # each rank keeps half of every parameter (its shard group of 2), not a quarter and not all of it
        big = [n for n, s in full_shapes.items() if s[0] % 2 == 0 and s[0] >= 4]
        assert big and all(out["local_shapes"][n][0] == full_shapes[n][0] // 2 for n in big)
