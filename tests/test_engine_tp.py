"""Tensor parallelism (DTensor) alone and composed with FSDP2, on real gloo worlds of 2 and 4 processes,
against single-process references: one training step, forward log-probs, values and scores, greedy
generation through the hybrid engine, and inference-only models with copied KV heads."""

import pytest
import torch
from test_engine_training import (
    HP,
    LR,
    _actor_loss,
    _critic_loss,
    _global_mini_batches,
    _reference,
    actor_batch,
    critic_batch,
    full_params,
)
from transformers import LlamaForCausalLM, LlamaForTokenClassification

from hfplan.executor.engines import forward
from hfplan.executor.engines.hybrid import HybridEngine
from hfplan.executor.engines.training import RoleModel
from hfplan.executor.mesh import TP
from hfplan.executor.rollout.base import SamplingParams
from hfplan.executor.rollout.torch_engine import TorchRolloutEngine
from hfplan.plan import InferConfig, TrainConfig
from tests.support.engine_models import (
    PAD,
    llama_actor,
    llama_config,
    llama_critic,
    mesh_of,
    qwen2_actor,
    random_sequences,
)
from tests.support.worlds import run_world

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=6, greedy=True)
PROMPTS = random_sequences(4, 5, 1, seed=7)[0]


def tied_actor() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(tie_word_embeddings=True)).float()


def reward_model() -> LlamaForTokenClassification:
    torch.manual_seed(1)
    return LlamaForTokenClassification(llama_config(num_labels=1)).float()


def _sequences():
    data = actor_batch()
    return data["prompts"], data["responses"], data["response_mask"]


def _generate(model, group=None) -> dict:
    rollout = TorchRolloutEngine(model, PAD, eos_id=-1, tp_group=group).generate(PROMPTS, GREEDY)
    return {"responses": rollout.responses, "log_probs": rollout.log_probs}


def _trained(make, train: TrainConfig, recompute: str = "none") -> RoleModel:
    return RoleModel(make(), mesh_of(train), HP, "cpu", torch.float32, pad_id=PAD, lr=LR, recompute=recompute)


def _inferring(make, mesh) -> RoleModel:
    """An inference-only role's model, as the runtime builds it: tensor parallel, no FSDP."""
    return RoleModel(make(), mesh, HP, "cpu", torch.float32, pad_id=PAD)


def _split_as_tp(trained: RoleModel) -> list:
    """Local shape and mesh dims of one column-parallel weight (the proof that TP is applied)."""
    weight = trained.module.model.layers[0].self_attn.q_proj.weight
    return [list(weight.to_local().shape), list(weight.device_mesh.mesh_dim_names)]


def _update(trained: RoleModel, kind: str, local: dict, mini_batches: int, epochs: int, micro_batch: int):
    common = dict(mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch)
    if kind == "actor":
        return trained.update_actor(local, use_kl_loss=True, **common)
    return trained.update_critic(local, "values", "returns", **common)


def _hybrid_generation(trained: RoleModel, group) -> dict:
    hybrid = HybridEngine(trained)
    module = hybrid.enter_generation()
    try:
        return _generate(module, group)
    finally:
        hybrid.exit_generation()


def _tp2_world(rank: int, world: int, actor_data: dict, critic_data: dict) -> dict:
    """tp = 2, dp = 1: every rank holds half of each layer and the whole batch."""
    train = TrainConfig(tp=2, dp=1, shard=False)
    out: dict = {"actor": [], "critic": []}
    for micro_batch, recompute in ((1, "none"), (2, "selective")):
        trained = _trained(llama_actor, train, recompute)
        metrics = _update(trained, "actor", actor_data, 1, 2, micro_batch)
        out["actor"].append({"metrics": metrics, "params": full_params(trained.module)})
    out["split"] = _split_as_tp(trained)
    out["generated"] = _hybrid_generation(trained, trained.mesh[TP].get_group())
    critic = _trained(llama_critic, train)
    metrics = _update(critic, "critic", critic_data, 1, 2, 2)
    out["critic"].append({"metrics": metrics, "params": full_params(critic.module)})

    seqs = _sequences()
    out["log_probs"] = _trained(llama_actor, train).log_probs(*seqs, micro_batch=3)
    out["values"] = _trained(llama_critic, train).values(*seqs, micro_batch=3)
    # Inference-only roles: tensor parallel without FSDP.
    mesh = mesh_of(InferConfig(tp=2))
    out["ref_log_probs"] = _inferring(llama_actor, mesh).log_probs(*seqs, micro_batch=3)
    out["scores"] = _inferring(reward_model, mesh).scores(*seqs, micro_batch=3)
    # Biases (Qwen2) and a tied embedding, generated from a tensor-parallel copy.
    group = mesh[TP].get_group()
    out["qwen2"] = _generate(_inferring(qwen2_actor, mesh).module, group)
    out["tied"] = _hybrid_generation(_trained(tied_actor, train), group)
    return out


def _dp2_tp2_world(rank: int, world: int, actor_data: dict, critic_data: dict) -> dict:
    """dp = 2 (sharded or replicated) x tp = 2: ranks 2d, 2d + 1 form tensor-parallel group d."""
    replica = rank // 2
    out: dict = {"actor": [], "critic": []}
    for shard in (True, False):
        train = TrainConfig(tp=2, dp=2, shard=shard)
        trained = _trained(llama_actor, train, recompute="full" if shard else "selective")
        local = {k: v.chunk(2)[replica] for k, v in actor_data.items()}
        metrics = _update(trained, "actor", local, 2, 1, 2)
        out["actor"].append({"metrics": metrics, "params": full_params(trained.module)})
    critic = _trained(llama_critic, TrainConfig(tp=2, dp=2))
    local = {k: v.chunk(2)[replica] for k, v in critic_data.items()}
    metrics = _update(critic, "critic", local, 1, 2, 1)
    out["critic"].append({"metrics": metrics, "params": full_params(critic.module)})

    seqs = _sequences()
    trained = _trained(llama_actor, TrainConfig(tp=2, dp=2))
    out["split"] = _split_as_tp(trained)
    out["log_probs"] = trained.log_probs(*(s.chunk(2)[replica] for s in seqs), micro_batch=2)
    # Generation at tp 4 from the tp 2 training layout (weights cut from the gathered ones; 2 KV heads: copies).
    mesh = mesh_of(InferConfig(tp=4))
    out["generated_tp4"] = _hybrid_generation(trained, mesh[TP].get_group())
    # An inference-only model at tp 4: each KV head copied twice, one per rank.
    ref = _inferring(llama_actor, mesh)
    out["kv_local"] = ref.module.model.layers[0].self_attn.k_proj.weight.to_local().shape[0]
    out["ref_log_probs"] = ref.log_probs(*seqs, micro_batch=4)
    return out


def _reference_log_probs(make=llama_actor) -> torch.Tensor:
    return forward.token_log_probs(make().eval(), *_sequences(), PAD, HP.temperature, micro_batch=8)


def _near_zero_gradients(make, data, mini_batches, epochs, loss_fn) -> dict[str, torch.Tensor]:
    """Elements whose clipped gradient came within 10 x Adam's eps (1e-8) of zero (not at it) at some step
    of the reference run. AdamW moves an element by lr * g / (|g| + eps): there a reduction-order
    difference of 1e-10 in g (tensor parallel sums partial matmuls) moves it by ~1e-5, so those few
    elements are held only to the bound of Adam steps (lr each) instead of 1e-5."""
    model = make().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=HP.weight_decay)
    smallest = {n: torch.full_like(p, float("inf")) for n, p in model.named_parameters()}
    for _ in range(epochs):
        for mb in _global_mini_batches(data, 2, mini_batches):
            loss, _ = loss_fn(model, mb)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), HP.max_grad_norm)
            for n, p in model.named_parameters():
                # Exact zeros (embedding rows of absent tokens) stay zero in every layout.
                smallest[n] = torch.minimum(smallest[n], p.grad.abs().masked_fill(p.grad == 0, float("inf")))
            opt.step()
    return {n: s < 10 * 1e-8 for n, s in smallest.items()}


def _check_updates(got: list[dict], make, data, mini_batches, epochs, loss_fn, metric):
    ref_params, ref_metric, ref_norm = _reference(make(), data, mini_batches, epochs, loss_fn)
    initial = full_params(make())
    assert max((ref_params[n] - initial[n]).abs().max().item() for n in initial) > 100 * 1e-5
    sensitive = _near_zero_gradients(make, data, mini_batches, epochs, loss_fn)
    assert sum(int(s.sum()) for s in sensitive.values()) < 0.01 * sum(s.numel() for s in sensitive.values())
    for one in got:
        assert one["metrics"][metric] == pytest.approx(ref_metric, abs=1e-5)
        assert one["metrics"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        for name, value in ref_params.items():
            error = (one["params"][name] - value).abs()
            assert error[~sensitive[name]].max().item() <= 1e-5, name
            assert error.max().item() <= LR * epochs * mini_batches, name
    return ref_params


def _reference_generation(model, params: dict | None = None) -> dict:
    if params is not None:
        model.load_state_dict(params)
    return _generate(model.eval())


def _same_generation(got: dict, want: dict) -> None:
    assert torch.equal(got["responses"], want["responses"])
    torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)


def test_tensor_parallel_2_matches_single_process():
    actor_data, critic_data = actor_batch(), critic_batch()
    results = run_world(_tp2_world, 2, actor_data, critic_data, timeout=180)
    # dp = 1: the reference's mini-batch is the whole batch (mini_batches=1), two epochs.
    actor_params = None
    for rank_out in results:
        actor_params = _check_updates(rank_out["actor"], llama_actor, actor_data, 1, 2, _actor_loss, "policy_loss")
        _check_updates(rank_out["critic"], llama_critic, critic_data, 1, 2, _critic_loss, "value_loss")
        assert rank_out["split"][0] == [32, 64] and "tp" in rank_out["split"][1]  # 2 of the 4 heads
    seqs = _sequences()
    want_log_probs = _reference_log_probs()
    want_values = forward.token_values(llama_critic().eval(), *seqs, PAD, micro_batch=8)
    want_scores = forward.sequence_scores(reward_model().eval(), *seqs, PAD, micro_batch=8)
    generated = _reference_generation(llama_actor(), actor_params)
    qwen2, tied = _reference_generation(qwen2_actor()), _reference_generation(tied_actor())
    for rank_out in results:
        for name, want in (("log_probs", want_log_probs), ("ref_log_probs", want_log_probs),
                           ("values", want_values), ("scores", want_scores)):
            torch.testing.assert_close(rank_out[name], want, atol=1e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
        _same_generation(rank_out["generated"], generated)
        _same_generation(rank_out["qwen2"], qwen2)
        _same_generation(rank_out["tied"], tied)


def test_data_parallel_2_by_tensor_parallel_2_matches_single_process():
    actor_data, critic_data = actor_batch(), critic_batch()
    results = run_world(_dp2_tp2_world, 4, actor_data, critic_data, timeout=240)
    for rank_out in results:
        _check_updates(rank_out["actor"], llama_actor, actor_data, 2, 1, _actor_loss, "policy_loss")
        _check_updates(rank_out["critic"], llama_critic, critic_data, 1, 2, _critic_loss, "value_loss")
        assert rank_out["split"][0] == [16, 64] and "tp" in rank_out["split"][1]  # FSDP's half of a tp shard
        assert rank_out["kv_local"] == 16  # one whole KV head of 16 dims on each of 4 ranks
    want = _reference_log_probs()
    generated = _reference_generation(llama_actor())
    for rank, rank_out in enumerate(results):
        torch.testing.assert_close(rank_out["log_probs"], want.chunk(2)[rank // 2], atol=1e-5, rtol=0)
        torch.testing.assert_close(rank_out["ref_log_probs"], want, atol=1e-5, rtol=0)
        _same_generation(rank_out["generated_tp4"], generated)

