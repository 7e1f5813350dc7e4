"""The gradient norm over DTensor gradients (hfplan.executor.engines.grad_norm) against torch's clip_grad_norm_,
on real gloo worlds: FSDP2 (sharded), hybrid (replicated over the mesh's first dim), tensor parallelism (split
and replicated pieces in one model) and FSDP2 over tensor parallelism (FSDP's strided shards), on 2 and 4 ranks."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from hfplan.executor.engines.grad_norm import clip_by_norm, squared_grad_norm
from hfplan.executor.engines.training import RoleModel, _grads_placed_as_params
from hfplan.executor.mesh import ParallelDims
from hfplan.hyperparams import Hyperparameters
from tests.support.engine_models import PAD, llama_actor
from tests.support.worlds import run_world

LAYOUTS = {"fsdp": (ParallelDims(pp=1, replicate=1, shard=2, tp=1), True),
           "hybrid": (ParallelDims(pp=1, replicate=2, shard=1, tp=1), True),
           "tp": (ParallelDims(pp=1, replicate=1, shard=1, tp=2), False),
           "fsdp-tp": (ParallelDims(pp=1, replicate=1, shard=2, tp=2), True)}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _norms(rank: int, world: int, name: str) -> dict:
    dims, fsdp = LAYOUTS[name]
    role = RoleModel(llama_actor(), dims.build("cpu"), Hyperparameters(), "cpu", torch.float32, pad_id=PAD,
                     lr=1e-3, fsdp=fsdp)
    torch.manual_seed(rank // dims.tp)  # each data-parallel rank its own batch; tensor-parallel peers share theirs
    tokens = torch.randint(1, 100, (2, 12))
    (role.module(tokens).logits.float().pow(2).mean() * 1e3).backward()
    _grads_placed_as_params(role.module)
    grads = [p.grad for p in role.module.parameters() if p.grad is not None]
    ours = float(squared_grad_norm(grads).sqrt())
    theirs = _whole(torch.nn.utils.get_total_norm(grads))
    scale = 1.0 / (float(theirs) + 1e-6)  # torch's clip_grad_norm_ coefficient toward a norm of 1
    expected = [_whole(g) * scale for g in grads]
    clip_by_norm(grads, ours, 1.0)
    return {"ours": ours, "theirs": float(theirs), "gap": max(float((_whole(g) - e).abs().max())
                                                               for g, e in zip(grads, expected, strict=True))}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_grad_norm_matches_torch_over_dtensor_gradients(name):
    dims, _ = LAYOUTS[name]
    results = run_world(_norms, dims.replicate * dims.shard * dims.tp, name, timeout=120)
    for out in results:
        assert out["theirs"] > 1.0  # so the clipping below really scales
        assert out["ours"] == pytest.approx(out["theirs"], rel=1e-5)
        assert out["gap"] < 1e-6
    assert all(out["ours"] == pytest.approx(results[0]["ours"], rel=1e-6) for out in results)


def test_plain_gradients_are_this_ranks_alone():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    assert float(squared_grad_norm(grads)) == pytest.approx(25.0)
    clip_by_norm(grads, 5.0, 1.0)
    assert float(squared_grad_norm(grads).sqrt()) == pytest.approx(1.0, rel=1e-5)
    unchanged = [torch.tensor([0.3, 0.4])]
    clip_by_norm(unchanged, 0.5, 1.0)
    assert unchanged[0].tolist() == pytest.approx([0.3, 0.4])
    assert float(squared_grad_norm([])) == 0.0
