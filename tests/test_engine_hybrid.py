"""Generation in the training layout: the hybrid engine's switch on a real 2-process gloo world."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from hfplan.executor.engines import forward
from hfplan.executor.engines.hybrid import HybridEngine
from hfplan.executor.engines.training import RoleModel
from hfplan.hyperparams import Hyperparameters
from tests.support.engine_models import PAD, dp_mesh, llama_config, qwen2_actor, random_sequences
from tests.support.worlds import run_world

HP = Hyperparameters(entropy_coef=0.01, max_grad_norm=1.0)


def tied_llama_actor() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(tie_word_embeddings=True)).float()


BUILDERS = {"qwen2": qwen2_actor, "llama-tied": tied_llama_actor}


def _batch(rank: int) -> dict[str, torch.Tensor]:
    prompts, responses, mask = random_sequences(4, 5, 6, seed=10 + rank)
    gen = torch.Generator().manual_seed(20 + rank)
    noise = torch.where(mask.bool(), torch.randn(mask.shape, generator=gen), 0.0)
    return {"prompts": prompts, "responses": responses, "response_mask": mask,
            "old_log_probs": torch.where(mask.bool(), -3.0 + 0.1 * noise, 0.0), "advantages": noise}


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters()}


def _switch(rank: int, world: int, builder: str, shard: bool) -> dict:
    mesh = dp_mesh(world, shard)
    make = BUILDERS[builder]
    trained = RoleModel(make(), mesh, HP, "cpu", torch.float32, pad_id=PAD, lr=1e-3)
    plain_run = RoleModel(make(), mesh, HP, "cpu", torch.float32, pad_id=PAD, lr=1e-3)
    engine = HybridEngine(trained)
    batch = _batch(rank)
    for model in (trained, plain_run):
        model.update_actor(batch, mini_batches=1, epochs=1, micro_batch=2, use_kl_loss=False)
    full = _full(trained.module)
    seqs = (batch["prompts"], batch["responses"], batch["response_mask"])
    sharded_lp = trained.log_probs(*seqs, micro_batch=2)

    gen = engine.enter_generation()
    params = dict(gen.named_parameters(remove_duplicate=False))
    out = {
        "plain": not isinstance(gen, FSDPModule) and not any(isinstance(m, FSDPModule) for m in gen.modules()),
        "eval": not gen.training,
        "no_dtensor": not any(isinstance(t, DTensor) for t in [*params.values(), *gen.state_dict().values()]),
        "same_names": set(params) >= set(full),
        "max_param_diff": max((params[n] - full[n]).abs().max().item() for n in full),
        "state_dict_diff": max((gen.state_dict()[n] - full[n]).abs().max().item() for n in full),
    }
    with torch.no_grad():
        gen_lp = forward.token_log_probs(gen, *seqs, PAD, HP.temperature, micro_batch=4)
    out["forward_diff"] = (gen_lp - sharded_lp).abs().max().item()
    engine.exit_generation()
    out["meta_after_exit"] = all(p.is_meta for p in gen.parameters())
    out["dtensor_after_exit"] = all(isinstance(p, DTensor) for p in trained.module.parameters())

    # Training continues exactly as in a run that never switched.
    for model in (trained, plain_run):
        model.update_actor(batch, mini_batches=1, epochs=1, micro_batch=2, use_kl_loss=False)
    after, reference = _full(trained.module), _full(plain_run.module)
    out["moved"] = max((after[n] - full[n]).abs().max().item() for n in full)
    out["continue_diff"] = max((after[n] - reference[n]).abs().max().item() for n in full)
    # And a second switch sees the new weights.
    gen = engine.enter_generation()
    out["second_diff"] = max((gen.get_parameter(n) - after[n]).abs().max().item() for n in after)
    engine.exit_generation()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("builder", "shard"), [("qwen2", True), ("llama-tied", False)])
def test_generation_in_training_layout(builder, shard):
    for out in run_world(_switch, 2, builder, shard, timeout=120):
        assert out["plain"] and out["eval"] and out["no_dtensor"] and out["same_names"]
        assert out["max_param_diff"] == 0 and out["state_dict_diff"] == 0
        assert out["forward_diff"] < 1e-6
        assert out["meta_after_exit"] and out["dtensor_after_exit"]
        assert out["moved"] > 1e-4
        assert out["continue_diff"] == 0
        assert out["second_diff"] == 0


def _bf16(rank: int, world: int) -> dict:
    mesh = dp_mesh(world, True)
    trained = RoleModel(qwen2_actor(), mesh, HP, "cpu", torch.bfloat16, pad_id=PAD, lr=1e-3, recompute="full")
    engine = HybridEngine(trained)
    batch = _batch(rank)
    before = _full(trained.module)
    metrics = trained.update_actor(batch, mini_batches=2, epochs=1, micro_batch=1, use_kl_loss=False)
    log_probs = trained.log_probs(batch["prompts"], batch["responses"], batch["response_mask"], micro_batch=4)
    gen = engine.enter_generation()
    gen_dtypes = {str(p.dtype) for p in gen.parameters()}
    engine.exit_generation()
    after = _full(trained.module)
    return {"metrics": metrics, "log_probs_dtype": str(log_probs.dtype), "gen_dtypes": gen_dtypes,
            "master_dtypes": {str(p.dtype) for p in after.values()},
            "moved": max((after[n] - before[n]).abs().max().item() for n in before)}


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights():
    """The GPU configuration (bf16 compute, fp32 reduce and master weights) on gloo."""
    for out in run_world(_bf16, 2, timeout=120):
        assert out["master_dtypes"] == {"torch.float32"} and out["gen_dtypes"] == {"torch.bfloat16"}
        assert out["log_probs_dtype"] == "torch.float32"
        assert all(torch.isfinite(torch.tensor(v)) for v in out["metrics"].values())
        assert out["moved"] > 1e-4


def test_an_actor_trained_as_it_is_generates_from_its_own_tensors_and_follows_swapped_ones():
    """One rank, no FSDP: the generation module keeps pointing at the trained tensors across switches (the
    optimizer steps them in place), and is pointed again when the trained module holds other tensors."""
    from hfplan.executor.local import single_process_world
    from hfplan.executor.mesh import ParallelDims

    with single_process_world():
        trained = RoleModel(qwen2_actor(), ParallelDims(1, 1, 1, 1).build("cpu"), HP, "cpu", torch.float32,
                            pad_id=PAD, lr=1e-3)
        engine = HybridEngine(trained)
        gen = engine.enter_generation()
        engine.exit_generation()
        trained.update_actor(_batch(0), mini_batches=1, epochs=1, micro_batch=2, use_kl_loss=False)
        assert engine.enter_generation() is gen and not gen.training
        for name, param in trained.module.named_parameters():
            assert gen.get_parameter(name).data_ptr() == param.data_ptr()  # the updated tensors themselves
        engine.exit_generation()
        weight = trained.module.lm_head.weight
        weight.data = weight.data * 2  # another tensor, as a load may leave
        gen = engine.enter_generation()
        assert gen.lm_head.weight.data_ptr() == weight.data_ptr()
        assert torch.equal(gen.lm_head.weight, weight.detach())
        engine.exit_generation()
