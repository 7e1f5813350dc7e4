"""FSDP2 training on a real 2-process gloo world against a single-process reference on the full batch."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from hfplan.executor import sequences
from hfplan.executor.engines import forward
from hfplan.executor.engines.recompute import SELECTIVE_PREFIX
from hfplan.executor.engines.training import RoleModel
from hfplan.hyperparams import Hyperparameters
from tests.support.engine_models import PAD, dp_mesh, llama_actor, llama_critic, random_sequences
from tests.support.worlds import run_world

LR = 1e-3
HP = Hyperparameters(entropy_coef=0.01, kl_loss_coef=0.1, kl_estimator="k3", max_grad_norm=0.5, weight_decay=0.01,
                     temperature=0.8, clip_ratio=0.2, value_clip=0.1)
WORLD = 2
# (shard, micro_batch, recompute) on every data-parallel run.
CONFIGS = [(True, 1, "none"), (True, 2, "selective"), (False, 1, "none"), (False, 2, "full")]


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()}


def actor_batch(size: int = 8) -> dict[str, torch.Tensor]:
    prompts, responses, mask = random_sequences(size, 5, 6, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        current = forward.token_log_probs(llama_actor().eval(), prompts, responses, mask, PAD, HP.temperature,
                                          micro_batch=size)
    # Old log-probs off the current policy by enough that some ratios leave the clip range.
    old = torch.where(mask.bool(), current + 0.3 * torch.randn(current.shape, generator=gen), 0.0)
    ref = torch.where(mask.bool(), current + 0.2 * torch.randn(current.shape, generator=gen), 0.0)
    advantages = torch.where(mask.bool(), torch.randn(current.shape, generator=gen), 0.0)
    return {"prompts": prompts, "responses": responses, "response_mask": mask, "old_log_probs": old,
            "ref_log_probs": ref, "advantages": advantages}


def critic_batch(size: int = 8) -> dict[str, torch.Tensor]:
    prompts, responses, mask = random_sequences(size, 5, 6, seed=5)
    gen = torch.Generator().manual_seed(6)
    values = torch.where(mask.bool(), 0.3 * torch.randn(mask.shape, generator=gen), 0.0)
    returns = torch.where(mask.bool(), torch.randn(mask.shape, generator=gen), 0.0)
    return {"prompts": prompts, "responses": responses, "response_mask": mask, "values": values, "returns": returns}


def _recompute(trained: RoleModel) -> str:
    """The recomputation the wrapped module really does (engines.recompute's marks on it)."""
    module = trained.module
    if module.is_gradient_checkpointing:
        return "full"
    return "selective" if module.config._attn_implementation.startswith(SELECTIVE_PREFIX) else "none"


def _dp_actor(rank: int, world: int, data: dict, mini_batches: int, epochs: int) -> list:
    out = []
    local = {k: v.chunk(world)[rank] for k, v in data.items()}
    for shard, micro_batch, recompute in CONFIGS:
        trained = RoleModel(llama_actor(), dp_mesh(world, shard), HP, "cpu", torch.float32, pad_id=PAD, lr=LR,
                            recompute=recompute)
        metrics = trained.update_actor(local, mini_batches=mini_batches, epochs=epochs, micro_batch=micro_batch,
                                       use_kl_loss=True)
        out.append({"metrics": metrics, "params": full_params(trained.module), "recompute": _recompute(trained)})
    return out


def _dp_critic(rank: int, world: int, data: dict, mini_batches: int, epochs: int) -> list:
    out = []
    local = {k: v.chunk(world)[rank] for k, v in data.items()}
    for shard, micro_batch, recompute in CONFIGS:
        trained = RoleModel(llama_critic(), dp_mesh(world, shard), HP, "cpu", torch.float32, pad_id=PAD, lr=LR,
                            recompute=recompute)
        metrics = trained.update_critic(local, "values", "returns", mini_batches=mini_batches, epochs=epochs,
                                        micro_batch=micro_batch)
        out.append({"metrics": metrics, "params": full_params(trained.module), "recompute": _recompute(trained)})
    out.append(_bad_updates(trained, local, rank))
    return out


def _bad_updates(trained: RoleModel, local: dict, rank: int) -> list[str]:
    """Bad calls fail with a clear error on every rank instead of hanging in a collective."""
    errors = []
    uneven = {k: v[:2] for k, v in local.items()} if rank == 1 else local
    calls = [(local, 3, "returns"), (local, 1, "cost_returns"), (uneven, 1, "returns")]
    for batch, mini_batches, return_key in calls:
        try:
            trained.update_critic(batch, "values", return_key, mini_batches=mini_batches, epochs=1, micro_batch=1)
            errors.append("no error")
        except (ValueError, KeyError) as bad:
            errors.append(str(bad))
    return errors


def _global_mini_batches(data: dict, world: int, mini_batches: int) -> list[dict]:
    """Global mini-batch k is the k-th part of every rank's shard."""
    shards = [{k: v.chunk(world)[r] for k, v in data.items()} for r in range(world)]
    return [{k: torch.cat([s[k].chunk(mini_batches)[i] for s in shards]) for k in data} for i in range(mini_batches)]


def _reference(model, data, mini_batches, epochs, loss_fn):
    """Plain single-process training: one forward over each whole mini-batch, plain token means."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=HP.weight_decay)
    seen = []
    for _ in range(epochs):
        for mb in _global_mini_batches(data, WORLD, mini_batches):
            loss, metric = loss_fn(model, mb)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), HP.max_grad_norm)
            opt.step()
            seen.append((metric, norm.item()))
    return full_params(model), sum(m for m, _ in seen) / len(seen), sum(n for _, n in seen) / len(seen)


def _actor_loss(model, mb):
    mask = mb["response_mask"].bool()
    joined = sequences.join(mb["prompts"], mb["responses"], mb["response_mask"], PAD)
    logp, entropy = forward.response_log_probs(model, joined, mb["responses"], HP.temperature, with_entropy=True)
    ratio = torch.exp(logp - mb["old_log_probs"])
    adv = mb["advantages"]
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - HP.clip_ratio, 1 + HP.clip_ratio))[mask].mean()
    delta = mb["ref_log_probs"] - logp
    kl = (torch.exp(delta) - delta - 1)[mask].mean()
    return surrogate - HP.entropy_coef * entropy[mask].mean() + HP.kl_loss_coef * kl, surrogate.item()


def _critic_loss(model, mb):
    mask = mb["response_mask"].bool()
    joined = sequences.join(mb["prompts"], mb["responses"], mb["response_mask"], PAD)
    v = model(input_ids=joined.input_ids, attention_mask=joined.attention_mask,
              position_ids=joined.position_ids).logits[..., 0]
    v = sequences.response_predictions(v, joined.prompt_len, mask.shape[1])
    old, ret = mb["values"], mb["returns"]
    clipped = old + (v - old).clamp(-HP.value_clip, HP.value_clip)
    loss = (0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2))[mask].mean()
    return loss, loss.item()


def _assert_matches(results, ref_params, ref_metric, ref_norm, metric_name, initial):
    for index, config in enumerate(CONFIGS):
        for rank_out in results:
            got = rank_out[index]
            assert got["recompute"] == config[2]
            assert got["metrics"][metric_name] == pytest.approx(ref_metric, abs=1e-5), config
            assert got["metrics"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5), config
            for name, value in ref_params.items():
                torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=0, msg=f"{config} {name}")
    moved = max((ref_params[n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 100 * 1e-5  # the step is large against the tolerance


@pytest.mark.slow
def test_actor_update_on_two_ranks_matches_single_process():
    data = actor_batch()
    results = run_world(_dp_actor, WORLD, data, 2, 1, timeout=120)
    ref_params, ref_loss, ref_norm = _reference(llama_actor(), data, 2, 1, _actor_loss)
    assert ref_norm > HP.max_grad_norm  # clipping is active
    _assert_matches(results, ref_params, ref_loss, ref_norm, "policy_loss", full_params(llama_actor()))
    metrics = results[0][0]["metrics"]
    assert 0 < metrics["clip_frac"] < 1 and metrics["kl"] > 0 and metrics["lr"] == LR
    assert results[0][0]["metrics"] == results[1][0]["metrics"]


@pytest.mark.slow
def test_critic_update_on_two_ranks_matches_single_process():
    data = critic_batch()
    results = run_world(_dp_critic, WORLD, data, 1, 2, timeout=120)
    ref_params, ref_loss, ref_norm = _reference(llama_critic(), data, 1, 2, _critic_loss)
    _assert_matches([r[:-1] for r in results], ref_params, ref_loss, ref_norm, "value_loss",
                    full_params(llama_critic()))
    assert 0 < results[0][0]["metrics"]["value_clip_frac"] < 1
    for rank_out in results:
        split, missing, uneven = rank_out[-1]
        assert "do not split into 3" in split
        assert "cost_returns" in missing
        assert "different batch sizes" in uneven
